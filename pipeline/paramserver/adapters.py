"""Adapter-only versions of a LoRA run (`pipeline.lora`): what they record, and how a
sampling role turns one into the weights it samples with.

A LoRA run's version holds its adapter tensors only (`<module>.lora_a`, `<module>.lora_b`),
megabytes instead of the whole model; its manifest's metadata names the frozen base it was
trained on by digest (``base_digest``) and the adapters' scale alpha / rank
(``lora_scale``). The base is the run's ``base/`` snapshot (SFT or an HF import publishes
it, `pipeline.run.base_server`), which retention of ``weights/`` never touches
(`pipeline.retention` works on the weights server only), so the base outlives every
version that needs it.

The base digest is the SHA-256 of the base snapshot's manifest content: each tensor's name,
shape, dtype and the crc32c of its pieces (format 2), or the shards' sizes and crc32c
(format 1, which has no per-tensor hashes). It changes exactly when the base's bits do,
whatever the publish attempt, time or epoch.

`PolicyReader.pull` is the sampling roles' pull (rollout worker, evaluator): a full version
as it is stored; an adapter version checked against the base it holds (`BaseMismatchError`
naming both digests when they differ) and merged into it once per version
(`pipeline.lora.merge`), so samplers and decode layouts read plain kernels. Delta versions
(``paramserver.full_every > 1``) work on adapters like on full weights: the held adapter
snapshot is the base of the next rebuild.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pipeline.lora import is_adapter, merge
from pipeline.paramserver.errors import ParamServerError, SnapshotNotFoundError
from pipeline.paramserver.manifest import dumps, normalize
from pipeline.paramserver.server import ParamServer
from pipeline.paramserver.snapshot import Snapshot

__all__ = [
    "BASE_DIGEST",
    "LORA_SCALE",
    "BaseMismatchError",
    "PolicyReader",
    "adapter_metadata",
    "base_digest",
    "server_base_digest",
]

BASE_DIGEST = "base_digest"  # manifest metadata: the digest of the base the adapters need
LORA_SCALE = "lora_scale"  # manifest metadata: alpha / rank


class BaseMismatchError(ParamServerError):
    """Adapters trained on another base than the one this reader holds (not a damaged
    version: republishing cannot fix it)."""


def base_digest(manifest: dict[str, Any]) -> str:
    """The digest of a base snapshot from its manifest (module doc): "sha256:<hex>"."""
    m = normalize(manifest)
    tensors = sorted(
        (t["name"], list(t["shape"]), t["dtype"], t.get("crc32c")) for t in m["tensors"]
    )
    content: dict[str, Any] = {"tensors": tensors}
    if any(t[3] is None for t in tensors):  # format 1: the shards' hashes instead
        content["shards"] = sorted((s["size"], s["crc32c"]) for s in m["full"]["shards"])
    return "sha256:" + hashlib.sha256(dumps(content)).hexdigest()


def server_base_digest(base: ParamServer) -> tuple[int, str]:
    """(version, digest) of the newest base snapshot on `base` (the run's `base/` server);
    SnapshotNotFoundError when it has none."""
    version = base.latest_version()
    if version is None:
        raise SnapshotNotFoundError(f"no base snapshot under {base.store.url}")
    return version, base_digest(base.manifest(version))


def adapter_metadata(digest: str, scale: float) -> dict[str, Any]:
    """The manifest metadata of an adapter version (besides its step)."""
    return {BASE_DIGEST: digest, LORA_SCALE: float(scale)}


class PolicyReader:
    """The weights a sampling role samples with, version by version (module doc).

    `ps`: the run's weights; `base`: its base server, read once, on the first adapter
    version."""

    def __init__(self, ps: ParamServer, base: ParamServer) -> None:
        self.ps, self.base = ps, base
        self._held: Snapshot | None = None  # the last version as stored (adapters or full)
        self._base: Snapshot | None = None
        self._base_digest: str | None = None

    def pull(self, version: int, held: int | None = None) -> Snapshot:
        """The weights of `version`, full: the stored snapshot, or the held base with the
        version's adapters merged. `held`: the version the caller holds now (its snapshot,
        kept here, is rebuilt from with the deltas in between; None: from the anchor).
        Raises what `ParamServer.pull` raises, and BaseMismatchError when the adapters need
        a base this reader does not hold."""
        have = self._held if self._held is not None and self._held.version == held else None
        snap = self.ps.pull(version, have=have)
        meta = snap.metadata or {}
        if BASE_DIGEST not in meta:
            self._held = snap
            return snap
        base = self._base_snapshot(meta[BASE_DIGEST], version)
        names = sorted(snap.tensors)
        stray = [n for n in names if not is_adapter(n)]
        if stray:
            raise ParamServerError(
                f"v{version} names base {meta[BASE_DIGEST]} but holds non-adapter tensors "
                f"{stray[:3]}; allowed: <module>.lora_a / <module>.lora_b only"
            )
        merged = merge(base.tensors, snap.tensors, float(meta[LORA_SCALE]))
        self._held = snap
        return Snapshot(version, merged, metadata=dict(meta), epoch=snap.epoch)

    def _base_snapshot(self, want: str, version: int) -> Snapshot:
        if self._base is None:
            base_version, self._base_digest = server_base_digest(self.base)
            if self._base_digest == want:
                self._base = self.base.pull(base_version)
        if self._base_digest != want:
            raise BaseMismatchError(
                f"v{version} holds LoRA adapters of base {want}, but this reader's base "
                f"({self.base.store.url}) is {self._base_digest}; a worker samples only with "
                "the base the trainer trained on: restore that base or start a new run"
            )
        return self._base
