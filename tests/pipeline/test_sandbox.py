"""pipeline.sandbox: each guarantee of docs/security.md ("The sandbox"), attacked for real.

Every test runs a real program in a real bubblewrap sandbox and then looks at the host
(its sockets, files, environment and process table) for what the program tried to do.
"""

from __future__ import annotations

import errno
import importlib.metadata
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.sandbox import STATUSES, ExecResult, Limits, SandboxError, execute, seccomp
from pipeline.sandbox.isolation import NOBODY, userns_forbidden
from pipeline.sandbox.pool import Pool

ROOT = Path(__file__).resolve().parents[2]

_FORBIDDEN = userns_forbidden()
pytestmark = pytest.mark.skipif(_FORBIDDEN is not None, reason=f"no sandbox here: {_FORBIDDEN}")


def _run(code: str, **kwargs) -> ExecResult:
    result = execute(code, **kwargs)
    assert result.status in STATUSES
    return result


def _host_processes_with(token: str) -> list[int]:
    """Host pids whose command line carries `token` (this test process excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline:
            found.append(int(entry.name))
    return found


def test_statuses_ok_error_and_stdin():
    assert _run("import sys; print(sys.stdin.read().upper())", stdin="abc").stdout == "ABC\n"
    failed = _run("import sys; print('partial'); sys.exit(3)")
    assert (failed.status, failed.returncode, failed.stdout) == ("error", 3, "partial\n")
    raised = _run("def f():\n    raise ValueError('bad input')\nf()")
    assert raised.status == "error" and raised.returncode == 1
    assert raised.stderr.endswith("ValueError: bad input\n")
    assert "worker" not in raised.stderr  # the traceback starts at the program's frames


def test_no_network_not_even_the_hosts_loopback():
    token = uuid.uuid4().hex
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket(socket.AF_UNIX) as ux:
        ux.bind("\0rlax-" + token)  # an abstract Unix socket: network-namespace scoped too
        ux.listen()
        port = server.getsockname()[1]
        program = f"""
import socket
for family, address in [(socket.AF_INET, ("127.0.0.1", {port})),
                        (socket.AF_UNIX, "\\0rlax-{token}"),
                        (socket.AF_INET, ("8.8.8.8", 53))]:
    s = socket.socket(family)
    s.settimeout(2)
    try:
        s.connect(address)
        print("connected", address)
    except OSError as exc:
        print("refused", type(exc).__name__)
"""
        result = _run(program)
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()
    assert result.status == "ok", result.stderr
    assert result.stdout.count("refused") == 3 and "connected" not in result.stdout


def test_no_host_files_beyond_the_interpreter(tmp_path):
    secret = uuid.uuid4().hex
    planted = [ROOT / f".sandbox-secret-{secret}", Path.home() / f".sandbox-secret-{secret}"]
    for path in planted:
        path.write_text(secret)
    targets = [
        *map(str, planted),
        "/etc/passwd",
        "/etc/shadow",
        str(ROOT / "pyproject.toml"),
        str(ROOT / ".venv" / "pyvenv.cfg"),
        "/proc/1/root/etc/passwd",
        "/usr/local/bin",
    ]
    program = f"""
import os
for path in {targets!r}:
    try:
        print(open(path).read() if os.path.isfile(path) else os.listdir(path))
    except OSError as exc:
        print("denied", type(exc).__name__)
print(sorted(os.listdir("/")))
try:
    import numpy
    print("imported numpy")
except ImportError:
    print("no numpy")
"""
    try:
        result = _run(program)
    finally:
        for path in planted:
            path.unlink()
    assert result.status == "ok", result.stderr
    lines = result.stdout.splitlines()
    # Not there at all, or (/proc/1/root of the non-dumpable worker) not ours to read.
    assert all(line.startswith("denied ") for line in lines[: len(targets)]), lines
    assert secret not in result.stdout
    assert lines[len(targets)] == str(sorted(["bin", "dev", "lib", "lib64", "proc", "tmp", "usr"]))
    assert lines[-1] == "no numpy"


def test_extra_read_only_paths_are_visible_and_read_only():
    # Under the project, not tmp_path: pytest's /tmp/pytest-of-root is 0700, and a root
    # caller's sandbox runs as nobody.
    extra = ROOT / f".sandbox-extra-{uuid.uuid4().hex}"
    extra.mkdir()
    try:
        (extra / "helper_mod.py").write_text("VALUE = 42\n")
        extra.chmod(0o755)
        program = f"""
import sys
sys.path.insert(0, {str(extra)!r})
import helper_mod
print(helper_mod.VALUE)
try:
    open({str(extra / "new.txt")!r}, "w")
