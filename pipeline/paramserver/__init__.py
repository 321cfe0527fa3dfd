"""Versioned weight snapshots in object storage: the trainer publishes, rollout workers pull.

Layout under the run's store (``weights/``):

* ``v{version:08d}/{full|delta}-{group}-{i:05d}-{attempt}.bin``: shard objects, each the
  concatenated bytes of some tensor *pieces* (``pipeline.weight_codec``). ``group`` is
  ``all`` for pieces every reader needs (unsplit tensors) or ``r{rank:03d}`` for the pieces of
  one rank of the sampler's tensor-parallel mesh, so a host downloads only its ranks' objects.
  The attempt id makes every publish attempt write its own objects, so a crashed or racing
  attempt can never leave bytes that a later attempt's manifest would describe wrongly.
* ``v{version:08d}/manifest.json``: written create-only after all shards; its existence is the
  commit (format 2, ``manifest``; format 1, the full-snapshot-only layout of earlier runs, is
  still read).
* ``LATEST``: ``{"version", "epoch"}``, moved by CAS, forward only.
* ``EPOCH``: the trainer fencing token, incremented by CAS in ``acquire_epoch``.
* ``refused/v{version:08d}-{reader}.json``: a reader's damage report (create-only);
  ``quarantine/v{version:08d}-{stamp}/``: the objects a repair replaced (``repair``,
  docs/parameter-server.md, *Repairs*).

A version holds a *full* snapshot, a *delta* against version ``base`` (= version - 1: the XOR
of bit patterns, zstd-compressed), or both. Its manifest names ``anchor``, the nearest full
snapshot at or below it: version ``v`` is rebuilt from the full snapshot of ``anchor`` and the
deltas ``anchor + 1 .. v``, or from a version ``h`` a reader already holds and the deltas
``h + 1 .. v``. Per tensor the manifest records the crc32c of every reconstructed piece, so a
reader verifies what it rebuilt, not only what it downloaded; a chain with a hole, or a piece
that fails, sends the reader back to the anchor, and a version that cannot be rebuilt is
refused (the caller keeps the weights it has).

Fencing: ``acquire_epoch`` also stamps its epoch into LATEST, and LATEST is only ever moved by
CAS from a value whose epoch is not newer than the writer's. A trainer that lost its epoch
(a zombie) therefore cannot move LATEST once the new trainer has acquired, even if it passed
its own epoch checks just before.

Modules: ``server`` (``ParamServer``: epochs, LATEST, publish and pull, retention, healing),
``snapshot`` (``Snapshot``: tensors in hand cut into pieces), ``manifest`` (keys and the
manifest format), ``publish`` (the writing side), ``pull`` (the reading side: parallel
ranged reads and the rebuild of pieces), ``errors``, and ``publishing`` (``Publisher``: a
trainer's policy of full or delta versions, the delta base, retention and repairs; import it
from there: it uses ``pipeline.retention``, which uses this package).
"""

from pipeline.paramserver.errors import (
    CorruptSnapshotError,
    ParamServerError,
    SnapshotNotFoundError,
    StaleEpochError,
    UnrecoverableVersionError,
)
from pipeline.paramserver.server import DEFAULT_RANGE_BYTES, DEFAULT_SHARD_BYTES, ParamServer
from pipeline.paramserver.snapshot import Snapshot, split_axes_of

__all__ = [
    "CorruptSnapshotError",
    "DEFAULT_RANGE_BYTES",
    "DEFAULT_SHARD_BYTES",
    "ParamServer",
    "ParamServerError",
    "Snapshot",
    "SnapshotNotFoundError",
    "StaleEpochError",
    "split_axes_of",
    "UnrecoverableVersionError",
]
