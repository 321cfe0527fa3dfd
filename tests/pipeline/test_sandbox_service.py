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

import contextlib
import os
import re
import resource
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
        cmd = [sys.executable, "-m", "pipeline.ops.cli", *command]
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


# --- The hardened front (pipeline/ops/http_guard.py): what a client without a token,
# or with one, cannot make the service hold. Short timeouts, so each attack ends in about
# a second; every connection is closed by the test.

HEAD_S, BODY_S, MAX_CONNECTIONS, MAX_BODY_KB, MAX_PROCESSES = 1.0, 1.0, 8, 64, 64


@pytest.fixture(scope="module")
def hardened(tmp_path_factory):
    svc = Service(
        tmp_path_factory.mktemp("sandbox-hardened"),
        "--concurrency",
        "1",
        "--queue",
        "1",
        "--max-body-kb",
        str(MAX_BODY_KB),
        "--header-timeout",
        str(HEAD_S),
        "--body-timeout",
        str(BODY_S),
        "--idle-timeout",
        "1",
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--max-limit",
        f"processes={MAX_PROCESSES}",
    )
    yield svc
    svc.stop()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=10)
    return conn


def _head(path: str = "/run_code", token: str | None = None, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: sandbox", "Content-Type: application/json"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_reply(conn: socket.socket, timeout_s: float = 5.0) -> tuple[int, str, float]:
    """(status, body, seconds until the server closed): the whole reply, read to EOF."""
    started = time.monotonic()
    conn.settimeout(timeout_s)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head else 0
    return status, body.decode(), time.monotonic() - started


def _answers_honestly(svc: Service) -> None:
    """/health answers, and a real run through the client comes back right."""
    assert svc.health()["status"] == "ok"
    with contextlib.closing(RemoteSandbox(svc.url, TOKEN)) as remote:
        assert remote.execute("print(input() * 2)", stdin="ab\n").stdout == "abab\n"


def test_the_token_and_the_size_are_checked_before_a_byte_of_body_is_read(hardened):
    # 10 GB declared and nothing sent: the refusal comes at once, the body never read.
    huge = 10_000_000_000
    cases = [
        (_head(Content_Length=str(huge)), 401, "Authorization: Bearer <token>"),
        (_head(token="nope", Content_Length=str(huge)), 403, "not the one"),
        (_head(token=TOKEN, Content_Length=str(huge)), 413, f"at most {MAX_BODY_KB * 1024}"),
        # Not a length h11 accepts: uvicorn's own 400, at once.
        (_head(token=TOKEN, Content_Length="1e10"), 400, "Invalid HTTP request"),
        (_head(token=TOKEN, Content_Length="-5"), 400, "Invalid HTTP request"),
    ]
    for head, status, words in cases:
        with contextlib.closing(_connect(hardened.url)) as conn:
            conn.sendall(head + b'{"co')  # a little of the body, no more
            got, body, elapsed = _read_reply(conn)
        assert (got, words in body) == (status, True), (head[:80], got, body)
        assert elapsed < HEAD_S, elapsed  # answered and closed well before any deadline
    # A head that does not end within 16 KiB (plus the read that passes it) is refused, not
    # buffered: a 400, or a reset when the server closes while the head is still coming.
    with contextlib.closing(_connect(hardened.url)) as conn:
        try:
            conn.sendall(_head(token=TOKEN, X_Padding="x" * 1_000_000))
            status = _read_reply(conn)[0]
        except ConnectionResetError:
            status = "reset"
    assert status in (400, "reset"), status
    # A chunked body has no length to check up front: refused once past the limit.
    with contextlib.closing(_connect(hardened.url)) as conn:
        conn.sendall(_head(token=TOKEN, Transfer_Encoding="chunked"))
        chunk = b"x" * 4096
        with contextlib.suppress(OSError):  # the server may close while we still send
            for _ in range(MAX_BODY_KB // 4 + 2):
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, body, _ = _read_reply(conn)
    assert status == 413 and "chunked" in body, body
    health = hardened.health()
    assert health["refused_token"] >= 2 and health["refused_too_large"] >= 2, health
    _answers_honestly(hardened)


def test_slow_heads_and_slow_bodies_are_cut_off_while_others_are_served(hardened):
    before = hardened.health()
    with (
        contextlib.closing(_connect(hardened.url)) as slow_head,
        contextlib.closing(_connect(hardened.url)) as slow_body,
    ):
        # Slowloris: one byte of the head every 0.2 s never completes it.
        head = _head(token=TOKEN, Content_Length="100")
        started = time.monotonic()
        slow_body.sendall(head + b'{"code": ')  # a whole head, 9 of 100 body bytes
        _answers_honestly(hardened)  # during both attacks
        closed_at = None
        for byte in head[:40]:
            try:
                slow_head.sendall(bytes([byte]))
            except OSError:  # reset: the server closed it
                closed_at = time.monotonic() - started
                break
            slow_head.settimeout(0.2)
            try:
                if slow_head.recv(1) == b"":
                    closed_at = time.monotonic() - started
                    break
            except TimeoutError:
                pass
        assert closed_at is not None and closed_at < HEAD_S + 2, closed_at
        status, body, _ = _read_reply(slow_body)
    assert status == 408 and "--body-timeout" in body, body
    after = hardened.health()
    assert after["closed_head_timeout"] > before["closed_head_timeout"]
    assert after["refused_body_timeout"] == before["refused_body_timeout"] + 1
    _answers_honestly(hardened)


def test_half_open_connections_are_capped_and_cannot_lock_out_honest_clients(hardened):
    # The cap and a few more connections that never send a byte: the oldest make room
    # for newer ones, honest requests are served during the flood, and all are gone
    # after the head deadline.
    idle = [_connect(hardened.url) for _ in range(MAX_CONNECTIONS + 4)]
    try:
        _answers_honestly(hardened)
        assert hardened.health()["connections"] <= MAX_CONNECTIONS
        deadline = time.monotonic() + HEAD_S + 3
        for conn in idle:
            conn.settimeout(max(deadline - time.monotonic(), 0.01))
            assert conn.recv(1) == b"", "a silent connection outlived the head deadline"
    finally:
        for conn in idle:
            conn.close()
    # Every connection busy with a request (a body that is slow to come): a newcomer is
    # refused at once, and served again once the bodies' deadline has passed.
    busy = [_connect(hardened.url) for _ in range(MAX_CONNECTIONS)]
    try:
        for conn in busy:
            conn.sendall(_head(token=TOKEN, Content_Length="100") + b"{")
        time.sleep(0.2)  # the heads are parsed
        with pytest.raises(httpx.TransportError):  # closed at once, not left waiting
            httpx.get(hardened.url + "/health", timeout=5)
        for conn in busy:
            assert _read_reply(conn)[0] == 408
    finally:
        for conn in busy:
            conn.close()
    health = hardened.health()
    assert health["refused_connection"] >= 1 and health["closed_for_newer"] >= 4, health
    _answers_honestly(hardened)


def test_limits_above_the_services_maxima_are_refused_naming_field_value_and_maximum(hardened):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    hard_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    max_files = min(4096, hard_nofile) if hard_nofile != resource.RLIM_INFINITY else 4096
    cases = [
        ({"rlax_limits": {"processes": 100000}}, "rlax_limits.processes=100000", MAX_PROCESSES),
        ({"rlax_limits": {"open_files": 10**7}}, "rlax_limits.open_files=10000000", max_files),
        ({"run_timeout": 3600}, "run_timeout=3600", 60),
        ({"memory_limit_MB": 1 << 20}, f"memory_limit_MB={1 << 20}", 4096),
    ]
    for extra, words, maximum in cases:
        reply = httpx.post(
            hardened.url + "/run_code", json={"code": "1", **extra}, headers=auth, timeout=10
        )
        detail = reply.json()["detail"]
        assert reply.status_code == 400 and words in detail, (extra, reply.text)
        assert f"at most {maximum}" in detail and "--max-limit" in detail, detail
    # At the maximum it runs, and the run really has that limit.
    with contextlib.closing(RemoteSandbox(hardened.url, TOKEN)) as remote:
        result = remote.execute(
            "import resource; print(resource.getrlimit(resource.RLIMIT_NPROC))",
            limits=Limits(processes=MAX_PROCESSES),
        )
    assert result.stdout == f"({MAX_PROCESSES}, {MAX_PROCESSES})\n", result
    _answers_honestly(hardened)


def test_serve_with_a_port_out_of_range_is_one_line_and_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.ops.cli", "sandbox", "serve", "--port", "99999"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()  # one line: no usage block before it
    assert "argument --port: '99999' is not a port; allowed: an integer 0-65535" in line


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--port", "99999"], "argument --port: '99999' is not a port; allowed: an integer"),
        (["--port", "-1"], "argument --port: '-1' is not a port"),
        (["--max-limit", "bogus=1"], "--max-limit='bogus' is invalid; allowed: one of timeout_s"),
        (["--max-limit", "processes"], "allowed: FIELD=NUMBER"),
        (["--max-limit", "processes=1"], "--max-limit processes=1.0 is invalid; allowed: >= 32"),
        (["--max-limit", f"open_files={10**9}"], "hard RLIMIT_NOFILE"),
        (["--max-body-kb", "0"], "--max-body-kb=0 is invalid; allowed: >= 1"),
        (["--header-timeout", "0"], "--header-timeout=0.0 is invalid; allowed: 0 < seconds"),
        (["--max-connections", "0"], "--max-connections=0 is invalid; allowed: >= 1"),
    ],
)
def test_bad_serve_arguments_are_one_line_and_exit_2(args, words, capsys):
    """In-process (the CLI's own parser and error path, as `rlax` runs them); each is
    refused before the service starts, so nothing here serves."""
    from pipeline.entrypoint import run_main
    from pipeline.ops.cli import build_parser

    try:
        parsed = build_parser().parse_args(["sandbox", "serve", "--port", "0", *args])
    except SystemExit as stop:  # argparse's own refusal
        code = stop.code
    else:
        code = run_main("rlax", lambda _argv: parsed.func(parsed))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert words in line, err