except OSError as exc:
    print("read-only", exc.errno)
"""
        result = _run(program, limits=Limits(extra_ro_paths=(str(extra),)))
    finally:
        for path in extra.iterdir():
            path.unlink()
        extra.rmdir()
    assert result.status == "ok", result.stderr
    assert result.stdout == f"42\nread-only {errno.EROFS}\n"


def test_packages_are_bound_read_only_preloaded_and_alone():
    # idna (a package) and six (one module): only their own files and metadata are
    # inside, already imported when the run starts; the rest of site-packages is not.
    program = """
import importlib.metadata, os, sys
print(sorted(n for n in ("idna", "six") if n in sys.modules))
import idna, six
print(idna.__file__.startswith("/opt/rlax/site/idna/"), six.__file__)
print(importlib.metadata.version("idna") == {!r})
print(sorted(n.split("-")[0] for n in os.listdir("/opt/rlax/site")))
try:
    import yaml
except ImportError:
    print("no yaml")
try:
    open("/opt/rlax/site/idna/new.py", "w")
except OSError as exc:
    print("read-only", exc.errno)
""".format(importlib.metadata.version("idna"))
    result = _run(program, limits=Limits(packages=("idna", "six")))
    assert result.status == "ok", result.stderr
    assert result.stdout.splitlines() == [
        "['idna', 'six']",
        "True /opt/rlax/site/six.py",
        "True",
        "['idna', 'idna', 'six', 'six.py']",  # each module and its .dist-info
        "no yaml",
        f"read-only {errno.EROFS}",
    ]


def test_warmup_runs_in_the_worker_and_every_run_inherits_it():
    warmup = "import os, sys\nsys.modules['warm_state'] = type(sys)('warm_state')\n"
    warmup += "sys.modules['warm_state'].pid = os.getpid()\n"
    program = "import os, warm_state; print(warm_state.pid != os.getpid())"
    results = [_run(program, limits=Limits(warmup=warmup)) for _ in range(3)]
    assert [r.stdout for r in results] == ["True\n"] * 3, [r.stderr for r in results]


def test_a_missing_package_or_a_failing_warmup_is_a_sandbox_error_naming_it():
    with pytest.raises(SandboxError, match="'no_such_module_xyz' is not installed"):
        execute("pass", limits=Limits(packages=("no_such_module_xyz",)))
    with pytest.raises(SandboxError, match="(?s)did not start.*ZeroDivisionError"):
        execute("pass", limits=Limits(warmup="1 / 0"))


def test_nothing_written_outlives_the_run():
    name = f"rlax-sandbox-{uuid.uuid4().hex}"
    pool = Pool(Limits(), size=1)  # one worker, so every run below goes to it
    listing = "import os; print(os.listdir('/tmp'), os.listdir('/dev/shm'))"
    try:
        program = f"""
import os
for path in ["/tmp/{name}", "/dev/shm/{name}", "/usr/{name}", "/{name}", "/dev/{name}"]:
    try:
        with open(path, "w") as f:
            f.write("x")
        print("wrote", path)
    except OSError as exc:
        print("refused", path, type(exc).__name__)
os.makedirs("/tmp/{name}.d/sub")
"""
        first = pool.execute(program, "", Limits())
        assert first.status == "ok", first.stderr
        assert first.stdout.count("wrote") == 2 and first.stdout.count("refused") == 3
        (worker,) = pool.idle_workers()
        assert pool.execute(listing, "", Limits()).stdout == "[] []\n"
        assert pool.idle_workers() == [worker]  # wiped, and kept
        # A directory its owner cannot list defeats the wipe: the worker is replaced.
        pool.execute(
            f"import os; os.mkdir('/tmp/{name}'); os.chmod('/tmp/{name}', 0)", "", Limits()
        )
        assert pool.idle_workers() == []
        assert pool.execute(listing, "", Limits()).stdout == "[] []\n"
        assert pool.idle_workers() != [worker]
    finally:
        pool.close()
    assert not any(Path(p).exists() for p in (f"/tmp/{name}", f"/dev/shm/{name}", f"/{name}"))


def test_a_caller_waiting_for_a_retired_workers_slot_gets_a_new_worker():
    # Regression: retiring a worker once freed no slot, so a caller waiting on a full
    # pool waited forever.
    pool = Pool(Limits(), size=1)
    dirty = "import os, time; os.mkdir('/tmp/d'); os.chmod('/tmp/d', 0); time.sleep(0.5)"
    results = []
    try:
        first = threading.Thread(target=lambda: results.append(pool.execute(dirty, "", Limits())))
        first.start()
        time.sleep(0.2)  # the first run holds the only worker
        second = threading.Thread(
            target=lambda: results.append(pool.execute("print('served')", "", Limits()))
        )
        second.start()
        first.join(10)
        second.join(10)
        assert not second.is_alive(), "the waiting caller was never served"
    finally:
        pool.close()
    assert [r.stdout for r in results] == ["", "served\n"]


def test_clean_environment(monkeypatch):
    monkeypatch.setenv("RLAX_SECRET", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter3")
    pool = Pool(Limits(), size=1)  # started after the variables exist
    try:
        program = """
