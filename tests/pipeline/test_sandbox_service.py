"""`rlax sandbox serve` and `RemoteSandbox`: the real service, started as its own process on
127.0.0.1, its real bubblewrap workers, real HTTP clients.

What is checked: under concurrent load nothing is lost and every reply has a status; the
token is enforced (401 without one, 403 for a wrong one); a full service answers 429 and
the client retries until every job is done; a URL nothing answers at is a SandboxError
naming the URL and the command to start; `rlax_limits` (packages, warm-up) reaches the
service's workers, and a package the service lacks comes back as the sandbox's error, not
as a failed program; a stopped service leaves no sandbox process behind.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest

import pipeline.sandbox as sandbox
from pipeline.errors import ConfigError
from pipeline.sandbox import STATUSES, Job, Limits, SandboxError
from pipeline.sandbox.client import RemoteSandbox
from pipeline.sandbox.isolation import userns_forbidden

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-" + uuid.uuid4().hex

_FORBIDDEN = userns_forbidden()
pytestmark = pytest.mark.skipif(_FORBIDDEN is not None, reason=f"no sandbox here: {_FORBIDDEN}")


class Service:
    """`rlax sandbox serve` as a child process (port 0: the kernel picks a free one).
    `command`: the whole `rlax` argv instead (it must pick a free port itself)."""

    def __init__(
        self, tmp: Path, *args: str, token: str | None = TOKEN, command: list[str] | None = None
    ) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("RLAX_SANDBOX_TOKEN", None)
        if token:
            env["RLAX_SANDBOX_TOKEN"] = token
        self.stderr_path = tmp / f"service-{uuid.uuid4().hex[:8]}.err"
        command = command or ["sandbox", "serve", "--port", "0", *args]
        cmd = [sys.executable, "-m", "pipeline.cli", *command]
        with self.stderr_path.open("w") as stderr:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
            )
        self.lines: list[str] = []
        self.url = self._wait_for_url(timeout_s=120)

    def _wait_for_url(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(deadline - time.monotonic()):
                    break
                line = self.proc.stdout.readline()
                if not line:
                    break
                self.lines.append(line)
                if match := re.search(r"serving (http://\S+)", line):
                    return match.group(1)
        self.proc.kill()
        raise AssertionError(f"the service did not start: {self.stderr_path.read_text()}")

    def descendants(self) -> set[int]:
        """Host pids below the service (its bwrap workers and their processes)."""
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        found, frontier = set(), {self.proc.pid}
        while frontier:
            frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
            found |= frontier
        return found

    def stop(self) -> str:
        """SIGTERM, as a deployment stops it; returns what it printed."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        return "".join(self.lines) + out

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = Service(
        tmp_path_factory.mktemp("sandbox-service"),
        "--concurrency",
        "2",
        "--queue",
        "2",
        "--max-worker-kinds",
        "3",
    )
    yield svc
    svc.stop()


