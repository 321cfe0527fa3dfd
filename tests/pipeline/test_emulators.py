"""`pipeline.ops.emulators`: the one fake-gcs-server launcher of the tests, the benchmarks
and the stack (in memory, or on disk as the stack runs it)."""

from __future__ import annotations

import subprocess
import time

import pytest

from pipeline.net import free_port
from pipeline.ops import emulators, stack

pytestmark = pytest.mark.skipif(
    emulators.fake_gcs_binary() is None, reason="fake-gcs-server not installed (test extra)"
)


def test_start_fake_gcs_serves_objects_and_bucket_creation_is_idempotent(tmp_path):
    with emulators.start_fake_gcs(tmp_path / "log") as gcs:
        assert gcs.url.startswith("http://127.0.0.1:") and emulators.fake_gcs_ready(gcs.url)
        emulators.create_bucket(gcs.url, "bkt")
        emulators.create_bucket(gcs.url, "bkt")  # exists: left as it is
        client = emulators.gcs_client(gcs.url, "rlax-test")
        client.bucket("bkt").blob("k").upload_from_string(b"payload")
        assert client.bucket("bkt").blob("k").download_as_bytes() == b"payload"
        proc = gcs.proc
    assert proc.poll() is not None  # stopped on leaving the block
    assert not emulators.fake_gcs_ready(gcs.url)


def test_the_stacks_disk_backend_keeps_objects_under_its_root(tmp_path):
    """The stack's service argv is the launcher's command with a filesystem root."""
    st = stack.Stack(root=tmp_path / "stack", ports={"gcs": free_port()})
    cmd = stack.SERVICES_BY_NAME["gcs"].command(st)
    binary = emulators.fake_gcs_binary()
    assert cmd == emulators.fake_gcs_command(binary, st.port("gcs"), root=st.dir("gcs"))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        server = emulators.FakeGCS(proc, st.gcs_url)
        while not emulators.fake_gcs_ready(server.url):
            assert proc.poll() is None, "fake-gcs-server exited"
            time.sleep(0.05)
        emulators.create_bucket(server.url, stack.BUCKET)
        client = emulators.gcs_client(server.url, "rlax-test")
        client.bucket(stack.BUCKET).blob("runs/x").upload_from_string(b"on disk")
        assert (st.dir("gcs") / stack.BUCKET / "runs" / "x").read_bytes() == b"on disk"
    finally:
        server.stop()


def test_emulator_env_points_every_client_library_at_the_endpoint():
    env = emulators.emulator_env("http://127.0.0.1:1")
    assert env["STORAGE_EMULATOR_HOST"] == env["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:1"
    assert "127.0.0.1" in env["NO_PROXY"]
