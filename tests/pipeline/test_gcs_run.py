"""A run on gs:// (fake-gcs-server): the trainer and rollout workers as separate processes.

* A worker SIGKILLed mid-batch: its lease expires, another worker produces the batch, every
  batch index is produced and consumed exactly once, and the final parameters equal those of
  a local-directory reference run bit for bit.
* HTTP faults: the children talk to the emulator through a proxy that fails 20% of requests
  (503s, connections reset before the request reaches the server, responses lost after it
  did, stalled connections that die); the run still ends with the reference's parameters.

The children reach the emulator through the environment only, as workers on other machines
reach GCS: STORAGE_EMULATOR_HOST (google-cloud-storage and gcsfs), TENSORSTORE_GCS_HTTP_URL
and GOOGLE_AUTH_TOKEN_FOR_TESTING (TensorStore, which writes Orbax's arrays). A shared JAX
compilation cache keeps the processes' start-up short.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import random
import socket
import struct
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.ops.emulators import emulator_env
from pipeline.paramserver import ParamServer
from pipeline.rollouts import from_parquet_bytes
from pipeline.run import DONE_KEY, Run
from tests.local_servers import QuietHandler
from tests.runs import assert_bit_identical, clone_run, final_tensors, start, wait_all

# Orbax reaches gs:// directories through etils.epath, whose GCS backend is fsspec's gcsfs.
needs_gcsfs = pytest.mark.skipif(
    importlib.util.find_spec("gcsfs") is None,
    reason="trainer checkpoints on gs:// need gcsfs (etils.epath's GCS backend)",
)

STEPS = 4
LEASE_SECONDS = 4.0  # short, so the killed worker's batch is re-claimed quickly
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def jax_cache_env() -> dict[str, str]:
    """The jobs' environment: unbuffered output (the suite's persistent compilation cache,
    set in tests/conftest.py, is inherited: these processes compile the same programs)."""
    return {"PYTHONUNBUFFERED": "1"}


def _config(tiny_base: Run):
    cfg = tiny_base.config
    return replace(
        cfg,
        trainer=replace(cfg.trainer, steps=STEPS),
        rollout=replace(cfg.rollout, lease_seconds=LEASE_SECONDS),
    )


def _logs_tail(logs: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logs.glob("*.log"))
    )


@pytest.fixture(scope="module")
def reference(tiny_base, tmp_path_factory, jax_cache_env):
    """The same run on a local directory, trainer + one worker (also warms the JAX cache)."""
    root = tmp_path_factory.mktemp("gcs-reference")
    run = clone_run(tiny_base, str(root / "run"), _config(tiny_base))
    logs = root / "logs"
    procs = {n: start(run, n, logs, jax_cache_env) for n in ("trainer", "w0")}
    codes = wait_all(procs, RUN_TIMEOUT_S)
    assert codes == {"trainer": 0, "w0": 0}, _logs_tail(logs)
    return final_tensors(run)


def _gcs_run(gcs_emulator, tiny_base, name: str) -> Run:
    url = f"gs://{gcs_emulator.bucket}/{name}-{uuid.uuid4().hex[:8]}"
    return clone_run(tiny_base, url, _config(tiny_base))


def _check_exactly_once(run: Run) -> list[dict]:
    """Every index consumed once in order, committed once; returns the attempt records."""
    assert json.loads(run.store.read(DONE_KEY))["step"] == STEPS
    train = run.read_metrics("train")
    assert [r["batch_index"] for r in train] == list(range(STEPS))
    attempts = [json.loads(run.store.read(k)) for k in run.store.list("metrics/rollout/")]
    committed = Counter(a["batch_index"] for a in attempts if a["committed"])
    assert set(committed) >= set(range(STEPS)), committed
    assert all(n == 1 for n in committed.values()), committed
    assert [k for k in run.store.list("rollouts/") if k.endswith(".parquet")][:STEPS] == [
        f"rollouts/b{i:08d}.parquet" for i in range(STEPS)
    ]
    return attempts


def _check_checkpoints_on_gcs(run: Run) -> None:
    keys = run.store.list("checkpoints/")
    assert f"checkpoints/{STEPS}/commit_success.txt" in keys, keys
    # etils.epath must not have taken "gs://..." for a relative local path.
    assert not Path("gs:").exists()


@pytest.mark.e2e  # the two runs, ~1.5 CPU-minutes with their base: .ci/run's e2e lane
@needs_gcsfs
def test_gcs_run_survives_worker_killed_mid_batch(
    gcs_emulator, tiny_base, reference, jax_cache_env, tmp_path
):
    run = _gcs_run(gcs_emulator, tiny_base, "kill")
    logs = tmp_path / "logs"
    env = {**jax_cache_env, **emulator_env(gcs_emulator.url)}
    t0 = time.monotonic()
    procs = {
        "trainer": start(run, "trainer", logs, env),
        "w0": start(run, "w0", logs, {**env, "RLAX_FAILPOINTS": "rollout.before_commit@1"}),
    }
    # The victim produces batch 0 alone, then claims batch 1 and dies before committing it.
    # The other workers start once it holds that lease, so it is the one killed mid-batch.
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while procs["w0"].poll() is None and time.monotonic() < deadline:
        raw = run.store.read_versioned("rollouts/b00000001.lease")
        if raw is not None and json.loads(raw[0])["worker_id"] == "w0":
            break
        time.sleep(0.05)
    procs.update({n: start(run, n, logs, env) for n in ("w1", "w2")})
    victim = procs.pop("w0")
    assert wait_all({"w0": victim}, RUN_TIMEOUT_S) == {"w0": -9}, _logs_tail(logs)
    codes = wait_all(procs, RUN_TIMEOUT_S)
    wall = time.monotonic() - t0
    assert codes == {"trainer": 0, "w1": 0, "w2": 0}, _logs_tail(logs)
    assert "[failpoint] rollout.before_commit@1" in (logs / "w0.log").read_text()

    attempts = _check_exactly_once(run)
    by_w0 = sorted(a["batch_index"] for a in attempts if a["worker_id"] == "w0")
    assert by_w0 == [0]  # it died before recording (or committing) batch 1
    batch1 = from_parquet_bytes(run.store.read("rollouts/b00000001.parquet"))
    assert batch1.worker_id in {"w1", "w2"}
    _check_checkpoints_on_gcs(run)
    assert ParamServer(run.store).versions() == list(range(STEPS + 1))
    version, tensors = final_tensors(run)
    assert version == reference[0] == STEPS
    assert_bit_identical(reference[1], tensors)
    print(f"gcs run with a killed worker: {wall:.1f}s")


# --------------------------------------------------------------------------- faults


_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "content-length",
        "host",
    }
)


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 that fails a fraction of the requests it forwards.

    Faults, equally likely: ``503`` (answered without forwarding), ``reset`` (connection reset
    before forwarding), ``lost`` (forwarded, the server acted, the response is dropped) and
    ``stall`` (the connection hangs for ``stall_s``, then dies without a response).

    ``gentle(path_and_query)`` selects requests that get faults at ``gentle_rate`` and never
    ``lost``: the emulator forgets a finished resumable upload, so a client re-sending its last
    chunk after a lost response gets 404 where GCS answers with the object. gcsfs (Orbax's
    directory I/O) relies on GCS's behaviour there.
    """

    KINDS = ("503", "reset", "lost", "stall")

    def __init__(
        self,
        upstream: str,
        rate: float,
        *,
        seed: int = 0,
        stall_s: float = 0.25,
        gentle: Callable[[str], bool] = lambda path: False,
        gentle_rate: float = 0.0,
    ):
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = upstream.rstrip("/")
        self._host, self._port = parsed.hostname, parsed.port
        self.rate, self.stall_s = rate, stall_s
        self._gentle, self.gentle_rate = gentle, gentle_rate
        self._rng, self._lock = random.Random(seed), threading.Lock()
        self.requests = 0
        self.faults: Counter[str] = Counter()
        self.gentle_faults = 0  # of those, on ``gentle`` requests
        proxy = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                proxy._handle(self)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass  # clients that exit mid-request (workers at the end of the run)

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _draw(self, path: str) -> str | None:
        with self._lock:
            self.requests += 1
            gentle = self._gentle(path)
            if self._rng.random() >= (self.gentle_rate if gentle else self.rate):
                return None
            kind = self._rng.choice(
                [k for k in self.KINDS if k != "lost"] if gentle else self.KINDS
            )
            self.faults[kind] += 1
            self.gentle_faults += gentle
            return kind

    @staticmethod
    def _read_body(h: BaseHTTPRequestHandler) -> bytes | None:
        if "chunked" in h.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(h.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(h.rfile.read(size))
                h.rfile.readline()
        length = h.headers.get("Content-Length")
        return h.rfile.read(int(length)) if length is not None else None

    @staticmethod
    def _drop(h: BaseHTTPRequestHandler, reset: bool) -> None:
        if reset:  # RST instead of FIN
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        h.close_connection = True

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = self._read_body(h)
        fault = self._draw(urllib.parse.unquote(h.path))
        if fault == "503":
            payload = json.dumps(
                {"error": {"code": 503, "message": "injected: backend unavailable"}}
            ).encode()
            h.send_response(503)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
            return
        if fault == "reset":
            return self._drop(h, reset=True)
        if fault == "stall":
            time.sleep(self.stall_s)
            return self._drop(h, reset=False)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Host"] = f"{self._host}:{self._port}"
        if body is not None:
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(self._host, self._port, timeout=120)
        try:
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            resp_headers = resp.getheaders()
        finally:
            conn.close()
        if fault == "lost":
            return self._drop(h, reset=False)
        h.send_response(resp.status, resp.reason)
        for k, v in resp_headers:
            if k.lower() in _HOP_BY_HOP or k.lower() in ("date", "server"):
                continue
            h.send_header(k, v.replace(self.upstream, self.url))
        length = dict((k.lower(), v) for k, v in resp_headers).get("content-length")
        h.send_header(
            "Content-Length", length if h.command == "HEAD" and length else str(len(data))
        )
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


def _is_checkpoint_io(path: str) -> bool:
    return "/checkpoints/" in path


@pytest.fixture
def fault_proxy(gcs_emulator):
    # The run store's requests fail at 20%. Orbax's (TensorStore, gcsfs) fail at 5%: their
    # retries back off for a second or more, and they are not what this test is about.
    proxy = FaultProxy(
        gcs_emulator.url, rate=0.2, seed=1, gentle=_is_checkpoint_io, gentle_rate=0.05
    )
    yield proxy
    proxy.close()


def test_fault_proxy_forwards_and_fails(fault_proxy, gcs_emulator):
    """The proxy itself: faithful forwarding, and about `rate` of requests failed."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from pipeline.storage import GCSStore, RetryPolicy

    client = storage.Client(
        project="rlax-test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": fault_proxy.url},
    )
    policy = RetryPolicy(max_attempts=30, initial_backoff_s=0.001, max_backoff_s=0.01)
    store = GCSStore(
        gcs_emulator.bucket, f"proxy-{uuid.uuid4().hex[:8]}", client=client, retry=policy
    )
    payloads = {f"k{i}": bytes([i]) * (1000 + i) for i in range(40)}
    for k, v in payloads.items():
        assert store.write_new(k, v)
        assert not store.write_new(k, b"other")  # a lost response is never "ours" by mistake
    for k, v in payloads.items():
        assert store.read(k) == v
    assert store.list("k") == sorted(payloads)
    assert fault_proxy.requests > 121
    rate = sum(fault_proxy.faults.values()) / fault_proxy.requests
    assert 0.1 < rate < 0.3, (rate, fault_proxy.faults)
    assert set(fault_proxy.faults) == set(FaultProxy.KINDS)


@pytest.mark.e2e
@needs_gcsfs
def test_gcs_run_survives_http_faults(
    gcs_emulator, tiny_base, reference, jax_cache_env, fault_proxy, tmp_path
):
    run = _gcs_run(gcs_emulator, tiny_base, "faults")  # set up without faults
    logs = tmp_path / "logs"
    env = {**jax_cache_env, **emulator_env(fault_proxy.url)}
    t0 = time.monotonic()
    procs = {n: start(run, n, logs, env) for n in ("trainer", "w0", "w1")}
    codes = wait_all(procs, RUN_TIMEOUT_S)
    wall = time.monotonic() - t0
    assert codes == {"trainer": 0, "w0": 0, "w1": 0}, _logs_tail(logs)
    _check_exactly_once(run)
    _check_checkpoints_on_gcs(run)
    version, tensors = final_tensors(run)
    assert version == reference[0]
    assert_bit_identical(reference[1], tensors)
    injected = sum(fault_proxy.faults.values())
    assert injected - fault_proxy.gentle_faults >= 20, fault_proxy.faults  # on the run store
    assert set(fault_proxy.faults) == set(FaultProxy.KINDS), fault_proxy.faults
    print(
        f"gcs run under faults: {wall:.1f}s, {fault_proxy.requests} requests, "
        f"{injected} faults {dict(fault_proxy.faults)}, "
        f"{fault_proxy.gentle_faults} of them on checkpoint I/O"
    )
