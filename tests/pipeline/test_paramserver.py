"""ParamServer: sharded, checksummed, epoch-fenced weight snapshots on both backends."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pipeline.paramserver import (
    CorruptSnapshotError,
    ParamServer,
    SnapshotNotFoundError,
    StaleEpochError,
)
from pipeline.storage import (
    FlakyStore,
    GCSStore,
    LocalStore,
    MemoryStore,
    ObjectStore,
    RetryingStore,
)

ml_dtypes = pytest.importorskip("ml_dtypes")


def _crc32c_reference(data: bytes) -> int:
    """Bitwise CRC-32C (Castagnoli, reflected poly 0x82F63B78), independent of google-crc32c."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_reference_vector() -> None:
    assert _crc32c_reference(b"123456789") == 0xE3069283  # RFC 3720 check value


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((40, 30)).astype(np.float32),  # 4800 B > one shard
        "layer0/w": rng.standard_normal((16, 16)).astype(np.float32),
        "layer0/b": rng.integers(-(2**31), 2**31 - 1, size=17, dtype=np.int32),
        "layer0/w_bf16": rng.standard_normal((9, 7)).astype(ml_dtypes.bfloat16),
        "layer1/w": rng.standard_normal((32, 32)).astype(np.float32),  # exactly one shard
        "special": np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45], dtype=np.float32),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "mask": rng.integers(0, 2, size=(5, 5)).astype(bool),
    }


def _assert_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        arr = got[name]
        assert arr.dtype == ref.dtype and arr.shape == ref.shape, name
        assert arr.tobytes() == ref.tobytes(), name  # bitwise: NaN payloads, -0.0 included


@pytest.fixture
def ps(store: ObjectStore) -> ParamServer:
    return ParamServer(store.child("run"), shard_bytes=4096, max_workers=4)


