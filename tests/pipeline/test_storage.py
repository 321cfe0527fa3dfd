"""The ObjectStore contract, on the local backend and on GCS (fake-gcs-server)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from pipeline.storage import (
    BACKENDS,
    FlakyStore,
    GCSStore,
    LocalStore,
    Match,
    MemoryStore,
    ObjectNotFound,
    ObjectStore,
    RetryingStore,
    RetryPolicy,
    StorageError,
    StorageUrl,
    StorageUrlError,
    TransientStorageError,
    glob,
    local_path,
    open_parent,
    open_store,
    split_url,
)

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- contract


def test_write_new_is_create_only(store: ObjectStore) -> None:
    assert store.write_new("a/b/obj", b"first")
    assert not store.write_new("a/b/obj", b"second")
    assert store.read("a/b/obj") == b"first"
    assert store.exists("a/b/obj")
    assert not store.exists("a/b/other")
    assert store.write_new("empty", b"")
    assert store.read("empty") == b""


def test_missing_object_errors_name_the_url(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound) as err:
        store.read("nope/missing.bin")
    assert store.url_of("nope/missing.bin") in str(err.value)
    assert str(err.value).endswith("nope/missing.bin")
    assert store.url.split("://")[0] in ("file", "gs", "memory")
    with pytest.raises(ObjectNotFound, match="nope/missing.bin"):
        store.read_to_file("nope/missing.bin", tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()
    assert store.read_versioned("nope/missing.bin") is None


def test_list_is_a_sorted_string_prefix_match(store: ObjectStore) -> None:
    for key in ["a/2", "a/1", "ab/3", "b/4", "a/sub/5", "top"]:
        assert store.write_new(key, key.encode())
    assert store.list("a/") == ["a/1", "a/2", "a/sub/5"]
    assert store.list("a") == ["a/1", "a/2", "a/sub/5", "ab/3"]
    assert store.list("a/s") == ["a/sub/5"]
    assert store.list() == ["a/1", "a/2", "a/sub/5", "ab/3", "b/4", "top"]
    assert store.list("zzz") == []
    assert store.list("zzz/") == []


def test_delete_and_missing_delete(store: ObjectStore) -> None:
    store.write_new("d/x", b"1")
    store.delete("d/x")
    assert not store.exists("d/x")
    assert store.list("d/") == []
    store.delete("d/x")  # missing is fine
    store.delete("never/was")
    assert store.write_new("d/x", b"again")  # recreate after delete
    assert store.read("d/x") == b"again"


def test_read_range(store: ObjectStore) -> None:
    data = bytes(range(256)) * 3
    store.write_new("r/obj", data)
    assert store.read_range("r/obj", 0, 10) == data[:10]
    assert store.read_range("r/obj", 700, 100) == data[700:]  # clipped at the end
    assert store.read_range("r/obj", 300, 0) == b""
    with pytest.raises(ObjectNotFound, match="r/missing"):
        store.read_range("r/missing", 0, 1)
    with pytest.raises(ValueError, match="start >= 0"):
        store.read_range("r/obj", -1, 1)


def test_compare_and_swap_with_right_and_wrong_generation(store: ObjectStore) -> None:
    assert store.compare_and_swap("ptr", b"1", None)
    assert not store.compare_and_swap("ptr", b"x", None)  # must-not-exist fails now
    data, gen1 = store.read_versioned("ptr")
    assert data == b"1"
    assert not store.compare_and_swap("ptr", b"x", gen1 + 12345)
    assert store.compare_and_swap("ptr", b"2", gen1)
    data, gen2 = store.read_versioned("ptr")
    assert (data, gen2 != gen1) == (b"2", True)
    assert not store.compare_and_swap("ptr", b"3", gen1)  # stale generation
    assert store.read("ptr") == b"2"
    assert store.read_versioned("ptr") == (b"2", gen2)  # stable while unchanged
    # Objects made by write_new have a generation too; delete + recreate gets a new one.
    store.write_new("made", b"m")
    _, g = store.read_versioned("made")
    store.delete("made")
    store.write_new("made", b"m")
    _, g_again = store.read_versioned("made")
    assert g_again != g
    assert not store.compare_and_swap("made", b"z", g)
    assert store.compare_and_swap("made", b"z", g_again)
    assert not store.compare_and_swap("absent", b"z", gen2)  # expected generation, no object


def test_child_views(store: ObjectStore) -> None:
    run = store.child("runs/r1")
    assert run.url == store.url_of("runs/r1")
    assert run.write_new("weights/LATEST", b"7")
    assert store.read("runs/r1/weights/LATEST") == b"7"
    weights = run.child("weights")
    assert weights.read("LATEST") == b"7"
    assert weights.list() == ["LATEST"]
    assert run.list() == ["weights/LATEST"]
    assert store.list("runs/") == ["runs/r1/weights/LATEST"]
    # Generations are the same object seen through any view.
    _, gen = weights.read_versioned("LATEST")
    assert store.compare_and_swap("runs/r1/weights/LATEST", b"8", gen)
    assert weights.read("LATEST") == b"8"


def test_large_streamed_file_round_trip(store: ObjectStore, tmp_path: Path) -> None:
    payload = random.Random(0).randbytes(20 * 1024 * 1024 + 13)
    src = tmp_path / "src.bin"
    src.write_bytes(payload)
    assert store.write_new_file("big/blob.bin", src)
    assert not store.write_new_file("big/blob.bin", src)
    dest = tmp_path / "nested" / "dest.bin"
    store.read_to_file("big/blob.bin", dest)
    assert dest.read_bytes() == payload
    assert store.read("big/blob.bin") == payload
    assert not list(dest.parent.glob("*.rlax.*"))  # no temp files left behind


@pytest.mark.parametrize(
    "bad", ["", "/abs", "a//b", "trail/", "../up", "a/./b", ".rlax.x", "a/.rlax.tmp"]
)
def test_invalid_keys_are_refused(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="key"):
        LocalStore(tmp_path).write_new(bad, b"x")


def test_local_bookkeeping_is_invisible(tmp_path: Path) -> None:
    store = open_store(str(tmp_path), fsync=True)  # the power-loss-durable mode works too
    store.compare_and_swap("w/LATEST", b"1", None)
    store.read_versioned("w/LATEST")
    store.write_new("w/v1", b"x")
    assert store.list() == ["w/LATEST", "w/v1"]
    assert any(p.name.startswith(".rlax.") for p in (tmp_path / "w").iterdir())
    store.delete("w/v1")
    assert store.list() == ["w/LATEST"]


def test_open_store_by_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = open_store(str(tmp_path / "runs"))
    assert isinstance(local, LocalStore)
    assert local.url == "file://" + str(tmp_path / "runs")
    assert isinstance(open_store("file://" + str(tmp_path)), LocalStore)
    monkeypatch.chdir(tmp_path)
    rel = open_store("rel/dir")
    assert isinstance(rel, LocalStore) and rel.url == "file://" + str(tmp_path / "rel" / "dir")
    gcs = open_store("gs://my-bucket/some/prefix/")  # no network until first use
    assert isinstance(gcs, GCSStore) and gcs.url == "gs://my-bucket/some/prefix"
    assert open_store("gs://my-bucket").url == "gs://my-bucket"
    with pytest.raises(ValueError, match=r"'s3'.*allowed: .*file://.*gs://bucket/prefix"):
        open_store("s3://bucket/x")
    with pytest.raises(ValueError, match="names no bucket"):
        open_store("gs://")
    with pytest.raises(ValueError, match="absolute"):
        open_store("file://relative/path")


def test_unknown_scheme_names_the_scheme_and_the_registered_ones() -> None:
    with pytest.raises(ValueError) as err:
        open_store("s3://bucket/x")
    message = str(err.value)
    assert "'s3'" in message
    assert f"registered schemes: {', '.join(BACKENDS)}" in message
    assert list(BACKENDS) == ["file", "gs", "memory"]


def test_split_url_and_local_path(tmp_path: Path) -> None:
    assert split_url("gs://b/a/x.parquet") == StorageUrl("gs", "b", "a/x.parquet")
    assert split_url("gs://b").root == "gs://b"
    assert split_url("memory://m/p") == StorageUrl("memory", "m", "p")
    assert split_url("file://localhost/abs/d") == StorageUrl("file", "", "/abs/d")
    assert local_path("file:///abs/d") == Path("/abs/d")
    assert local_path("rel/d") == Path("rel/d")
    assert local_path(tmp_path) == tmp_path
    assert local_path("gs://b/p") is None and local_path("memory://m") is None
    with pytest.raises(ValueError, match="names no bucket; expected memory://bucket/prefix"):
        split_url("memory:///p")
    with pytest.raises(ValueError, match="absolute"):
        local_path("file://rel/d")
    assert split_url("gs://b/x/") == StorageUrl("gs", "b", "x/")  # a trailing '/' is fine
    # Object names are literal: '..' would not climb out of the prefix, it would be a name.
    for url, part in (("gs://b/../x", "'..'"), ("memory://m/a/./b", "'.'"), ("gs://b/a//c", "''")):
        with pytest.raises(StorageUrlError, match=f"prefix segment {part} is not allowed"):
            split_url(url)
    with pytest.raises(StorageUrlError, match="must be non-empty"):
        open_store("")


def test_memory_stores_of_one_name_share_their_objects() -> None:
    name = f"shared-{os.getpid()}-{time.monotonic_ns()}"
    assert open_store(f"memory://{name}/run").write_new("weights/LATEST", b"3")
    whole = open_store(f"memory://{name}")
    assert isinstance(whole, MemoryStore) and whole.url == f"memory://{name}"
    assert whole.read("run/weights/LATEST") == b"3"
    assert whole.child("run").url == f"memory://{name}/run"
    assert open_store(f"memory://other-{name}").list() == []


def test_glob_local_and_remote(store: ObjectStore, tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for rel in ["d/a.parquet", "d/b.parquet", "d/sub/c.parquet", "d/x.json"]:
        (tmp_path / rel).write_bytes(rel.encode())
    local = glob(str(tmp_path / "d" / "*.parquet"))
    assert [m.url for m in local] == [str(tmp_path / "d" / n) for n in ("a.parquet", "b.parquet")]
    assert local[0].size == len(b"d/a.parquet")
    assert local[0].version == (tmp_path / "d" / "a.parquet").stat().st_mtime_ns
    assert len(glob("file://" + str(tmp_path / "d" / "**" / "*.parquet"))) == 3
    assert glob(str(tmp_path / "nothing-*")) == []

    for key in ["data/a.parquet", "data/b.parquet", "data/sub/c.parquet", "data/x.json"]:
        assert store.write_new(key, key.encode())
    if isinstance(store, LocalStore):
        matched = glob(store.url_of("data/*.parquet"))  # a file:// pattern: the filesystem's
        assert [m.url for m in matched] == [store.path_of(f"data/{n}.parquet") for n in "ab"]
        return
    matched = glob(store.url_of("data/*.parquet"))  # remotely '*' also matches '/'
    assert [m.url for m in matched] == [
        store.url_of(k) for k in ("data/a.parquet", "data/b.parquet", "data/sub/c.parquet")
    ]
    _, generation = store.read_versioned("data/a.parquet")
    assert (matched[0].size, matched[0].version) == (len(b"data/a.parquet"), generation)
    assert glob(store.url_of("data/?.json")) == [
        Match(
            store.url_of("data/x.json"), len(b"data/x.json"), store.read_versioned("data/x.json")[1]
        )
    ]
    assert [i.key for i in store.list_info("data/s")] == store.list("data/s")


def test_open_parent(store: ObjectStore, tmp_path: Path) -> None:
    url = store.url_of("out/rates.parquet")
    parent, key = open_parent(url + "/")
    assert parent.url_of(key) == url
    assert parent.write_new(key, b"x")
    assert store.read("out/rates.parquet") == b"x"
    local, name = open_parent(str(tmp_path / "dir" / "f.bin"))
    assert (local.url, name) == ("file://" + str(tmp_path / "dir"), "f.bin")


# ----------------------------------------------------------------------------- races


def _race(n: int, fn) -> list:
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def test_create_only_race_has_exactly_one_winner(store: ObjectStore) -> None:
    wins = _race(16, lambda i: store.write_new("race/obj", f"writer-{i}".encode()))
    assert sum(wins) == 1
    assert store.read("race/obj") == f"writer-{wins.index(True)}".encode()


def test_cas_counter_race_counts_every_increment_once(store: ObjectStore) -> None:
    def increment(i: int) -> int:
        while True:
            current = store.read_versioned("counter")
            value, gen = (0, None) if current is None else (int(current[0]), current[1])
            if store.compare_and_swap("counter", str(value + 1).encode(), gen):
                return value + 1

    landed = _race(16, increment)
    assert sorted(landed) == list(range(1, 17))
    assert store.read("counter") == b"16"


# ----------------------------------------------------------------------------- retries


def _workload(store: ObjectStore, tmp_path: Path) -> None:
    """Exercise every operation; asserts the results a fault-free store would give."""
    for i in range(12):
        assert store.write_new(f"w/obj-{i}", f"payload-{i}".encode())
    for i in range(12):
        assert not store.write_new(f"w/obj-{i}", b"other")
        assert store.read(f"w/obj-{i}") == f"payload-{i}".encode()
    assert store.list("w/") == sorted(f"w/obj-{i}" for i in range(12))
    for step in range(15):
        current = store.read_versioned("w/counter")
        value, gen = (0, None) if current is None else (int(current[0]), current[1])
        assert value == step
        assert store.compare_and_swap("w/counter", str(value + 1).encode(), gen)
    assert store.read("w/counter") == b"15"
    src = tmp_path / "file.bin"
    src.write_bytes(os.urandom(300_000))
    assert store.write_new_file("w/file.bin", src)
    assert not store.write_new_file("w/file.bin", src)
    store.read_to_file("w/file.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    assert store.exists("w/obj-0")
    for i in range(0, 12, 2):
        store.delete(f"w/obj-{i}")
    assert store.list("w/obj-") == sorted(f"w/obj-{i}" for i in range(1, 12, 2))


def test_flaky_store_operations_succeed_through_retry_layer(
    store: ObjectStore, tmp_path: Path, fast_retry_policy: RetryPolicy
) -> None:
    flaky = FlakyStore(store, 0.3, lost_response_fraction=0.5, seed=7)
    retrying = RetryingStore(flaky, fast_retry_policy)
    _workload(retrying.child("run"), tmp_path)
    assert flaky.injected > 10
    assert retrying.retries == flaky.injected


def test_retry_gives_up_with_the_object_named(tmp_path: Path) -> None:
    always = RetryingStore(
        FlakyStore(LocalStore(tmp_path), 1.0, lost_response_fraction=0.0),
        RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.001),
    )
    with pytest.raises(StorageError, match=r"read file://.*/w/x failed after 3 attempts") as err:
        always.read("w/x")
    assert isinstance(err.value.__cause__, TransientStorageError)
    # Permanent errors are not retried.
    store = RetryingStore(LocalStore(tmp_path))
    with pytest.raises(ObjectNotFound):
        store.read("w/x")
    assert store.retries == 0


class FlakySession(requests.Session):
    """Injects HTTP-level faults: 503/429 replies, connection resets before sending, and
    resets after the server processed the request (the response is lost)."""

    def __init__(self, rate: float, seed: int) -> None:
        super().__init__()
        self.rate = rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.injected: dict[str, int] = {"503": 0, "429": 0, "reset": 0, "lost": 0}
        adapter = requests.adapters.HTTPAdapter(pool_connections=16, pool_maxsize=16)
        self.mount("http://", adapter)

    def request(self, method, url, *args, **kwargs):  # type: ignore[override]
        with self.lock:
            fail = self.rng.random() < self.rate
            kind = self.rng.choice(["503", "429", "reset", "lost"])
            if fail:
                self.injected[kind] += 1
        if not fail:
            return super().request(method, url, *args, **kwargs)
        if kind == "lost":
            super().request(method, url, *args, **kwargs).close()
            raise requests.ConnectionError("injected: connection reset before the response")
        if kind == "reset":
            raise requests.ConnectionError("injected: connection reset by peer")
        resp = requests.models.Response()
        resp.status_code = int(kind)
        resp._content = json.dumps({"error": {"code": int(kind), "message": "injected"}}).encode()
        resp.headers["Content-Type"] = "application/json"
        resp.url = url
        resp.reason = "injected"
        resp.request = requests.Request(method, url).prepare()
        return resp


@pytest.fixture
def flaky_gcs(gcs_emulator, fast_retry_policy: RetryPolicy):
    session = FlakySession(0.3, seed=11)
    client = gcs_emulator.new_client(_http=session)
    store = GCSStore(
        gcs_emulator.bucket,
        f"flaky-{os.urandom(6).hex()}",
        client=client,
        retry=fast_retry_policy,
    )
    return store, session


def test_gcs_http_faults_are_retried_and_lost_responses_resolved(flaky_gcs, tmp_path: Path) -> None:
    store, session = flaky_gcs
    _workload(store, tmp_path)
    assert session.injected["lost"] > 3 and sum(session.injected.values()) > 15
    assert store.retries == sum(session.injected.values())  # each fault cost exactly one retry


def test_gcs_lost_create_response_is_not_reported_as_a_loss(flaky_gcs) -> None:
    """The first upload commits but its response is lost; the retry then gets 412 and must
    recognise the object as its own (token in metadata), not report a lost race."""
    store, session = flaky_gcs
    session.rate = 0.0
    lose_next_upload = {"on": True}

    def lose_first_upload(method, url, *args, **kwargs):
        resp = requests.Session.request(session, method, url, *args, **kwargs)
        if lose_next_upload["on"] and "/upload/" in url:
            lose_next_upload["on"] = False
            resp.close()
            raise requests.ConnectionError("injected: response lost")
        return resp

    session.request = lose_first_upload  # type: ignore[method-assign]
    assert store.write_new("once", b"mine")
    assert store.retries == 1
    lose_next_upload["on"] = True
    assert not store.write_new("once", b"someone else")  # a real loss stays a loss
    assert store.read("once") == b"mine"
    _, gen = store.read_versioned("once")
    lose_next_upload["on"] = True
    assert store.compare_and_swap("once", b"v2", gen)
    assert store.read("once") == b"v2"
    assert store.retries == 3


def test_gcs_permanent_errors_name_object_and_cause(gcs_emulator) -> None:
    store = GCSStore("no-such-bucket-rlax", "p", client=gcs_emulator.client())
    with pytest.raises(
        StorageError, match=r"write_new gs://no-such-bucket-rlax/p/k failed: NotFound"
    ):
        store.write_new("k", b"x")
    assert store.retries == 0


def test_gcs_store_pickles_without_its_client() -> None:
    import pickle

    store = open_store("gs://bucket/prefix").child("run")
    clone = pickle.loads(pickle.dumps(store))
    assert clone.url == "gs://bucket/prefix/run"


# ----------------------------------------------------------------------------- crashes


def test_local_cas_interrupted_after_rename_gets_a_fresh_generation(tmp_path: Path) -> None:
    """A CAS killed between its rename and its state update must not leave a generation that
    an older reader could still match."""
    store = LocalStore(tmp_path)
    assert store.compare_and_swap("w/LATEST", b"1", None)
    _, gen1 = store.read_versioned("w/LATEST")
    # What a process killed mid-CAS leaves: new bytes renamed in, state untouched.
    tmp = tmp_path / "w" / ".rlax.tmp.crashed"
    tmp.write_bytes(b"2")
    os.replace(tmp, tmp_path / "w" / "LATEST")
    data, gen2 = store.read_versioned("w/LATEST")
    assert data == b"2" and gen2 != gen1
    assert not store.compare_and_swap("w/LATEST", b"3", gen1)  # the stale reader loses
    assert store.compare_and_swap("w/LATEST", b"3", gen2)


_CHILD = r"""
import os, sys, zlib
from pipeline.storage import LocalStore
store = LocalStore(sys.argv[1])
name = sys.argv[2]
i = 0
while True:
    i += 1
    current = store.read_versioned("ctr")
    value, gen = (0, None) if current is None else (int(current[0]), current[1])
    if store.compare_and_swap("ctr", str(value + 1).encode(), gen):
        print(value + 1, flush=True)
    if name.startswith("killed"):
        body = os.urandom(1 + (i * 7919) % 3_000_000)
        store.write_new(f"objs/{name}-{i}", zlib.crc32(body).to_bytes(4, "big") + body)
    if name.startswith("n") and i >= int(name[1:]):
        break
"""


def test_local_store_across_processes_and_sigkill(tmp_path: Path) -> None:
    root = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def spawn(name: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(root), name],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    # Two processes racing plain increments: every landed CAS is counted exactly once.
    procs = [spawn("n40"), spawn("n40")]
    outputs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    landed = sorted(int(x) for out in outputs for x in out)
    store = LocalStore(root)
    assert int(store.read("ctr")) == len(landed) and landed == list(range(1, len(landed) + 1))

    # Kill writers at arbitrary points: objects are complete or absent, locks are released,
    # and generations keep working.
    for round_ in range(3):
        proc = spawn(f"killed{round_}")
        time.sleep(0.3 + 0.2 * round_)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        for key in store.list("objs/"):
            blob = store.read(key)
            assert int.from_bytes(blob[:4], "big") == __import__("zlib").crc32(blob[4:]), key
        value, gen = store.read_versioned("ctr")
        assert store.compare_and_swap("ctr", str(int(value) + 1).encode(), gen)
        assert not store.compare_and_swap("ctr", b"stale", gen)
    assert all(not k.split("/")[-1].startswith(".rlax") for k in store.list())
    assert store.remove_stale_temp_files(older_than_s=-1) >= 0
