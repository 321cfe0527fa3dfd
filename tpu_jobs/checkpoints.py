"""Trainer checkpoints with Orbax's CheckpointManager (local directory or gs://).

A checkpoint holds the parameter and optimizer-state leaves plus a JSON record (step,
next batch index, epoch, config digest). Orbax writes each step to a temporary
directory and renames it on commit (or writes a commit marker on GCS), so a save
interrupted by a kill never hides the previous good step.

Leaves are stored as a flat numbered dict and re-assembled with the live tree
structure: the pytree types of NNX/Optax state need no Orbax-specific handling.
Sharded state (a trainer mesh): leaves spanning several hosts are handed to Orbax as
global arrays (each process writes its shards); on restore every leaf gets the sharding of
the template's leaf (Orbax reads each device's slice), so a checkpoint restores onto the
mesh it is restored for, whichever mesh wrote it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from pipeline.run import Run


def checkpoint_dir(run: Run) -> str:
    url = run.store.url.rstrip("/")
    if url.startswith("file://"):
        url = url[len("file://") :]
    elif url.startswith("gs://"):
        _require_gcsfs(url)
    return f"{url}/checkpoints"


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
    def __init__(self, run: Run, keep: int = 2, async_save: bool = True) -> None:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        self.manager = ocp.CheckpointManager(
            checkpoint_dir(run), options=options, item_names=("state", "meta")
        )

    def save(self, step: int, tree: Any, meta: dict[str, Any]) -> None:
        leaves = {f"{i:05d}": _host_or_global(x) for i, x in enumerate(jax.tree.leaves(tree))}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, template: Any) -> tuple[Any, dict[str, Any]] | None:
        step = self.manager.latest_step()
        if step is None:
            return None
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
        self.manager.wait_until_finished()