import os
print(sorted(os.environ))
print(open("/proc/self/environ").read())
try:
    print(open("/proc/1/environ").read())  # the worker's: non-dumpable, so not readable
except PermissionError:
    print("worker environ denied")
"""
        result = pool.execute(program, "", Limits())
    finally:
        pool.close()
    assert result.status == "ok", result.stderr
    assert result.stdout.splitlines()[0] == str(["HOME", "LANG", "PATH", "PWD", "PYTHONHASHSEED"])
    assert "hunter" not in result.stdout and "RLAX_SECRET" not in result.stdout
    assert result.stdout.endswith("worker environ denied\n")


def test_not_root_inside_nor_on_the_host():
    program = """
import ctypes, os
print(os.getuid(), os.geteuid(), os.getgid())
for attempt in (lambda: os.setuid(0), lambda: os.chroot("/tmp")):
    try:
        attempt()
        print("allowed")
    except OSError:  # EPERM, or EINVAL for setuid(0): no uid 0 exists in the namespace
        print("denied")
libc = ctypes.CDLL(None, use_errno=True)
print("unshare", libc.unshare(0x10000000), ctypes.get_errno() != 0)  # CLONE_NEWUSER
print(open("/proc/self/status").read())
"""
    pool = Pool(Limits(), size=1)
    try:
        result = pool.execute(program, "", Limits())
        (worker,) = pool.idle_workers()
        host_uid = int(
            next(
                line.split()[1]
                for line in Path(f"/proc/{worker.pid}/status").read_text().splitlines()
                if line.startswith("Uid:")
            )
        )
    finally:
        pool.close()
    assert result.status == "ok", result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] != "0 0 0" and "0" not in lines[0].split()
    assert lines[1:4] == ["denied", "denied", "unshare -1 True"]
    assert "CapEff:\t0000000000000000" in result.stdout
    assert "NoNewPrivs:\t1" in result.stdout
    assert host_uid == (NOBODY if os.geteuid() == 0 else os.geteuid())


@pytest.mark.skipif(seccomp.program() is None, reason="no seccomp table for this architecture")
def test_seccomp_refuses_kernel_surface_no_program_needs():
    program = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print([line for line in open("/proc/self/status") if line.startswith("Seccomp:")])
for name, call in [("ptrace", lambda: libc.ptrace(0, 0, 0, 0)),  # PTRACE_TRACEME
                   ("mount", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
                   ("keyctl", lambda: libc.syscall(250, 0, 0, 0, 0)),
                   ("bpf", lambda: libc.syscall(321, 0, 0, 0))]:
    ctypes.set_errno(0)
    print(name, call(), ctypes.get_errno())
"""
    result = _run(program)
    assert result.status == "ok", result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == str(["Seccomp:\t2\n"])  # filter mode
    assert lines[1:] == [
        f"{name} -1 {errno.EPERM}" for name in ("ptrace", "mount", "keyctl", "bpf")
    ]
    # A call through the x32 ABI would dodge the table's numbers: it kills the process.
    x32 = _run("import ctypes; ctypes.CDLL(None).syscall(0x40000000 + 39)")
    assert (x32.status, x32.returncode) == ("error", -signal.SIGSYS)


