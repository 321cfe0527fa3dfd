"""Trainer checkpoints with Orbax's CheckpointManager (local directory or gs://).

A checkpoint holds the parameter and optimizer-state leaves plus a JSON record (step,
next batch index, epoch, config digest). Orbax writes each step to a temporary
directory and renames it on commit (or writes a commit marker on GCS), so a save
interrupted by a kill never hides the previous good step.

Verified restores. Orbax's commit protects against torn writes, not against bytes that change
later (a bad disk, a bit flip, a careless hand): a checkpoint with four flipped bytes was once
restored without complaint. So every committed step gets a content manifest,
`checkpoint_manifests/{step:08d}.json` (the CRC32C and size of each file under
`checkpoints/{step}/`, read back from the store), written by a thread of ours once Orbax has
finished the step (commit and metadata included; Orbax's own post-finalization callback
runs before the rename that commits). `restore_latest` verifies the newest step against its
manifest and falls back to older steps when a file is missing, changed or extra, or has no
manifest (a kill between commit and manifest), naming each step it refuses.

Leaves are stored as a flat numbered dict and re-assembled with the live tree
structure: the pytree types of NNX/Optax state need no Orbax-specific handling.
Sharded state (a trainer mesh): leaves spanning several hosts are handed to Orbax as
global arrays (each process writes its shards); on restore every leaf gets the sharding of
the template's leaf (Orbax reads each device's slice), so a checkpoint restores onto the
mesh it is restored for, whichever mesh wrote it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import google_crc32c
import jax
import numpy as np
import orbax.checkpoint as ocp

from pipeline.run import CHECKPOINT_MANIFESTS as MANIFESTS
from pipeline.run import CHECKPOINTS_PREFIX, Run
from pipeline.storage import ObjectNotFound, ObjectStore, local_path, split_url

log = logging.getLogger(__name__)


class CheckpointCorruptError(RuntimeError):
    """Every checkpoint of the run failed verification."""


def manifest_key(step: int) -> str:
    return f"{MANIFESTS}/{step:08d}.json"


def _step_files(store: ObjectStore, step: int) -> list[str]:
    return store.list(f"{CHECKPOINTS_PREFIX}/{step}/")


def content_manifest(store: ObjectStore, step: int) -> dict[str, Any]:
    """{"step", "files": {key: {"crc32c", "bytes"}}} of checkpoint `step` as stored."""
    files = {}
    for key in _step_files(store, step):
        data = store.read(key)
        files[key] = {"crc32c": f"{google_crc32c.value(data):08x}", "bytes": len(data)}
    return {"step": step, "files": files}


def verify_step(store: ObjectStore, step: int) -> str | None:
    """None if checkpoint `step` matches its manifest, else what is wrong."""
    try:
        want = json.loads(store.read(manifest_key(step)))["files"]
    except ObjectNotFound:
        return "it has no content manifest (written after the commit: a kill came between)"
    except (ValueError, KeyError, TypeError) as err:
        return f"its manifest {manifest_key(step)} is unreadable ({err})"
    have = set(_step_files(store, step))
    if have - set(want):
        return f"it holds files its manifest does not list: {sorted(have - set(want))[:3]}"
    for key, expect in want.items():
        try:
            data = store.read(key)
        except ObjectNotFound:
            return f"{key} is missing"
        crc = f"{google_crc32c.value(data):08x}"
        if len(data) != expect["bytes"] or crc != expect["crc32c"]:
            return (
                f"{key} changed since it was written ({len(data)} bytes, crc32c {crc}; "
                f"written: {expect['bytes']} bytes, crc32c {expect['crc32c']})"
            )
    return None


def checkpoint_dir(run: Run) -> str:
    url = run.store.url.rstrip("/")
    path = local_path(url)
    if path is not None:
        return f"{path}/checkpoints"
    if split_url(url).scheme == "gs":
        _require_gcsfs(url)
    return f"{url}/{CHECKPOINTS_PREFIX}"


def _require_gcsfs(url: str) -> None:
    """Orbax does its gs:// directory I/O through etils.epath, whose backend is gcsfs
    (arrays go through TensorStore's own GCS driver)."""
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        raise RuntimeError(
            f"trainer checkpoints under {url}/checkpoints need gcsfs (Orbax's gs:// directory "
            "backend); install it: pip install gcsfs"
        ) from None


def _host_or_global(x: Any) -> Any:
    """A host copy (the caller may donate the device buffers right after `save`), except
    for arrays spanning processes, which only Orbax can write (shard by shard)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x
    return np.asarray(x)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """The restore target of a template leaf: shape, dtype and, for a JAX array, its
    sharding (Orbax then places each shard on its device)."""
    sharding = x.sharding if isinstance(x, jax.Array) else None
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)


class TrainerCheckpoints:
    """`log`: where refused checkpoints are reported (the trainer's log)."""

    def __init__(
        self,
        run: Run,
        keep: int = 2,
        async_save: bool = True,
        log: Callable[[str], None] = print,
    ) -> None:
        self.store = run.store
        self.log = log
        self.primary = jax.process_index() == 0
        self._manifest_thread: threading.Thread | None = None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        self.manager = ocp.CheckpointManager(
            checkpoint_dir(run), options=options, item_names=("state", "meta")
        )

    def _write_manifest_when_done(self, step: int) -> None:
        """Once Orbax has finished step `step`: write its content manifest and drop the
        manifests of steps Orbax's retention deleted."""
        self.manager.wait_until_finished()
        if not self.primary:
            return
        try:
            manifest = content_manifest(self.store, step)
            self.store.write_new(manifest_key(step), json.dumps(manifest).encode())
            kept = set(self.manager.all_steps())
            for key in self.store.list(f"{MANIFESTS}/"):
                old = int(key.rsplit("/", 1)[1].split(".")[0])
                if old not in kept and old != step:
                    self.store.delete(key)
        except Exception as err:  # noqa: BLE001 - in our thread: report, never raise
            log.exception("checkpoint manifest of step %s not written", step)
            self.log(f"[trainer] checkpoint manifest of step {step} not written: {err}")

    def save(self, step: int, tree: Any, meta: dict[str, Any]) -> None:
        leaves = {f"{i:05d}": _host_or_global(x) for i, x in enumerate(jax.tree.leaves(tree))}
        self._join_manifest()  # the previous save and its manifest
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)
            ),
        )
        self._manifest_thread = threading.Thread(
            target=self._write_manifest_when_done, args=(step,), daemon=True
        )
        self._manifest_thread.start()

    def _join_manifest(self) -> None:
        if self._manifest_thread is not None:
            self._manifest_thread.join()
            self._manifest_thread = None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, template: Any) -> tuple[Any, dict[str, Any]] | None:
        """The newest checkpoint that passes verification, as (tree, meta); None if there
        is none at all. Raises CheckpointCorruptError if there are checkpoints and every
        one is refused (starting over from the base would silently lose the run)."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        refused = []
        for step in steps:
            why = verify_step(self.store, step)
            if why is None:
                try:
                    return self._restore(step, template)
                except Exception as err:  # noqa: BLE001 - a checkpoint Orbax cannot read
                    why = f"Orbax could not restore it ({type(err).__name__}: {err})"
            refused.append(f"step {step}: {why}")
            self.log(
                f"[trainer] refused checkpoint {self.store.url_of(f'{CHECKPOINTS_PREFIX}/{step}')}: {why}; "
                "trying the previous one"
            )
        if refused:
            raise CheckpointCorruptError(
                "no checkpoint passed verification (" + "; ".join(refused) + "). Restore "
                f"{self.store.url_of(CHECKPOINTS_PREFIX)} from a copy, or delete it (and "
                f"{MANIFESTS}/) to start this run over from its base model"
            )
        return None

    def steps(self) -> list[int]:
        """The steps of the checkpoints Orbax holds (retention keeps the newest `keep`)."""
        return sorted(self.manager.all_steps())

    def restore_step(self, step: int, template: Any) -> tuple[Any, dict[str, Any]] | str:
        """Checkpoint `step` as (tree, meta) if it is held and passes verification, else
        why not (the trainer republishes a damaged weight version from it)."""
        if step not in self.steps():
            return f"no checkpoint of step {step} (held: {self.steps() or 'none'})"
        why = verify_step(self.store, step)
        if why is not None:
            return f"the checkpoint of step {step} is refused: {why}"
        try:
            return self._restore(step, template)
        except Exception as err:  # noqa: BLE001 - a checkpoint Orbax cannot read
            return f"Orbax could not restore step {step} ({type(err).__name__}: {err})"

    def _restore(self, step: int, template: Any) -> tuple[Any, dict[str, Any]]:
        leaves, treedef = jax.tree.flatten(template)
        abstract = {f"{i:05d}": _abstract(x) for i, x in enumerate(leaves)}
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        restored = [jax.numpy.asarray(out["state"][f"{i:05d}"]) for i in range(len(leaves))]
        return jax.tree.unflatten(treedef, restored), dict(out["meta"])

    def wait(self) -> None:
        self._join_manifest()
        self.manager.wait_until_finished()
