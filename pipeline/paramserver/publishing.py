"""The trainer's publishing policy: what it writes to the parameter server, and when.

A `Publisher` takes the policy's tensors as host (NumPy) arrays and decides everything a
trainer's publish involves, composing what the parameter server already does
(`ParamServer.publish_snapshot`, `pull`, `damage`, `derive`, `repair`) and
`pipeline.retention`:

* **full or delta**: with `full_every > 1` a version is stored as an XOR delta against the
  version before, and as a full snapshot too at multiples of `full_every` or when no base
  can be had (docs/parameter-server.md);
* **the delta base**: the snapshot it published last (its tensors as published), kept in
  hand so the next delta needs no download; after a restart, or a retry of a committed
  version, the base is pulled back from the store;
* **retention** (`keep_versions` > 0): after each publish, the versions no reader needs
  are deleted (`pipeline.retention.apply_retention`);
* **repairs**: a version found committed but damaged when it is published again (a resume)
  is republished from the tensors in hand; a version a rollout worker reports damaged
  (`heal`) is let go when nothing needs it any more, else republished with the exact bits
  it was published with, from the first source that has them: the owner's parameters,
  an intact chain in the store, the checkpoint of its step (`HeldCopies`). Where none has
  them, `UnrecoverableVersionError` says in one line what to restore.

Nothing here imports JAX: the trainer hands over flat host arrays and the function that
says along which axis the sampler's mesh cuts each tensor (`tpu_jobs.model.mesh.split_axes`),
and the tests drive the policy with NumPy arrays alone (tests/pipeline/test_publishing.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipeline import weight_codec
from pipeline.leases import BatchLeases
from pipeline.paramserver.adapters import adapter_metadata
from pipeline.paramserver.errors import (
    CorruptSnapshotError,
    SnapshotNotFoundError,
    UnrecoverableVersionError,
)
from pipeline.paramserver.server import ParamServer
from pipeline.paramserver.snapshot import Snapshot
from pipeline.retention import RetentionResult, apply_retention
from pipeline.rollouts import required_version
from pipeline.storage import StorageError

__all__ = ["HeldCopies", "PublishPolicy", "Publisher", "SplitAxes"]

# {tensor name: shape}, tensor ranks -> {tensor name: the axis the ranks split, or None}.
SplitAxes = Callable[[Mapping[str, Sequence[int]], int], dict[str, int | None]]


@dataclass(frozen=True, kw_only=True)
class PublishPolicy:
    """How a trainer publishes, from its run config (`paramserver`, `trainer`, `rollout`).

    dtype: the published dtype of floating tensors (`weight_codec.PUBLISH_DTYPES`).
    parts: tensor ranks of the sampler's mesh a version is cut into.
    full_every: every `full_every`-th version is a full snapshot, the others deltas.
    publish_every: trainer steps per version (version = step // publish_every).
    keep_versions: versions retention keeps besides the protected ones; 0: keep all.
    max_staleness: how many versions old a batch may be: which versions are still needed.
    clock_skew_s: how far a lease holder's clock may run behind (retention).
    base_digest: a LoRA run's: its versions are adapters of the base with this digest
    (`pipeline.paramserver.adapters`), recorded in every manifest with `lora_scale`.
    """

    dtype: str
    parts: int
    full_every: int
    publish_every: int
    keep_versions: int
    max_staleness: int
    clock_skew_s: float
    base_digest: str | None = None
    lora_scale: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in weight_codec.PUBLISH_DTYPES:
            raise ValueError(
                f"PublishPolicy.dtype={self.dtype!r} is invalid; allowed: "
                + ", ".join(weight_codec.PUBLISH_DTYPES)
            )
        minimum = {"parts": 1, "full_every": 1, "publish_every": 1}
        minimum |= {"keep_versions": 0, "max_staleness": 0, "clock_skew_s": 0}
        for name, low in minimum.items():
            if getattr(self, name) < low:
                raise ValueError(
                    f"PublishPolicy.{name}={getattr(self, name)!r} is invalid; allowed: >= {low}"
                )


class HeldCopies(Protocol):
    """Exact copies of published versions that the publisher's owner (the trainer) holds
    outside the store, asked for by `Publisher.heal` in this order."""

    #: Where the owner's checkpoints live (named in the error when nothing has a version).
    checkpoints_url: str

    def parameters(self) -> dict[str, np.ndarray]:
        """The owner's current parameters, flat, as host arrays (not yet cast)."""
        ...

    def checkpoint(self, step: int) -> dict[str, np.ndarray] | str:
        """The parameters of the checkpoint of `step`, flat host arrays, or why there are
        none (a phrase, e.g. "no checkpoint of step 5 (held: 3, 4)")."""
        ...


class Publisher:
    """A trainer's publishing policy (module doc) over one parameter server.

    `split_axes`: the axis the sampler's mesh cuts each tensor along
    (`tpu_jobs.model.mesh.split_axes`). `log`: one line per decision worth reading."""

    def __init__(
        self,
        ps: ParamServer,
        leases: BatchLeases,
        policy: PublishPolicy,
        split_axes: SplitAxes,
        *,
        log: Callable[[str], None] = print,
    ) -> None:
        self.ps = ps
        self.leases = leases
        self.policy = policy
        self.split_axes = split_axes
        self.log = log
        # The last version published here (its tensors as published): the base of the next
        # delta. None: pull it back from the store when a delta needs it.
        self._published: Snapshot | None = None
        # Every manifest of a LoRA run names its base (written and repaired versions alike).
        self._metadata = {}
        if policy.base_digest is not None:
            self._metadata = adapter_metadata(policy.base_digest, policy.lora_scale)

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, version: int, tensors: dict[str, np.ndarray]) -> Snapshot:
        """`tensors` in the published dtype, as own host copies (arrays viewing device
        buffers would change when the train state is donated to the next step, and the next
        delta is taken against these), cut into the pieces of the sampler's mesh: cut once,
        for publish and as the next delta's base."""
        cast = weight_codec.cast_for_publish(tensors, self.policy.dtype)
        owned = {k: np.array(v, copy=True) if v is tensors[k] else v for k, v in cast.items()}
        return self._cut(version, owned)

    def _cut(self, version: int, tensors: dict[str, np.ndarray]) -> Snapshot:
        parts = self.policy.parts
        split = self.split_axes({k: v.shape for k, v in tensors.items()}, parts)
        return Snapshot.of(version, tensors, split, parts)

    def _own_copy(self, snap: Snapshot) -> Snapshot:
        """A pulled snapshot re-cut as this publisher cuts (own host arrays)."""
        return self._cut(snap.version, {k: np.array(v, copy=True) for k, v in snap.tensors.items()})

    # -------------------------------------------------------------------- publish
    def publish(
        self,
        version: int,
        tensors: dict[str, np.ndarray],
        *,
        epoch: int,
        step: int,
        next_batch: int,
    ) -> bool:
        """Publish `tensors` (flat host arrays) as `version` of trainer step `step`: full or
        a delta, a committed-but-damaged version repaired, then retention (`next_batch`: the
        trainer's next batch, whose pending versions stay). True if this call wrote the
        version, False if it was committed already (a retry). StaleEpochError when a newer
        trainer owns the run."""
        policy = self.policy
        snap = self.snapshot(version, tensors)
        base = self._delta_base(version) if policy.full_every > 1 and version > 0 else None
        full = base is None or version % policy.full_every == 0
        try:
            wrote = self.ps.publish_snapshot(
                snap,
                epoch=epoch,
                metadata={"step": step, **self._metadata},
                base=base,
                full=full,
                full_every=policy.full_every,
            )
            damage = None if wrote else self.ps.damage(version)
        except CorruptSnapshotError as err:  # a committed manifest that is not readable
            wrote, damage = False, str(err)
        if damage is not None:
            # A retry (a resume) found its version committed but damaged: it holds the
            # very tensors, so it republishes them (the same bits) instead of waiting.
            self._repair(snap, damage, "the trainer's parameters", epoch)
        # A retry of a committed version leaves its stored bits as the next base (pulled).
        self._published = snap if wrote and policy.full_every > 1 else None
        if wrote:
            kind = "full" if full else "delta"
            self.log(f"published v{version} (step {step}, {kind})")
        if policy.keep_versions:
            self.retain(next_batch, epoch)
        return wrote

    def _delta_base(self, version: int) -> Snapshot | None:
        """Version - 1 as stored (complete), or None (then a full snapshot is written)."""
        if self._published is not None and self._published.version == version - 1:
            return self._published
        try:
            return self.ps.pull(version - 1)
        except (CorruptSnapshotError, SnapshotNotFoundError) as err:
            self.log(f"v{version - 1} unusable as a delta base ({err}); full v{version}")
            return None

    def retain(self, next_batch: int, epoch: int) -> RetentionResult | None:
        """Delete weight versions no reader needs (`apply_retention`); None when storage
        failed (housekeeping: the next publish retries it). StaleEpochError propagates."""
        policy = self.policy
        try:
            result = apply_retention(
                self.ps,
                self.leases,
                keep_last=policy.keep_versions,
                next_batch=next_batch,
                publish_every=policy.publish_every,
                max_staleness=policy.max_staleness,
                epoch=epoch,
                clock_skew_s=policy.clock_skew_s,
            )
        except StorageError as err:
            self.log(f"retention skipped: {err}")
            return None
        if result.deleted:
            self.log(f"retention deleted v{result.deleted}, kept v{result.kept}")
        return result

    # -------------------------------------------------------------------- repairs
    def heal(self, *, step: int, next_batch: int, epoch: int, copies: HeldCopies) -> None:
        """Act on the rollout workers' damage reports (`ParamServer.report_refused`), for a
        trainer at `step` whose next batch is `next_batch`. A version no pending batch or
        live lease needs any more is let go; one the trainer has not reached yet is repaired
        when it publishes it (`publish`); any other is republished with its exact bits from
        the first source that has them. UnrecoverableVersionError (one line) when none has."""
        reports = self.ps.refused()
        if not reports:
            return
        policy = self.policy
        current = step // policy.publish_every
        oldest = required_version(next_batch, policy.publish_every, policy.max_staleness)
        leased = {lease.version for lease in self.leases.live_leases()}
        for version, reasons in sorted(reports.items()):
            if version > current:
                continue  # not reached yet: `publish` verifies it then
            if version < oldest and version not in leased:
                self.ps.clear_reports(version)
                self.log(f"v{version} was reported damaged but is no longer needed")
                continue
            damage = self.ps.damage(version)
            if damage is None:  # repaired meanwhile, or a passing fault of the reader
                self.ps.clear_reports(version)
                continue
            source, snap = self._exact_version(version, step, damage, copies)
            self._repair(snap, f"a rollout worker refused it: {reasons[0]}", source, epoch)

    def _exact_version(
        self, version: int, step: int, damage: str, copies: HeldCopies
    ) -> tuple[str, Snapshot]:
        """(where from, the snapshot) of `version` with the bits it was published with:
        the owner's parameters when they are that version's; else any intact chain in the
        store (`ParamServer.derive`); else the checkpoint of its step."""
        version_step = version * self.policy.publish_every
        # The parameters are the version's only at its own step (publish_every > 1).
        if step == version_step:
            return "the trainer's parameters", self.snapshot(version, copies.parameters())
        derived = self.ps.derive(version)
        if derived is not None:
            return "an intact chain of older versions", self._own_copy(derived)
        restored = copies.checkpoint(version_step)
        if not isinstance(restored, str):
            return f"the checkpoint of step {version_step}", self.snapshot(version, restored)
        weights = self.ps.store.url_of(f"weights/v{version:08d}/")
        message = (
            f"weight version v{version} is damaged ({damage}) and no exact copy is left "
            f"({restored}; no intact chain of older versions; the trainer holds "
            f"v{step // self.policy.publish_every}): restore {weights} (or the checkpoint of "
            f"step {version_step} under {copies.checkpoints_url}) from a copy and "
            "restart the trainer, or start a new run"
        )
        raise UnrecoverableVersionError(" ".join(message.split()))  # one line, whatever

    def _repair(self, snap: Snapshot, why: str, source: str, epoch: int) -> None:
        """Republish `snap` (exact bits) over its damaged version (`ParamServer.repair`),
        with a delta against the version before when that one still pulls."""
        version, policy = snap.version, self.policy
        base = None
        if policy.full_every > 1 and version > 0:
            derived = self.ps.derive(version - 1)
            base = None if derived is None else self._own_copy(derived)
        moved = self.ps.repair(
            snap,
            epoch=epoch,
            base=base,
            metadata={
                "step": version * policy.publish_every,
                "repaired": why,
                **self._metadata,
            },
            full_every=policy.full_every,
        )
        if self._published is not None and self._published.version == version:
            self._published = snap
        self.log(
            f"v{version} was damaged ({why}); republished it from {source} "
            f"(same bits; the damaged objects are in {moved})"
        )