def test_fork_bomb_is_limited_and_cleaned_up():
    token = uuid.uuid4().hex
    limited = f"""
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
except OSError as exc:
    print("limited after", children, exc.errno)  # {token}
"""
    result = _run(limited, limits=Limits(processes=16))
    assert result.status == "ok", result.stderr
    assert result.stdout.startswith("limited after ") and result.stdout.endswith(" 11\n")  # EAGAIN
    assert int(result.stdout.split()[2]) < 16
    bomb = """
import os, subprocess
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    start = time.monotonic()
    exploded = _run(bomb, limits=Limits(processes=32, timeout_s=2))
    assert exploded.status == "timeout" and time.monotonic() - start < 2 + 5
    assert _run("print(1)").stdout == "1\n"


def test_memory_limit():
    result = _run("x = bytearray(400 * 2**20)\nprint('allocated')", memory_mb=128)
    assert (result.status, result.stdout) == ("memory", "")
    assert result.stderr.endswith("MemoryError\n")
    growing = _run("chunks = []\nwhile True:\n    chunks.append(' ' * 2**20)", memory_mb=128)
    assert growing.status == "memory"
    assert _run("x = bytearray(50 * 2**20); print(len(x))", memory_mb=256).status == "ok"


def test_wall_clock_and_cpu_time_limits():
    for program in ("while True: pass", "import time; time.sleep(60)"):
        start = time.monotonic()
        result = _run(program, timeout_s=1.0)
        assert result.status == "timeout" and result.returncode == -signal.SIGKILL
        assert 1.0 <= result.wall_s < 2.0 and time.monotonic() - start < 4.0
    # The CPU limit alone: a process that burns CPU stops at RLIMIT_CPU (SIGXCPU), long
    # before the wall clock would.
    cpu = _run("while True: pass", limits=Limits(timeout_s=60, cpu_s=1))
    assert (cpu.status, cpu.returncode) == ("timeout", -signal.SIGXCPU)


def test_file_size_limit():
    result = _run("open('/tmp/big', 'wb').write(b'x' * (3 * 2**20))", limits=Limits(file_size_mb=1))
    assert result.status == "error" and "File too large" in result.stderr


def test_output_limit():
    result = _run("while True:\n    print('y' * 1000)", limits=Limits(output_bytes=10_000))
    assert result.status == "output_limit"
    assert len(result.stdout) + len(result.stderr) <= 10_000
    exact = _run("print('z' * 99, end='')", limits=Limits(output_bytes=100))
    assert exact.status == "ok" and exact.stdout == "z" * 99


def test_daemonised_descendants_die_with_the_run():
    token = f"rlax-daemon-{uuid.uuid4().hex}"
    # A classic double fork: the grandchild is in its own session, re-parented away from
    # the program, and execs a process whose command line the host can search for.
    program = f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/proc/self/exe", ["python3", "-I", "-S", "-c",
                 "import time; time.sleep(60)  # {token}"])
    os._exit(0)
def daemon_running():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"{token}" in open(f"/proc/{{pid}}/cmdline", "rb").read():
                return True
        except OSError:
            pass
    return False
deadline = time.monotonic() + 10
while not daemon_running() and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)  # long enough for the host to see it too
print("parent leaves")
"""
    seen = []
    result_box = []
    runner = threading.Thread(target=lambda: result_box.append(_run(program)))
    runner.start()
    while runner.is_alive():
        seen += _host_processes_with(token)
        time.sleep(0.05)
    runner.join()
    assert result_box[0].status == "ok" and result_box[0].stdout == "parent leaves\n"
    assert seen, "the daemon never ran: the test proves nothing"
    time.sleep(0.2)
    assert _host_processes_with(token) == []


def test_a_worker_outlives_the_thread_that_started_it():
    # Regression: bwrap's --die-with-parent fires when the starting THREAD exits, so
    # every worker started inside an `execute_many` call died with its thread pool and
    # the next batch's first runs came back as "sandbox worker died" (a silent 0 reward).
    pool = Pool(Limits(), size=1)
    try:
        starter = threading.Thread(target=lambda: pool.execute("print(1)", "", Limits()))
        starter.start()
        starter.join(30)
        time.sleep(0.3)  # the kernel's parent-death signal is asynchronous
        (worker,) = pool.idle_workers()
        assert worker.proc.poll() is None, "the worker died with its starting thread"
        assert pool.execute("print('still')", "", Limits()).stdout == "still\n"
    finally:
        pool.close()


def test_pool_survives_a_program_that_kills_its_parent():
    pool = Pool(Limits(), size=1)
    try:
        for program in (
            "import os, signal; os.kill(os.getppid(), signal.SIGKILL)",
            "import os, signal; os.kill(1, signal.SIGTERM); os.kill(1, signal.SIGINT)",
            "import os, signal; os.kill(-1, signal.SIGKILL)",
        ):
            pool.execute(program, "", Limits())
            assert pool.execute("print('alive')", "", Limits()).stdout == "alive\n"
        # And when the worker does die mid-run (here killed from the host), the run is
        # reported as lost and the pool replaces the worker. (A worker killed while idle is
        # replaced before it is handed a run: the test below.)
        (worker,) = pool.idle_workers()
        killer = threading.Timer(1.0, os.killpg, (worker.pid, signal.SIGKILL))
        killer.start()
        died = pool.execute("import time; time.sleep(30)", "", Limits())
        killer.join()
        assert died.status == "error" and "died" in died.stderr
        assert pool.execute("print('replaced')", "", Limits()).stdout == "replaced\n"
    finally:
        pool.close()


