"""Delta versions, published dtypes and per-rank pieces of the parameter server.

References are independent of the code under test: bit patterns of the tensors each version
was published from, the XOR and zstd of NumPy/zstandard called here, and byte counts of
the objects a reader actually fetched (a store wrapper that records every read)."""

from __future__ import annotations

import gc
import json
import uuid

import google_crc32c
import numpy as np
import pytest
import zstandard

from pipeline.leases import BatchLeases
from pipeline.paramserver import CorruptSnapshotError, ParamServer, Snapshot
from pipeline.paramserver.pull import BufferPool
from pipeline.retention import apply_retention
from pipeline.storage import GCSStore, LocalStore, MemoryStore, open_store
from pipeline.weight_codec import (
    BLOCK_ELEMS,
    DeltaError,
    apply_delta,
    cast_for_publish,
    encode_delta,
)
from tests.pipeline.test_paramserver import _assert_exact, _flip_byte
from tests.pipeline.test_retention import HookedStore

ml_dtypes = pytest.importorskip("ml_dtypes")


def _version(v: int) -> dict[str, np.ndarray]:
    """Weights at version v: a few elements move per version (as in RL), the rest stay; odd
    values (NaN payloads, -0.0, infinities) and non-float dtypes ride along."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 12)).astype(np.float32)
    b16 = rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16)
    for u in range(1, v + 1):
        step = np.random.default_rng(u)
        idx = step.choice(w.size, 5, replace=False)
        w.reshape(-1)[idx] += np.float32(1e-3) * step.standard_normal(5).astype(np.float32)
        b16.reshape(-1)[u % b16.size] = ml_dtypes.bfloat16(u / 7)
    special = np.array([np.nan, -0.0, np.inf, v], dtype=np.float32)
    special.view(np.uint32)[0] = 0x7FC00000 | v  # a NaN payload that changes
    return {
        "w": w,
        "b16": b16,
        "special": special,
        "count": np.array(v, dtype=np.int64),
        "empty": np.zeros((0, 4), np.float32),
        "frozen": np.full((4, 4), v // 3, np.float32),  # changes every third version only
    }


def _publish_chain(ps: ParamServer, versions, full_every: int, **layout) -> None:
    epoch = ps.acquire_epoch()
    prev = None
    for v in versions:
        tensors = _version(v)
        full = prev is None or v % full_every == 0
        ps.publish(v, tensors, epoch=epoch, base=prev, full=full, full_every=full_every, **layout)
        prev = Snapshot.of(v, tensors, layout.get("split"), layout.get("parts", 1))


@pytest.fixture(params=["local", "memory"])
def ps(request, tmp_path) -> ParamServer:
    store = (
        LocalStore(tmp_path / "store")
        if request.param == "local"
        else open_store(f"memory://deltas-{tmp_path.name}")
    )
    return ParamServer(store.child("run"), shard_bytes=512, max_workers=4)


def test_codec_is_xor_of_bit_patterns_in_byte_planes() -> None:
    old = np.array([1.0, -0.0, np.nan, 3.0], np.float32)
    new = np.array([1.0, 0.0, np.inf, 3.0000002], np.float32)
    blob = encode_delta(new, old)
    x = new.view(np.uint32) ^ old.view(np.uint32)
    planes = x.view(np.uint8).reshape(-1, 4).T.tobytes()  # byte 0 of each word, then byte 1..
    assert zstandard.ZstdDecompressor().decompress(blob) == planes
    rebuilt, crc = apply_delta(blob, old)
    assert rebuilt.tobytes() == new.tobytes() and crc == google_crc32c.value(new.tobytes())
    assert cast_for_publish({"a": old, "i": np.arange(3)}, "bfloat16")["i"].dtype == np.int64
    with pytest.raises(ValueError, match="allowed: float32, bfloat16"):
        cast_for_publish({"a": old}, "float16")


def test_codec_cuts_byte_planes_in_blocks_and_reads_the_unblocked_layout() -> None:
    """A piece longer than a block: the planes of each BLOCK_ELEMS elements in turn. An
    unchanged piece has an empty delta and keeps the held array. The unblocked layout of
    the first delta versions ("xor-byteplanes-zstd": the planes of the whole piece) still
    decodes."""
    rng = np.random.default_rng(5)
    old = rng.standard_normal(BLOCK_ELEMS + 1000).astype(ml_dtypes.bfloat16)
    new = old.copy()
    new[rng.choice(old.size, 5000, replace=False)] = ml_dtypes.bfloat16(0.5)
    x = (new.view(np.uint16) ^ old.view(np.uint16)).view(np.uint8).reshape(-1, 2)
    blocks = [x[:BLOCK_ELEMS].T.tobytes(), x[BLOCK_ELEMS:].T.tobytes()]
    blob = encode_delta(new, old)
    assert zstandard.ZstdDecompressor().decompress(blob) == b"".join(blocks)
    assert apply_delta(blob, old)[0].tobytes() == new.tobytes()
    unblocked = zstandard.ZstdCompressor().compress(x.T.tobytes())
    assert apply_delta(unblocked, old, "xor-byteplanes-zstd")[0].tobytes() == new.tobytes()
    assert encode_delta(old, old.copy()) == b""
    same, crc = apply_delta(b"", old)
    assert same is old and crc == google_crc32c.value(old.tobytes())
    with pytest.raises(DeltaError, match="short of its piece"):
        apply_delta(blob, np.zeros(old.size + 1, old.dtype))
    with pytest.raises(DeltaError, match="more than the piece"):
        apply_delta(blob, old[:-1])
    with pytest.raises(DeltaError, match="unknown delta codec 'lz4'"):
        apply_delta(blob, old, "lz4")


def test_chain_of_deltas_is_bit_identical_to_full_snapshots(ps: ParamServer) -> None:
    _publish_chain(ps, range(13), full_every=5)
    manifests = {v: ps.manifest(v) for v in range(13)}
    assert [v for v, m in manifests.items() if "full" in m] == [0, 5, 10]
    assert all("delta" in m and m["base"] == v - 1 for v, m in manifests.items() if v)
    assert [m["anchor"] for m in manifests.values()] == [0] * 5 + [5] * 5 + [10] * 3
    held = None
    for v in range(13):
        fresh = ps.pull(v)  # from the anchor
        _assert_exact(fresh.tensors, _version(v))
        assert fresh.full_from == v - v % 5 and fresh.deltas == tuple(range(v - v % 5 + 1, v + 1))
        before = None if held is None else {k: a.tobytes() for k, a in held.tensors.items()}
        nxt = ps.pull(v, have=held)  # step by step, across full versions too
        _assert_exact(nxt.tensors, _version(v))
        if held is not None:  # the held version is untouched (an unchanged piece is shared)
            assert {k: a.tobytes() for k, a in held.tensors.items()} == before
            assert (nxt.tensors["frozen"] is held.tensors["frozen"]) == (v % 3 != 0)
        held = nxt
        assert held.full_from is None if v else held.full_from == 0
    # A delta holds only what changed: far smaller than the full snapshot of its version.
    size = lambda m, kind: sum(s["size"] for s in m[kind]["shards"])  # noqa: E731
    assert size(manifests[7], "delta") < size(manifests[5], "full") / 2


def test_corrupt_delta_is_refused_and_held_weights_are_kept(ps: ParamServer) -> None:
    _publish_chain(ps, range(8), full_every=5)
    held = ps.pull(6)
    before = {k: v.tobytes() for k, v in held.tensors.items()}
    shard = max(ps.manifest(7)["delta"]["shards"], key=lambda s: s["size"])
    _flip_byte(ps.store, f"weights/{shard['key']}", offset=shard["size"] // 2)
    with pytest.raises(CorruptSnapshotError, match=r"v7: shard .* failed verification"):
        ps.pull(7, have=held)  # from v6, then from anchor v5: both need v7's delta
    assert {k: v.tobytes() for k, v in held.tensors.items()} == before
    _assert_exact(ps.pull(6).tensors, _version(6))  # v6 is still servable


def test_rebuilt_tensors_are_verified_not_only_downloaded(ps: ParamServer) -> None:
    """A held copy whose bits differ from the stored version (a reader's own bug) rebuilds
    wrong bytes from intact deltas: their crc32c catches it and the anchor path is taken."""
    _publish_chain(ps, range(8), full_every=5)
    good = ps.pull(6)
    wrong = {k: np.array(v) for k, v in good.tensors.items()}
    wrong["w"][0, 0] += 1
    bad = Snapshot.of(6, wrong)
    snap = ps.pull(7, have=bad)
    _assert_exact(snap.tensors, _version(7))
    assert snap.full_from == 5 and snap.deltas == (6, 7)
    with pytest.raises(CorruptSnapshotError, match="rebuilt 'w' piece 0 failed verification"):
        ps._rebuild(7, ps._read_normalized(7), bad, None)


def test_missing_delta_falls_back_to_the_nearest_full_snapshot(ps: ParamServer) -> None:
    _publish_chain(ps, range(8), full_every=5)
    held = ps.pull(3)
    ps.store.delete("weights/v00000004/manifest.json")  # a hole between v3 and v7
    snap = ps.pull(7, have=held)
    _assert_exact(snap.tensors, _version(7))
    assert snap.full_from == 5 and snap.deltas == (6, 7)


def test_late_joiner_reads_snapshot_30_and_deltas_31_to_37() -> None:
    store = open_store("memory://late-joiner")
    _publish_chain(ParamServer(store, shard_bytes=512), range(38), full_every=10)
    reads: list[str] = []
    reader = ParamServer(HookedStore(store, reads.append), shard_bytes=512)
    snap = reader.pull(37)
    _assert_exact(snap.tensors, _version(37))
    assert snap.full_from == 30 and snap.deltas == tuple(range(31, 38))
    data = sorted({k.split("/")[1] + "/" + k.split("/")[2].split("-")[0] for k in reads
                   if k.endswith(".bin")})  # fmt: skip
    assert data == ["v00000030/full"] + [f"v{v:08d}/delta" for v in range(31, 38)]
    manifests = sorted(k for k in reads if k.endswith("manifest.json"))
    assert manifests == [f"weights/v{v:08d}/manifest.json" for v in range(30, 38)]


def test_retention_keeps_every_link_a_lease_needs(tmp_path) -> None:
    store = MemoryStore("retention-links")
    ps = ParamServer(store, shard_bytes=512)
    _publish_chain(ps, range(26), full_every=10)
    leases = BatchLeases(store, ttl_seconds=60)
    assert leases.claim(40, "w", version=17)
    result = apply_retention(
        ps, leases, keep_last=1, next_batch=26, publish_every=1, max_staleness=0
    )
    # 17 (leased) needs its anchor 10 and the deltas 11..16; 25 (LATEST) needs 20..24.
    assert result.kept == [*range(10, 18), *range(20, 26)]
    assert not store.list("weights/v00000018/") and not store.list("weights/v00000009/")
    fresh = ParamServer(store)
    _assert_exact(fresh.pull(17).tensors, _version(17))
    _assert_exact(fresh.pull(25).tensors, _version(25))


def test_format_1_snapshots_of_earlier_runs_still_pull(ps: ParamServer) -> None:
    """A version written by the earlier layout (manifest format 1: shards + tensor offsets,
    no pieces, no anchor) reads as a full snapshot, and a delta can follow it."""
    tensors = _version(4)
    names = sorted(tensors)
    data = b"".join(tensors[n].tobytes() for n in names)
    import google_crc32c

    ps._w.write_new("v00000004/shard-00000-abc.bin", data)
    entries, offset = [], 0
    for n in names:
        a = tensors[n]
        entries.append({"name": n, "shape": list(a.shape), "dtype": a.dtype.name, "shard": 0,
                        "offset": offset, "nbytes": a.nbytes})  # fmt: skip
        offset += a.nbytes
    manifest = {"format": 1, "version": 4, "epoch": 1, "attempt": "abc", "created": 0.0,
                "metadata": {}, "tensors": entries,
                "shards": [{"key": "v00000004/shard-00000-abc.bin", "size": len(data),
                            "crc32c": int(google_crc32c.value(data))}]}  # fmt: skip
    ps._w.write_new("v00000004/manifest.json", json.dumps(manifest).encode())
    old = ps.pull(4)
    _assert_exact(old.tensors, tensors)
    epoch = ps.acquire_epoch()
    ps.publish(5, _version(5), epoch=epoch, base=old, full=False, full_every=10)
    assert ps.manifest(5)["anchor"] == 4
    _assert_exact(ps.pull(5).tensors, _version(5))
    assert ps.pull(5, have=old).deltas == (5,)


def test_pieces_and_ranged_reads_on_the_emulator(gcs_emulator) -> None:
    """Pieces per tensor rank, read through HTTP range requests (several per shard object):
    a rank-1 reader gets exactly the column/row blocks of rank 1."""
    store = GCSStore(gcs_emulator.bucket, f"deltas-{uuid.uuid4().hex[:12]}",
                     client=gcs_emulator.client())  # fmt: skip
    split = {"w": 1, "b16": 0, "special": 0}
    ps = ParamServer(store.child("run"), shard_bytes=4096, range_bytes=100)
    _publish_chain(ps, range(4), full_every=3, split=split, parts=2)
    assert {s["part"] for s in ps.manifest(2)["delta"]["shards"]} == {None, 0, 1}
    half = ps.pull(2, ranks=[1])
    want = _version(2)
    assert half.tensors["w"].tobytes() == np.ascontiguousarray(want["w"][:, 6:]).tobytes()
    assert half.tensors["b16"].tobytes() == want["b16"][4:].tobytes()
    _assert_exact({k: half.tensors[k] for k in ("count", "empty")},
                  {k: want[k] for k in ("count", "empty")})  # fmt: skip
    nxt = ps.pull(3, have=half, ranks=[1])
    assert nxt.deltas == (3,) and nxt.tensors["w"].tobytes() == (
        np.ascontiguousarray(_version(3)["w"][:, 6:]).tobytes()
    )
    _assert_exact(ps.pull(3).tensors, _version(3))
    with pytest.raises(ValueError, match="ranks \\[2\\] do not exist"):
        ps.pull(3, ranks=[2])


class _RangeLog(HookedStore):
    """A store with ranged reads of its own that logs each (key, start, length)."""

    def __init__(self, inner, log: list, path: str = "") -> None:
        super().__init__(inner, lambda key: None, path)
        self.log = log

    def child(self, prefix: str) -> _RangeLog:
        return _RangeLog(self.inner.child(prefix), self.log, f"{self.path}/{prefix}".strip("/"))

    def read_range(self, key: str, start: int, length: int) -> bytes:
        self.log.append((key, start, length))
        return self.inner.read_range(key, start, length)


def test_a_small_pull_is_split_so_that_every_reader_has_a_range() -> None:
    """A delta far below ``range_bytes`` is still read as ``max_workers`` ranges (of at
    least 1 MiB): a pull of one small object would otherwise use one connection."""
    rng = np.random.default_rng(1)
    old = {"w": rng.standard_normal(1 << 21).astype(np.float32)}  # 8 MiB
    new = {"w": rng.standard_normal(1 << 21).astype(np.float32)}  # all changed: a ~7 MiB delta
    store = MemoryStore(f"ranges-{uuid.uuid4().hex[:8]}")
    writer = ParamServer(store)
    epoch = writer.acquire_epoch()
    writer.publish(0, old, epoch=epoch)
    writer.publish(1, new, epoch=epoch, base=Snapshot.of(0, old), full=False, full_every=4)
    (shard,) = writer.manifest(1)["delta"]["shards"]
    log: list = []
    reader = ParamServer(_RangeLog(store, log), max_workers=4, range_bytes=64 << 20)
    held = ParamServer(store).pull(0)
    _assert_exact(reader.pull(1, have=held).tensors, new)
    step = -(-shard["size"] // 4)
    assert step >= 1 << 20
    assert sorted((s, n) for k, s, n in log if k == shard["key"]) == [
        (a, min(step, shard["size"] - a)) for a in range(0, shard["size"], step)
    ]


def test_memory_of_a_rebuilt_version_is_reused_only_once_no_array_uses_it(ps) -> None:
    pool = BufferPool(keep=1)
    a = pool.take(1000)
    address = a.ctypes.data
    view = a[10:20].view(np.uint16).reshape(5, 1)  # a view outlives the array it came from
    del a
    gc.collect()
    assert pool.take(1000).ctypes.data != address
    del view
    gc.collect()
    assert pool.take(1000).ctypes.data == address
    # Through pulls: a tensor kept from an old version is never overwritten by later ones.
    _publish_chain(ps, range(6), full_every=10)
    held = ps.pull(1)
    kept = held.tensors["w"][2:]
    for v in range(2, 6):
        held = ps.pull(v, have=held)
        _assert_exact(held.tensors, _version(v))
    assert kept.tobytes() == _version(1)["w"][2:].tobytes()


# --------------------------------------------------------------------------------------
# Repairs (issue 35): derive a damaged version from another chain, republish it create-only
# --------------------------------------------------------------------------------------


def _shards(ps: ParamServer, version: int, kind: str) -> list[str]:
    return [k for k in ps._w.list(f"v{version:08d}/") if k.split("/")[1].startswith(kind)]


def test_a_flipped_full_snapshot_is_derived_from_the_previous_chain_and_repaired(ps) -> None:
    """v4's full snapshot (the anchor of v5) flipped: v4 and v5 refuse; `derive` rebuilds
    v4 from v0's chain and v4's delta with its published bits; `repair` moves the damaged
    objects to quarantine/ and republishes full + delta, after which v4 and v5 pull (v5
    from scratch through v4) bit for bit."""
    _publish_chain(ps, range(6), full_every=4)
    full = _shards(ps, 4, "full")
    _flip_byte(ps._w, full[0], 3)
    assert "failed verification" in ps.damage(4) and ps.damage(5) is not None
    derived = ps.derive(4)
    assert derived is not None
    _assert_exact(derived.tensors, _version(4))
    ps.report_refused(4, "w0", "flipped")
    assert ps.report_pending(4, "w0") and not ps.report_pending(4, "w1")
    base = ps.derive(3)
    damaged = sorted(ps._w.list("v00000004/"))
    moved = ps.repair(
        Snapshot.of(4, _version(4)), epoch=ps.current_epoch(), base=base, full_every=4
    )
    assert moved.startswith(ps._w.url_of("quarantine/v00000004-"))
    prefix = "quarantine/" + moved.rsplit("/", 1)[1]
    assert sorted(k.split("/", 2)[2] for k in ps._w.list(f"{prefix}/")) == sorted(
        k.split("/", 1)[1] for k in damaged
    )
    # A new attempt writes new shard objects; the manifest key is the commit marker's.
    assert set(ps._w.list("v00000004/")) & set(damaged) == {"v00000004/manifest.json"}
    assert ps.refused() == {} and not ps.report_pending(4, "w0")
    manifest = ps.manifest(4)
    assert "full" in manifest and "delta" in manifest and manifest["base"] == 3
    for v in (4, 5):
        assert ps.damage(v) is None
        _assert_exact(ps.pull(v).tensors, _version(v))
    assert ps.versions() == list(range(6))  # quarantine/ is not a version


def test_a_delta_only_version_whose_delta_is_gone_cannot_be_derived(ps) -> None:
    """v5 is stored only as a delta: with its delta deleted no chain holds its bits (the
    trainer needs its checkpoint then); v6's chain has a hole, but v6 is derived from
    nothing either (its own delta needs v5)."""
    _publish_chain(ps, range(7), full_every=4)
    for key in _shards(ps, 5, "delta"):
        ps._w.delete(key)
    assert "missing" in ps.damage(5)
    assert ps.derive(5) is None and ps.derive(6) is None
    _assert_exact(ps.derive(4).tensors, _version(4))
    ps.repair(Snapshot.of(5, _version(5)), epoch=ps.current_epoch(), base=ps.derive(4))
    _assert_exact(ps.pull(6).tensors, _version(6))  # v6's chain from v4 is whole again