def _flip_byte(store: ObjectStore, key: str, offset: int = 0) -> None:
    """Corrupt an object in place, behind the store's back."""
    if isinstance(store, LocalStore):
        with open(store.path_of(key), "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif isinstance(store, MemoryStore):
        data = bytearray(store.read(key))
        data[offset] ^= 0xFF
        store.delete(key)
        store.write_new(key, bytes(data))
    else:
        assert isinstance(store, GCSStore)
        blob = store.client.bucket(store.bucket_name).blob(store.object_name(key))
        data = bytearray(blob.download_as_bytes())
        data[offset] ^= 0xFF
        blob.upload_from_string(bytes(data))


def test_round_trip_is_exact_and_layout_matches_manifest(ps: ParamServer) -> None:
    tensors = _tensors(0)
    epoch = ps.acquire_epoch()
    assert ps.publish(1, tensors, epoch=epoch, metadata={"step": 10, "note": "sft"})
    snap = ps.pull()
    assert (snap.version, snap.epoch, snap.metadata) == (1, epoch, {"step": 10, "note": "sft"})
    _assert_exact(snap.tensors, tensors)
    assert ps.pull(1).tensors["layer0/w_bf16"].dtype == np.dtype(ml_dtypes.bfloat16)

    # Each shard is the plain concatenation of its tensors' bytes, in manifest order, with
    # the recorded size and CRC-32C (checked against an independent implementation).
    manifest = ps.manifest(1)
    assert manifest["format"] == 2 and manifest["anchor"] == 1 and "delta" not in manifest
    full = manifest["full"]
    assert len(full["shards"]) >= 3
    for index, shard in enumerate(full["shards"]):
        raw = ps.store.read(f"weights/{shard['key']}")
        entries = [t for t in full["pieces"] if t["shard"] == index]
        expect = b"".join(tensors[t["name"]].tobytes() for t in entries)
        assert raw == expect
        assert shard["size"] == len(raw) and shard["crc32c"] == _crc32c_reference(raw)
        assert shard["part"] is None and "-all-" in shard["key"]  # unsplit: every reader's
        offsets = [t["offset"] for t in entries]
        assert offsets == sorted(offsets) and offsets[0] == 0
        assert len(raw) <= 4096 or len(entries) == 1  # only a lone big tensor may exceed
    by_name = {t["name"]: t for t in manifest["tensors"]}
    assert by_name["layer0/w_bf16"]["dtype"] == "bfloat16"
    assert by_name["layer0/b"]["shape"] == [17] and by_name["layer0/b"]["axis"] is None
    assert by_name["layer0/b"]["crc32c"] == [_crc32c_reference(tensors["layer0/b"].tobytes())]
    pieces = {t["name"]: t for t in full["pieces"]}
    assert pieces["layer0/b"]["nbytes"] == 68 and pieces["layer0/b"]["part"] == 0


def test_corrupted_shard_is_refused_and_previous_snapshot_stays_usable(ps: ParamServer) -> None:
    epoch = ps.acquire_epoch()
    ps.publish(1, _tensors(1), epoch=epoch)
    previous = ps.pull()
    ps.publish(2, _tensors(2), epoch=epoch)
    shard = ps.manifest(2)["full"]["shards"][1]
    _flip_byte(ps.store, f"weights/{shard['key']}", offset=5)
    with pytest.raises(CorruptSnapshotError) as err:
        ps.pull(2)
    message = str(err.value)
    assert shard["key"] in message and "snapshot v2" in message
    assert f"expected crc32c {shard['crc32c']:08x}" in message and "got crc32c" in message
    _assert_exact(previous.tensors, _tensors(1))  # what the caller holds is untouched
    _assert_exact(ps.pull(1).tensors, _tensors(1))  # and v1 is still servable


def test_missing_shard_is_refused(ps: ParamServer) -> None:
    epoch = ps.acquire_epoch()
    ps.publish(1, _tensors(1), epoch=epoch)
    shard = ps.manifest(1)["full"]["shards"][0]
    ps.store.delete(f"weights/{shard['key']}")
    with pytest.raises(CorruptSnapshotError, match=rf"shard .*{shard['key']} is missing"):
        ps.pull()


def test_partial_snapshot_is_invisible(ps: ParamServer, monkeypatch: pytest.MonkeyPatch) -> None:
    epoch = ps.acquire_epoch()
    ps.publish(1, _tensors(1), epoch=epoch)

    def crash(version, manifest):
        raise RuntimeError("trainer died before the manifest")

    monkeypatch.setattr(ps, "_write_manifest", crash)
    with pytest.raises(RuntimeError, match="died"):
        ps.publish(2, _tensors(2), epoch=epoch)
    assert ps.store.list("weights/v00000002/")  # shards are there...
    assert ps.versions() == [1]  # ...but the version is not committed
    assert ps.latest_version() == 1
    with pytest.raises(SnapshotNotFoundError, match="version 2 is not committed"):
        ps.pull(2)
    _assert_exact(ps.pull().tensors, _tensors(1))

    # A retry commits with its own shards; gc later sweeps the dead attempt's leftovers.
    monkeypatch.undo()
    assert ps.publish(2, _tensors(2), epoch=epoch)
    _assert_exact(ps.pull(2).tensors, _tensors(2))
    assert ps.gc(keep_last=1) == [1]
    manifest = ps.manifest(2)
    expected = sorted(
        [f"weights/{s['key']}" for s in manifest["full"]["shards"]]
        + ["weights/v00000002/manifest.json"]
    )
    assert ps.store.list("weights/v") == expected


def test_latest_never_moves_backwards(ps: ParamServer) -> None:
    epoch = ps.acquire_epoch()
    assert ps.publish(3, _tensors(3), epoch=epoch)
    assert ps.publish(2, _tensors(2), epoch=epoch)
    assert ps.latest_version() == 3
    assert ps.versions() == [2, 3]
    assert ps.pull().version == 3

    # Concurrent publishers of the same epoch: LATEST ends at the maximum.
    small = {"w": np.arange(4, dtype=np.float32)}
    threads = [
        threading.Thread(target=ps.publish, args=(v, small), kwargs={"epoch": epoch})
        for v in range(4, 10)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ps.latest_version() == 9
    assert ps.versions() == list(range(2, 10))


def test_stale_epoch_trainer_cannot_publish(store: ObjectStore) -> None:
    old = ParamServer(store.child("run"), shard_bytes=4096)
    new = ParamServer(store.child("run"), shard_bytes=4096)
    e_old = old.acquire_epoch()
    e_new = new.acquire_epoch()
    assert e_new == e_old + 1
    with pytest.raises(StaleEpochError, match=f"epoch {e_old} is stale"):
        old.publish(1, _tensors(1), epoch=e_old)
    assert old.versions() == [] and old.latest_version() is None
    with pytest.raises(ValueError, match="never acquired"):
        new.publish(1, _tensors(1), epoch=e_new + 5)
    assert new.publish(1, _tensors(1), epoch=e_new)
    assert new.latest_version() == 1


def test_zombie_that_passed_its_checks_still_cannot_move_latest(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    zombie = ParamServer(store.child("run"), shard_bytes=4096)
    successor = ParamServer(store.child("run"), shard_bytes=4096)
    e_zombie = zombie.acquire_epoch()
    zombie.publish(1, _tensors(1), epoch=e_zombie)

    real_write = zombie._write_manifest

    def takeover_then_write(version, manifest):
        successor.acquire_epoch()  # the successor starts while the zombie is mid-publish
        return real_write(version, manifest)

    monkeypatch.setattr(zombie, "_write_manifest", takeover_then_write)
    with pytest.raises(StaleEpochError):  # caught by the re-check after the manifest
        zombie.publish(2, _tensors(2), epoch=e_zombie)
    # Worst case: every epoch check of the zombie ran before the takeover; the CAS fence that
    # acquire_epoch stamped into LATEST must still stop it.
    monkeypatch.setattr(zombie, "_check_epoch", lambda epoch: None)
    monkeypatch.setattr(zombie, "_write_manifest", real_write)
    with pytest.raises(StaleEpochError, match="fenced by epoch"):
        zombie.publish(3, _tensors(3), epoch=e_zombie)
    assert successor.latest_version() == 1
    assert successor.pull().version == 1


def test_republishing_a_committed_version_is_a_no_op(
    ps: ParamServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    epoch = ps.acquire_epoch()
    assert ps.publish(1, _tensors(1), epoch=epoch)
    objects = ps.store.list()
    assert not ps.publish(1, _tensors(99), epoch=epoch)
    assert ps.store.list() == objects
    _assert_exact(ps.pull(1).tensors, _tensors(1))

    # Crash after the commit but before LATEST moved: the retry returns False and finishes.
    def crash(version, epoch):
        raise RuntimeError("died before LATEST")

    monkeypatch.setattr(ps, "_advance_latest", crash)
    with pytest.raises(RuntimeError):
        ps.publish(2, _tensors(2), epoch=epoch)
    monkeypatch.undo()
    assert ps.latest_version() == 1 and ps.versions() == [1, 2]
    assert not ps.publish(2, _tensors(2), epoch=epoch)
    assert ps.latest_version() == 2


def test_wait_for_version(ps: ParamServer) -> None:
    epoch = ps.acquire_epoch()
    with pytest.raises(SnapshotNotFoundError, match="no version published"):
        ps.pull()
    timer = threading.Timer(0.2, ps.publish, args=(1, _tensors(1)), kwargs={"epoch": epoch})
    timer.start()
    start = time.monotonic()
    assert ps.wait_for_version(1, timeout=10, poll=0.02) == 1
    assert time.monotonic() - start >= 0.15
    timer.join()
    with pytest.raises(TimeoutError, match="still below 5"):
        ps.wait_for_version(5, timeout=0.1, poll=0.02)


def test_gc_keeps_newest_latest_and_protected(
    ps: ParamServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    epoch = ps.acquire_epoch()
    small = {"w": np.arange(3000, dtype=np.float32)}  # 3 shards per version
    for v in range(1, 7):
        ps.publish(v, small, epoch=epoch)
    assert ps.gc(keep_last=2, protected={2}) == [1, 3, 4]
    assert ps.versions() == [2, 5, 6]
    assert ps.store.list("weights/v00000001/") == []
    assert ps.store.list("weights/v00000003/") == []
    _assert_exact(ps.pull(2).tensors, small)

    # A committed version newer than LATEST (its publisher never moved LATEST): both stay.
    monkeypatch.setattr(ps, "_advance_latest", lambda version, epoch: None)
    ps.publish(9, small, epoch=epoch)
    monkeypatch.undo()
    assert ps.latest_version() == 6
    assert ps.gc(keep_last=1) == [2, 5]
    assert ps.versions() == [6, 9]
    _assert_exact(ps.pull().tensors, small)


def test_publish_validates_inputs(ps: ParamServer) -> None:
    epoch = ps.acquire_epoch()
    with pytest.raises(TypeError, match="numpy.ndarray"):
        ps.publish(1, {"w": [1.0, 2.0]}, epoch=epoch)
    with pytest.raises(TypeError, match="unsupported dtype"):
        ps.publish(1, {"w": np.array(["a"], dtype=object)}, epoch=epoch)
    with pytest.raises(ValueError, match="version must be in"):
        ps.publish(-1, {"w": np.zeros(2)}, epoch=epoch)
    with pytest.raises(ValueError, match="non-empty dict"):
        ps.publish(1, {}, epoch=epoch)
    assert ps.versions() == []
    # Big-endian input is stored little-endian with the same values.
    assert ps.publish(1, {"w": np.arange(5, dtype=">i4")}, epoch=epoch)
    got = ps.pull().tensors["w"]
    assert got.dtype == np.dtype("<i4") and got.tolist() == [0, 1, 2, 3, 4]


def test_publish_and_pull_through_flaky_storage(store: ObjectStore, fast_retry_policy) -> None:
    flaky = FlakyStore(store, 0.2, seed=3)
    ps = ParamServer(RetryingStore(flaky, fast_retry_policy).child("run"), shard_bytes=4096)
    epoch = ps.acquire_epoch()
    assert ps.publish(1, _tensors(1), epoch=epoch)
    assert ps.publish(2, _tensors(2), epoch=epoch)
    _assert_exact(ps.pull().tensors, _tensors(2))
    assert ps.latest_version() == 2 and flaky.injected > 0
    # The same run read through the plain store is identical.
    _assert_exact(ParamServer(store.child("run")).pull(1).tensors, _tensors(1))