def test_injected_shell_commands_leave_nothing_on_the_host():
    marker = f"/tmp/pwned-{uuid.uuid4().hex}"
    for program in (
        f"__import__('os').system('touch {marker}')",
        f"import subprocess; subprocess.run(['touch', '{marker}'])",
        f"open('{marker}', 'w').write('x')",
    ):
        _run(program)
    assert not Path(marker).exists()
    probe = subprocess.run(["ls", "/tmp"], capture_output=True, text=True, check=True)
    assert Path(marker).name not in probe.stdout


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_s", 0),
        ("memory_mb", 8),
        ("processes", 1),
        ("output_bytes", 0),
        ("extra_ro_paths", ("relative/path",)),
        ("packages", ("not-a-module",)),
    ],
)
def test_bad_limits_name_the_field_and_what_is_allowed(field, value):
    with pytest.raises(ConfigError, match=rf"sandbox\.{field}=.*allowed"):
        Limits(**{field: value})


def test_a_worker_that_dies_while_idle_is_replaced_not_handed_a_run():
    pool = Pool(Limits(), size=1)
    try:
        assert pool.execute("print(1)", "", Limits()).stdout == "1\n"
        (worker,) = pool.idle_workers()
        os.killpg(worker.pid, signal.SIGKILL)  # killed from outside, between runs
        worker.proc.wait()
        assert pool.execute("print('replaced')", "", Limits()).stdout == "replaced\n"
    finally:
        pool.close()


# Run 1 plants one of each kind of inter-process object under a fixed name or key; run 2,
# in the same worker, looks for them. ctypes: the stdlib has no System V or mqueue calls.
IPC_PLANT = """
import ctypes, os
from multiprocessing import shared_memory
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm = libc.shmget(0x5EED, 4096, 0o1600)  # IPC_CREAT | 0600
ctypes.memmove(libc.shmat(shm, None, 0), b"counter=7", 9)
msq = libc.msgget(0x5EED, 0o1600)
message = ctypes.create_string_buffer(b"\\x01\\0\\0\\0\\0\\0\\0\\0hello", 13)
assert libc.msgsnd(msq, message, 5, 0) == 0
sem = libc.semget(0x5EED, 1, 0o1600)
assert libc.semctl(sem, 0, 16, 42) == 0  # SETVAL
posix = shared_memory.SharedMemory("rlax-probe", create=True, size=16)
posix.buf[:4] = b"kept"
libc.sem_open.restype = ctypes.c_void_p
assert libc.sem_open(b"/rlax-probe", os.O_CREAT, 0o600, 3)
libc.mq_open.restype = ctypes.c_int
print("mq_open", libc.mq_open(b"/rlax-probe", os.O_CREAT | os.O_RDWR, 0o600, None))
print("planted", shm >= 0, msq >= 0, sem >= 0)
"""
IPC_LOOK = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print("sysv", libc.shmget(0x5EED, 0, 0), libc.msgget(0x5EED, 0), libc.semget(0x5EED, 0, 0))
print("listed", [len(open(f"/proc/sysvipc/{k}").read().splitlines()) - 1
                 for k in ("shm", "msg", "sem")])
print("dev/shm", os.listdir("/dev/shm"))
libc.sem_open.restype = ctypes.c_void_p
print("sem_open", libc.sem_open(b"/rlax-probe", 0))
print("mq_open", libc.mq_open(b"/rlax-probe", os.O_RDWR))
"""


def test_no_ipc_object_outlives_the_run():
    pool = Pool(Limits(), size=1)  # one worker, so the second run goes where the first went
    try:
        planted = pool.execute(IPC_PLANT, "", Limits())
        assert planted.status == "ok", planted.stderr
        # A POSIX message queue cannot even be made (RLIMIT_MSGQUEUE 0), so none persists.
        assert planted.stdout == "mq_open -1\nplanted True True True\n"
        (worker,) = pool.idle_workers()
        looked = pool.execute(IPC_LOOK, "", Limits())
        assert looked.stdout == (
            "sysv -1 -1 -1\nlisted [0, 0, 0]\ndev/shm []\nsem_open None\nmq_open -1\n"
        ), looked.stderr
        assert pool.idle_workers() == [worker]  # cleaned, and kept
    finally:
        pool.close()