def test_four_clients_of_200_requests_lose_nothing_and_leave_no_process(tmp_path):
    # Capacity 2 running + 2 waiting for 4 clients of 2 threads each: a share of the
    # requests is refused (429) and retried, and each must still come back exactly once.
    svc = Service(tmp_path, "--concurrency", "2", "--queue", "2")
    clients, per_client, threads_per_client = 4, 200, 2
    results: dict[tuple[int, int], object] = {}
    errors: list[BaseException] = []

    def program(c: int, i: int) -> tuple[str, str]:
        if i % 10 == 3:  # some programs fail: their status must come back too
            return f"import sys; print('c{c}-{i}'); sys.exit(3)", "error"
        return f"print('c{c}-' + input())", "ok"

    def client_loop(c: int, part: int, remote: RemoteSandbox) -> None:
        try:
            for i in range(part, per_client, threads_per_client):
                code, _ = program(c, i)
                results[c, i] = remote.execute(code, stdin=f"{i}\n")
        except BaseException as err:  # reported below, with the pytest assertion
            errors.append(err)

    remotes = [RemoteSandbox(svc.url, TOKEN) for _ in range(clients)]
    threads = [
        threading.Thread(target=client_loop, args=(c, part, remotes[c]))
        for c in range(clients)
        for part in range(threads_per_client)
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    assert not errors, errors[:3]
    assert len(results) == clients * per_client
    for (c, i), result in results.items():
        _, status = program(c, i)
        assert result.status in STATUSES and result.status == status, (c, i, result)
        assert result.stdout == f"c{c}-{i}\n"
    health = svc.health()
    assert health["served"] == clients * per_client
    assert health["by_status"] == dict(Counter(program(c, i)[1] for c, i in results))
    print(
        f"{clients}x{per_client} requests in {elapsed:.1f} s "
        f"({clients * per_client / elapsed:.0f}/s), {health['refused_full']} refused and retried"
    )

    workers = svc.descendants()
    assert workers, "the service runs its programs in sandbox processes below it"
    for remote in remotes:
        remote.close()
    out = svc.stop()
    assert svc.proc.returncode == 0, out
    assert "stopped" in out and "workers killed" in out
    deadline = time.monotonic() + 10
    while (left := [pid for pid in workers if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"sandbox processes left after the service stopped: {left}"


def test_token_missing_or_wrong_is_refused_with_a_clear_message(service):
    body = {"code": "print(1)"}
    missing = httpx.post(service.url + "/run_code", json=body, timeout=10)
    assert missing.status_code == 401
    assert "Authorization: Bearer <token>" in missing.json()["detail"]
    wrong = httpx.post(
        service.url + "/run_code",
        json=body,
        headers={"Authorization": "Bearer nope"},
        timeout=10,
    )
    assert wrong.status_code == 403 and "not the one" in wrong.json()["detail"]
    for token, code in [(None, "401"), ("nope", "403")]:
        with pytest.raises(SandboxError, match=rf"{re.escape(service.url)}.*{code}") as err:
            RemoteSandbox(service.url, token).execute("print(1)")
        assert "RLAX_SANDBOX_TOKEN" in str(err.value)
    assert RemoteSandbox(service.url, TOKEN).execute("print(1)").stdout == "1\n"


def test_a_full_service_answers_429_and_the_client_retries_until_all_are_done(tmp_path):
    svc = Service(tmp_path, "--concurrency", "1", "--queue", "0")
    try:
        remote = RemoteSandbox(svc.url, TOKEN)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        slow = threading.Thread(target=remote.execute, args=("import time; time.sleep(1.5)",))
        slow.start()
        deadline = time.monotonic() + 10
        while svc.health()["running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        full = httpx.post(
            svc.url + "/run_code", json={"code": "print(1)"}, headers=auth, timeout=10
        )
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert "full" in full.json()["detail"]
        slow.join()
        # Eight at once at a service that takes one: nothing lost, order kept.
        jobs = [Job(f"import time; time.sleep(0.05); print({i})") for i in range(8)]
        results = remote.execute_many(jobs, concurrency=8)
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
        assert svc.health()["refused_full"] > 1
    finally:
        svc.stop()


def test_a_url_nothing_answers_at_names_it_and_what_to_start():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(SandboxError) as err:
        RemoteSandbox(url, retries=1).execute("print(1)")
    message = str(err.value)
    assert url in message and f"rlax sandbox serve --host 127.0.0.1 --port {port}" in message
    # The same through the process's backend, as a verifier calls it.
    sandbox.configure(url)
    try:
        with pytest.raises(SandboxError, match=re.escape(url)):
            sandbox.execute_many([Job("print(1)")])
    finally:
        sandbox.configure(None)
    with pytest.raises(ConfigError, match="sandbox url.*allowed"):
        sandbox.configure("ftp://127.0.0.1:21")
    with pytest.raises(ConfigError, match="http://host:port"):
        RemoteSandbox("http://127.0.0.1")


def test_packages_and_warmup_travel_and_a_missing_package_is_the_sandboxes_error(service):
    remote = RemoteSandbox(service.url, TOKEN)
    limits = Limits(packages=("mpmath",), warmup="import builtins; builtins.RLAX_WARM = 'warm'")
    result = remote.execute("import mpmath; print(RLAX_WARM, mpmath.mpf(2) ** 10)", limits=limits)
    assert (result.status, result.stdout) == ("ok", "warm 1024.0\n"), result
    with pytest.raises(SandboxError, match="could not run the program") as err:
        remote.execute("print(1)", limits=Limits(packages=("no_such_package_rlax",)))
    assert "no_such_package_rlax" in str(err.value) and "not installed" in str(err.value)
    # --max-worker-kinds 3: the default kind, the one above and one more (the kind whose
    # workers never started took no place); a fourth is refused, by name.
    assert remote.execute("print(1)", limits=Limits(tmpfs_mb=32)).stdout == "1\n"
    with pytest.raises(SandboxError, match="--max-worker-kinds"):
        remote.execute("print(1)", limits=Limits(tmpfs_mb=48))


def test_execute_many_through_the_service_keeps_order_statuses_and_isolation(service):
    marker = f"/tmp/rlax-service-{uuid.uuid4().hex}"
    sandbox.configure(service.url, TOKEN)
    try:
        jobs = [
            Job("print(input()[::-1])", stdin="abc"),
            Job("raise SystemExit(4)"),
            Job("while True: pass", limits=Limits(timeout_s=0.5)),
            Job(f"open({marker!r}, 'w').write('x'); print('wrote')"),
            Job("x = bytearray(1 << 30)", limits=Limits(memory_mb=128)),
        ]
        results = sandbox.execute_many(jobs)
    finally:
        sandbox.configure(None)
    assert [r.status for r in results] == ["ok", "error", "timeout", "ok", "memory"]
    assert results[0].stdout == "cba\n" and results[1].returncode == 4
    assert not os.path.exists(marker)  # the run's /tmp is its sandbox's, not the host's


def test_bad_requests_name_the_field_and_what_is_allowed(service):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases = [
        ({"code": "1", "run_timeout": -1}, "run_timeout"),
        ({"code": "1", "language": "cpp"}, "allowed: 'python'"),
        ({"code": "1", "rlax_limits": {"bogus": 1}}, "rlax_limits.bogus"),
        ({"code": "1", "rlax_limits": {"packages": "sympy"}}, "rlax_limits.packages"),
        ({"code": "1", "rlax_limits": {"extra_ro_paths": ["/etc"]}}, "--ro-path"),
        ({"stdin": ""}, "code"),
    ]
    for body, words in cases:
        reply = httpx.post(service.url + "/run_code", json=body, headers=auth, timeout=10)
        assert reply.status_code == 400, (body, reply.text)
        assert words in reply.json()["detail"], (body, reply.text)


def test_math_and_code_families_judge_the_same_through_the_service(tmp_path, monkeypatch):
    """With `sandbox.url` set, the verifiers' runs go to the service: same rewards as the
    local pool, including math-verify's packages bound on the service's side. (Its own
    service: the shared one's worker kinds are used up by the tests above.)"""
    from pipeline.tasks import get_task
    from pipeline.tasks.base import Problem

    math = [
        (Problem("m0", "math", "q", "$\\frac{14}{3}$", {}), "so \\boxed{\\frac{28}{6}}"),
        (Problem("m1", "math", "q", "7,425,000", {}), "The answer is \\boxed{7425000}."),
        (Problem("m2", "math", "q", "28\\%", {}), "\\boxed{27\\%}"),
    ]
    tests = "def check(f):\n    assert f(2) == 4 and f(-3) == 9\n"
    code = [
        (Problem("c0", "code", "q", "", {"tests": tests, "entry_point": "sq"}), body)
        for body in ("```python\ndef sq(x):\n    return x * x\n```", "def sq(x): return 2 * x")
    ]
    cases = {"math": math, "code": code}
    local = {f: get_task(f).verify_batch(*zip(*pairs, strict=True)) for f, pairs in cases.items()}
    assert local == {"math": [1.0, 1.0, 0.0], "code": [1.0, 0.0]}
    monkeypatch.setattr(sandbox, "_backend", None)
    service = Service(tmp_path)
    try:
        sandbox.configure(service.url, TOKEN)
        assert isinstance(sandbox.backend(), RemoteSandbox)
        remote = {
            f: get_task(f).verify_batch(*zip(*pairs, strict=True)) for f, pairs in cases.items()
        }
        assert service.health()["served"] == 5  # every run went to the service
    finally:
        sandbox.configure(None)
        service.stop()
    assert remote == local
