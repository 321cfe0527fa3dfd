"""`rlax stack up | status | down`: the production shape, run for real on one machine.

    make stack                  # = rlax stack up
    rlax stack status           # each service: pid, port, healthy or not
    rlax stack restart postgres # stop and start one service (the others keep running)
    rlax stack preempt airflow-worker-1   # SIGKILL a service and all it started
    rlax stack down             # stop everything `up` started, and nothing else

Services, in start order (`SERVICES`): PostgreSQL as Airflow's metadata database (a
cluster of its own: `initdb` + `postgres`), Redis as the Celery broker, fake-gcs-server as
the bucket (`gs://rlax-runs`, filesystem backend), the sandbox service, a dask.distributed
scheduler with two workers (Beam's DaskRunner), with `--mlflow` an MLflow tracking server
(SQLite, artifacts on disk: `tracking.backends: [mlflow]`), and Airflow 3: api-server, scheduler,
dag-processor and two Celery workers. Worker 1 serves the `trainer` and default queues,
worker 2 the `rollout` and default queues (dags/stage.py routes the tasks), so the trainer
and the rollout workers always land on different Celery workers.

Everything binds 127.0.0.1 on free ports chosen by the first `up` and lives under
`./stack/` (git-ignored): one data directory and one log per service, the generated
secrets (`secrets.json`, 0600) and the state file (`state.json`: ports, and each started
process's pid and kernel start time, so `down` signals only processes it started, by
process group, even after a reboot reused the pids). `up` is idempotent: it starts only
services that are not running, so after a crash or a preemption it is also the restart.

Only the standard library and light pipeline modules at module level (the CLI imports
this lazily); the database driver is imported when a database is created.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.net import free_port
from pipeline.ops import PROJECT_ROOT
from pipeline.ops.airflow_local import PASSWORDS_FILE
from pipeline.ops.airflow_settings import ADMIN, airflow_settings
from pipeline.ops.emulators import (
    create_bucket,
    emulator_env,
    fake_gcs_binary,
    fake_gcs_command,
    fake_gcs_ready,
)
from pipeline.ops.processes import kill_tree, start_time, stop_group
from pipeline.queues import DEFAULT_QUEUE, NODE_ENV, ROLLOUT_QUEUE, TRAINER_QUEUE

DEFAULT_DIR = PROJECT_ROOT / "stack"
STATE_FILE = "state.json"
SECRETS_FILE = "secrets.json"
BUCKET = "rlax-runs"
HEARTBEAT_ENV = "RLAX_STACK_HEARTBEAT_TIMEOUT_S"
HEARTBEAT_SETTING = "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"
PG_BIN = Path(os.environ.get("RLAX_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_USER = "airflow"  # the cluster's superuser and Airflow's database
SECRET_NAMES = (
    "postgres_password",
    "redis_password",
    "jwt_secret",
    "api_secret_key",
    "admin_password",
    "sandbox_token",
)


class StackError(RuntimeError):
    """A service could not be installed, started or found healthy."""


# ------------------------------------------------------------------ the stack


@dataclass
class Stack:
    """The stack under `root`: its ports, secrets and started processes."""

    root: Path = DEFAULT_DIR
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, dict[str, Any]] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    log: Callable[[str], None] = print

    # -------------------------------------------------------------- files
    @classmethod
    def load(cls, root: Path = DEFAULT_DIR, log: Callable[[str], None] = print) -> Stack:
        root = Path(root).resolve()
        stack = cls(root=root, log=log)
        if (root / STATE_FILE).is_file():
            state = json.loads((root / STATE_FILE).read_text())
            stack.ports, stack.procs = state["ports"], state["procs"]
        if (root / SECRETS_FILE).is_file():
            stack.secrets = json.loads((root / SECRETS_FILE).read_text())
        return stack

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps({"ports": self.ports, "procs": self.procs}, indent=2))
        tmp.replace(self.root / STATE_FILE)

    def _ensure_secrets(self) -> None:
        missing = [n for n in SECRET_NAMES if n not in self.secrets]
        if not missing:
            return
        for name in missing:
            self.secrets[name] = secrets.token_urlsafe(32)
        path = self.root / SECRETS_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.secrets, f, indent=2)

    def port(self, name: str) -> int:
        if name not in self.ports:
            self.ports[name] = free_port()
        return self.ports[name]

    def dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def log_path(self, name: str) -> Path:
        return self.dir("logs") / f"{name}.log"

    # -------------------------------------------------------------- addresses
    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port('airflow-api-server')}"

    @property
    def gcs_url(self) -> str:
        return f"http://127.0.0.1:{self.port('gcs')}"

    @property
    def sandbox_url(self) -> str:
        return f"http://127.0.0.1:{self.port('sandbox')}"

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self.port('mlflow')}"

    @property
    def dask_address(self) -> str:
        return f"tcp://127.0.0.1:{self.port('dask-scheduler')}"

    def database_url(self, driver: str = "postgresql+psycopg2") -> str:
        return (
            f"{driver}://{PG_USER}:{self.secrets['postgres_password']}"
            f"@127.0.0.1:{self.port('postgres')}/airflow"
        )

    @property
    def broker_url(self) -> str:
        return f"redis://:{self.secrets['redis_password']}@127.0.0.1:{self.port('redis')}/0"

    def gcs_env(self) -> dict[str, str]:
        return emulator_env(self.gcs_url)

    def airflow_env(self) -> dict[str, str]:
        """The environment of every Airflow component (and so of every task and job)."""
        home = self.dir("airflow")
        passwords = home / PASSWORDS_FILE
        if not passwords.is_file():  # the simple auth manager keeps a password it finds
            passwords.write_text(json.dumps({ADMIN: self.secrets["admin_password"]}) + "\n")
            passwords.chmod(0o600)
        env = dict(os.environ)
        env.update(self.gcs_env())
        env.update(airflow_settings("stack"))
        env.update(
            {
                "AIRFLOW_HOME": str(home),
                "PATH": str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
                "PYTHONUNBUFFERED": "1",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.database_url(),
                "AIRFLOW__CELERY__BROKER_URL": self.broker_url,
                # Task results in Redis, not in the metadata database: Celery's database
                # backend retries a failed query three times without waiting, so a
                # PostgreSQL restart of a few seconds crashed the scheduler (measured).
                "AIRFLOW__CELERY__RESULT_BACKEND": self.broker_url.removesuffix("/0") + "/1",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
                "AIRFLOW__API_AUTH__JWT_SECRET": self.secrets["jwt_secret"],
                "AIRFLOW__API__SECRET_KEY": self.secrets["api_secret_key"],
                "AIRFLOW__API__PORT": str(self.port("airflow-api-server")),
                "AIRFLOW__API__BASE_URL": self.api_url,
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.api_url}/execution/",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": str(
                    self.port("scheduler-health")
                ),
                "RLAX_SANDBOX_URL": self.sandbox_url if "sandbox" in self.procs else "",
                "RLAX_SANDBOX_TOKEN": self.secrets["sandbox_token"],
            }
        )
        if HEARTBEAT_ENV in os.environ:  # a shorter wait for preemption tests
            env[HEARTBEAT_SETTING] = os.environ[HEARTBEAT_ENV]
        return env

    # -------------------------------------------------------------- lifecycle
    def running(self, name: str) -> bool:
        info = self.procs.get(name)
        return bool(info) and start_time(info["pid"]) == info["start"]

    def start(self, svc: Service, timeout: float = 180.0) -> float:
        """Start one service and wait until it is healthy; seconds it took."""
        return self.start_all([svc], timeout)[svc.name]

    def start_all(self, services: list[Service], timeout: float = 180.0) -> dict[str, float]:
        """Start `services` at once and wait until each is healthy (they must not need each
        other); seconds each took."""
        t0 = time.monotonic()
        started = {svc.name: (svc, *self._launch(svc)) for svc in services}
        took: dict[str, float] = {}
        deadline = time.monotonic() + timeout
        while len(took) < len(started):
            for name, (svc, proc, log, offset) in started.items():
                if name in took:
                    continue
                if proc.poll() is not None:
                    raise StackError(
                        f"{name} exited with code {proc.returncode}; log {log}:\n"
                        + _tail(log, offset)
                    )
                with contextlib.suppress(OSError, StackError, ValueError):
                    if svc.ready(self, _tail(log, offset, None)):
                        if svc.after is not None:
                            svc.after(self)
                        took[name] = time.monotonic() - t0
            if time.monotonic() > deadline:
                late = sorted(set(started) - set(took))
                raise StackError(
                    f"{', '.join(late)} not healthy after {timeout:.0f}s (logs in {self.root / 'logs'})"
                )
            time.sleep(0.5)
        return took

    def _launch(self, svc: Service) -> tuple[subprocess.Popen, Path, int]:
        if svc.setup is not None:
            svc.setup(self)
        log = self.log_path(svc.name)
        offset = log.stat().st_size if log.exists() else 0
        user = svc.run_as(self) if svc.run_as else None
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                svc.command(self),
                env=svc.env(self) if svc.env else {**os.environ, **self.gcs_env()},
                cwd=PROJECT_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a group of its own: `down` stops it as a whole
                user=user,
                group=pwd.getpwnam(user).pw_gid if user else None,
                extra_groups=[] if user else None,
                umask=0o077,
            )
        self.procs[svc.name] = {
            "pid": proc.pid,
            "start": start_time(proc.pid),
            "log": str(log),
            "log_offset": offset,  # where this start's output begins (readiness reads on)
        }
        self.save()
        return proc, log, offset

    def stop(self, name: str, grace_s: float = 30.0) -> None:
        """Stop a service this stack started (its process group), if it still runs."""
        info = self.procs.get(name)
        if info and self.running(name):
            svc = SERVICES_BY_NAME.get(name)
            stop_group(info["pid"], grace_s, first=svc.stop_signal if svc else signal.SIGTERM)
        self.procs.pop(name, None)
        self.save()

    def preempt(self, name: str) -> list[int]:
        """SIGKILL a service and every process it started (a lost node); the pids killed."""
        if not self.running(name):
            raise StackError(f"{name} is not running")
        killed = kill_tree(self.procs[name]["pid"])
        self.procs.pop(name)
        self.save()
        return killed


def _tail(path: Path, offset: int = 0, chars: int | None = 3000) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return text if chars is None else text[-chars:]


# ------------------------------------------------------------------ health checks


def _http_ok(url: str, timeout: float = 5.0) -> Any:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            body = resp.read()
            return json.loads(body) if body[:1] in (b"{", b"[") else True
    except urllib.error.HTTPError:
        return None


def _tcp_ok(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        return True


def _redis_ok(stack: Stack, _log: str) -> bool:
    with socket.create_connection(("127.0.0.1", stack.port("redis")), timeout=2) as s:
        pw = stack.secrets["redis_password"]
        s.sendall(f"AUTH {pw}\r\nPING\r\n".encode())
        reply = b""
        while b"PONG" not in reply and len(reply) < 200:
            chunk = s.recv(200)
            if not chunk:
                break
            reply += chunk
        return b"+PONG" in reply


def _airflow_health(stack: Stack, part: str) -> bool:
    health = _http_ok(f"{stack.api_url}/api/v2/monitor/health")
    return bool(health) and (health.get(part) or {}).get("status") == "healthy"


# ------------------------------------------------------------------ services


@dataclass(frozen=True)
class Service:
    """How to start one service and tell that it is healthy."""

    name: str
    command: Callable[[Stack], list[str]]
    ready: Callable[[Stack, str], bool]  # (stack, its log since this start)
    env: Callable[[Stack], dict[str, str]] | None = None
    setup: Callable[[Stack], None] | None = None  # before each start (idempotent)
    after: Callable[[Stack], None] | None = None  # once healthy (idempotent)
    run_as: Callable[[Stack], str | None] | None = None  # a system user, when root
    stop_signal: int = signal.SIGTERM
    available: Callable[[], str | None] = lambda: None  # why it cannot run here, or None


def _postgres_user(_stack: Stack) -> str | None:
    """PostgreSQL refuses to run as root: as root, run it as `postgres` (or `nobody`)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise StackError("running as root and no `postgres` or `nobody` user to run PostgreSQL as")


def _postgres_setup(stack: Stack) -> None:
    """A cluster of our own (initdb once): superuser `airflow`, scram passwords, TCP only."""
    if not (PG_BIN / "initdb").is_file():
        raise StackError(
            f"PostgreSQL binaries not found in {PG_BIN}; install postgresql-15 (Debian) or "
            "set RLAX_PG_BIN to the directory holding initdb and postgres"
        )
    base = stack.dir("postgres")
    data = base / "data"
    user = _postgres_user(stack)
    if user is not None:
        # The service user must reach its data directory: ./stack is traversable only.
        stack.root.chmod(0o711)
        info = pwd.getpwnam(user)
        os.chown(base, info.pw_uid, info.pw_gid)
    base.chmod(0o700)
    if (data / "PG_VERSION").is_file():
        return
    pwfile = base / "pwfile"
    pwfile.write_text(stack.secrets["postgres_password"] + "\n")
    if user is not None:
        os.chown(pwfile, info.pw_uid, info.pw_gid)
    try:
        done = subprocess.run(
            [str(PG_BIN / "initdb"), "-D", str(data), "-U", PG_USER, f"--pwfile={pwfile}"]
            + ["--auth=scram-sha-256", "--encoding=UTF8", "--locale=C"],
            capture_output=True,
            text=True,
            user=user,
            group=info.pw_gid if user else None,
            extra_groups=[] if user else None,
            cwd=base,
        )
    finally:
        pwfile.unlink()
    if done.returncode != 0:
        raise StackError(f"initdb failed:\n{done.stdout}\n{done.stderr}")


def _postgres_command(stack: Stack) -> list[str]:
    return [
        str(PG_BIN / "postgres"),
        "-D",
        str(stack.root / "postgres" / "data"),
        "-c",
        "listen_addresses=127.0.0.1",
        "-c",
        f"port={stack.port('postgres')}",
        "-c",
        "unix_socket_directories=",  # TCP on 127.0.0.1 only
        "-c",
        "max_connections=200",
    ]


def _postgres_ready(stack: Stack, _log: str) -> bool:
    done = subprocess.run(
        [str(PG_BIN / "pg_isready"), "-h", "127.0.0.1", "-p", str(stack.port("postgres"))],
        capture_output=True,
    )
    return done.returncode == 0


def _postgres_create_db(stack: Stack) -> None:
    import psycopg2

    conn = psycopg2.connect(
        host="127.0.0.1",
        port=stack.port("postgres"),
        user=PG_USER,
        password=stack.secrets["postgres_password"],
        dbname="postgres",
    )
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = 'airflow'")
            if cur.fetchone() is None:
                cur.execute("CREATE DATABASE airflow")
    finally:
        conn.close()


def ensure_redis() -> None:
    """Install redis-server from Debian when it is missing and we are root."""
    if shutil.which("redis-server"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise StackError(
            "redis-server is not installed; install it (Debian: `sudo apt-get install -y "
            "redis-server`) and run `rlax stack up` again"
        )
    print("installing redis-server (apt-get) ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "redis-server"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise StackError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")


def _redis_setup(stack: Stack) -> None:
    ensure_redis()
    conf = stack.dir("redis") / "redis.conf"
    # The password in a 0600 file, not on the command line (which `ps` shows).
    conf.write_text(
        f"bind 127.0.0.1\nport {stack.port('redis')}\nprotected-mode yes\n"
        f"requirepass {stack.secrets['redis_password']}\ndir {stack.dir('redis')}\n"
        'save ""\nappendonly no\ndaemonize no\n'
    )
    conf.chmod(0o600)


def _gcs_command(stack: Stack) -> list[str]:
    binary = fake_gcs_binary()
    if binary is None:
        raise StackError("fake-gcs-server not found: install the stack's Python environment")
    return fake_gcs_command(binary, stack.port("gcs"), root=stack.dir("gcs"))


def _sandbox_missing() -> str | None:
    from pipeline.sandbox.isolation import userns_forbidden

    return userns_forbidden()


def _rlax(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "rlax"), *args]


def _sandbox_env(stack: Stack) -> dict[str, str]:
    return {**os.environ, "RLAX_SANDBOX_TOKEN": stack.secrets["sandbox_token"]}


MLFLOW_ENV = "RLAX_STACK_MLFLOW"  # "1": `up` also starts the MLflow server (`up --mlflow`)


def _mlflow_wanted() -> str | None:
    if os.environ.get(MLFLOW_ENV) == "1":
        return None
    return f"off (`rlax stack up --mlflow` or {MLFLOW_ENV}=1 starts it)"


def _mlflow_command(stack: Stack) -> list[str]:
    """The tracking server of `tracking.backends: [mlflow]` (pipeline/tracking.py): runs
    and metrics in SQLite, artifacts (the reports) served from a local directory."""
    root = stack.dir("mlflow")
    return [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(stack.port("mlflow")),
        "--workers",
        "1",
    ]


def _mlflow_env(_stack: Stack) -> dict[str, str]:
    return {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}  # nothing leaves the machine


def _dask(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "dask"), *args]


# Dask's HTTP server (dashboard, metrics, health) runs even with --no-dashboard, then on
# every interface: on loopback instead, on a free port.
LOOPBACK_HTTP = ["--dashboard-address", "127.0.0.1:0"]


def _dask_worker(i: int) -> Service:
    return Service(
        f"dask-worker-{i}",
        lambda s: (
            # One process with one thread each: two workers are two processes.
            _dask("worker", s.dask_address, "--host", "127.0.0.1", "--nthreads", "1")
            + [*LOOPBACK_HTTP, "--name", f"worker-{i}", "--local-directory", str(s.dir("dask"))]
        ),
        lambda s, log: "Registered to" in log,
    )


def _airflow(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "airflow"), *args]


def _airflow_migrate(stack: Stack) -> None:
    """`airflow db migrate` once per database (idempotent, but ~30 s)."""
    marker = stack.dir("airflow") / ".migrated"
    if marker.is_file():
        return
    stack.log("  airflow db migrate ...")
    done = subprocess.run(
        _airflow("db", "migrate"), env=stack.airflow_env(), capture_output=True, text=True
    )
    if done.returncode != 0:
        raise StackError(f"airflow db migrate failed:\n{(done.stdout + done.stderr)[-3000:]}")
    marker.touch()


def _celery_worker(i: int, queues: str, concurrency: Callable[[], int]) -> Service:
    return Service(
        f"airflow-worker-{i}",
        lambda s: (
            _airflow("celery", "worker", "--celery-hostname", f"worker{i}@%h", "--queues", queues)
            # Task logs are files in the shared AIRFLOW_HOME, read by the api-server from there:
            # no log server (it would listen on every interface).
            + ["--concurrency", str(concurrency()), "--skip-serve-logs"]
        ),
        lambda s, log: " ready." in log,
        env=lambda s: {**s.airflow_env(), NODE_ENV: f"worker{i}"},
    )


def _rollout_slots(default: int = 3) -> int:
    """Worker 2's concurrency: the run's rollout workers at once, and a default-queue task."""
    try:
        return max(1, int(os.environ.get("RLAX_STACK_ROLLOUT_SLOTS", default)))
    except ValueError:
        return default


# Start order: a stage starts once the one before is healthy; the services of a stage
# start at once.
STAGES: tuple[tuple[Service, ...], ...] = (
    (
        Service(
            "postgres",
            _postgres_command,
            _postgres_ready,
            setup=_postgres_setup,
            after=_postgres_create_db,
            run_as=_postgres_user,
            stop_signal=signal.SIGINT,  # PostgreSQL's "fast" shutdown
        ),
    ),
    (
        Service(
            "redis",
            lambda s: ["redis-server", str(s.root / "redis" / "redis.conf")],
            _redis_ok,
            setup=_redis_setup,
        ),
        Service(
            "gcs",
            _gcs_command,
            lambda s, _: fake_gcs_ready(s.gcs_url),
            after=lambda s: create_bucket(s.gcs_url, BUCKET),
        ),  # fmt: skip
        Service(
            "sandbox",
            lambda s: (
                _rlax("sandbox", "serve", "--host", "127.0.0.1", "--port", str(s.port("sandbox")))
                + ["--token-env", "RLAX_SANDBOX_TOKEN", "--concurrency", "2"]
            ),
            lambda s, _: bool(_http_ok(f"{s.sandbox_url}/health")),
            env=_sandbox_env,
            available=_sandbox_missing,
        ),
        Service(
            "dask-scheduler",
            lambda s: (
                _dask("scheduler", "--host", "127.0.0.1", "--port", str(s.port("dask-scheduler")))
                + LOOPBACK_HTTP
            ),
            lambda s, _: _tcp_ok(s.port("dask-scheduler")),
        ),
        _dask_worker(1),
        _dask_worker(2),
        Service(
            "mlflow",
            _mlflow_command,
            lambda s, _: bool(_http_ok(f"{s.mlflow_url}/health")),
            env=_mlflow_env,
            available=_mlflow_wanted,
        ),
    ),
    (
        Service(
            "airflow-api-server",
            lambda s: _airflow(
                "api-server",
                "--host",
                "127.0.0.1",
                "--port",
                str(s.port("airflow-api-server")),
                "--workers",
                "1",
            ),
            lambda s, _: _airflow_health(s, "metadatabase"),
            env=Stack.airflow_env,
            setup=_airflow_migrate,
        ),  # fmt: skip
    ),
    (
        Service(
            "airflow-scheduler",
            lambda s: _airflow("scheduler"),
            lambda s, _: _airflow_health(s, "scheduler"),
            env=Stack.airflow_env,
        ),
        Service(
            "airflow-dag-processor",
            lambda s: _airflow("dag-processor"),
            lambda s, _: _airflow_health(s, "dag_processor"),
            env=Stack.airflow_env,
        ),
        _celery_worker(1, f"{TRAINER_QUEUE},{DEFAULT_QUEUE}", lambda: 2),
        _celery_worker(2, f"{ROLLOUT_QUEUE},{DEFAULT_QUEUE}", _rollout_slots),
    ),
)
SERVICES: tuple[Service, ...] = tuple(svc for stage in STAGES for svc in stage)
SERVICES_BY_NAME = {s.name: s for s in SERVICES}


# ------------------------------------------------------------------ commands


def up(root: Path = DEFAULT_DIR, log: Callable[[str], None] = print) -> Stack:
    """Start every service that is not running (all of them the first time)."""
    stack = Stack.load(root, log)
    stack.root.mkdir(parents=True, exist_ok=True)
    stack.root.chmod(0o700)
    stack._ensure_secrets()
    t0 = time.monotonic()
    for stage in STAGES:
        todo = []
        for svc in stage:
            why = svc.available()
            if why is not None:
                log(f"  {svc.name:<22} skipped: {why}")
            elif not stack.running(svc.name):
                todo.append(svc)
        for name, took in stack.start_all(todo).items():
            log(f"  {name:<22} up in {took:5.1f}s (pid {stack.procs[name]['pid']})")
    log(f"stack up in {time.monotonic() - t0:.1f}s under {stack.root}")
    log(f"  Airflow UI/API {stack.api_url} (user {ADMIN}, password in {stack.root / SECRETS_FILE})")
    log(f"  bucket gs://{BUCKET} at {stack.gcs_url}; Dask {stack.dask_address}")
    if stack.running("mlflow"):
        log(f"  MLflow {stack.mlflow_url} (tracking.backends=[mlflow] tracking.mlflow_uri=...)")
    return stack


def status(root: Path = DEFAULT_DIR) -> list[dict[str, Any]]:
    """One row per service: running (the very process `up` started) and healthy."""
    stack = Stack.load(root)
    rows = []
    for svc in SERVICES:
        running = stack.running(svc.name)
        healthy = False
        if running:
            log = stack.log_path(svc.name)
            offset = stack.procs[svc.name].get("log_offset", 0)
            with contextlib.suppress(OSError, StackError, ValueError):
                healthy = bool(svc.ready(stack, _tail(log, offset, None)))
        rows.append(
            {
                "service": svc.name,
                "pid": stack.procs.get(svc.name, {}).get("pid"),
                "port": stack.ports.get(svc.name),
                "running": running,
                "healthy": healthy,
            }
        )
    return rows


def down(root: Path = DEFAULT_DIR, log: Callable[[str], None] = print) -> None:
    """Stop what `up` started, in reverse order, each as a whole process group."""
    stack = Stack.load(root, log)
    for svc in reversed(SERVICES):
        if svc.name in stack.procs:
            was = stack.running(svc.name)
            stack.stop(svc.name)
            if was:
                log(f"  {svc.name:<22} stopped")


def restart(name: str, root: Path = DEFAULT_DIR, log: Callable[[str], None] = print) -> float:
    """Stop one service and start it again; seconds until it is healthy again."""
    if name not in SERVICES_BY_NAME:
        raise StackError(f"unknown service {name!r}; allowed: {', '.join(SERVICES_BY_NAME)}")
    stack = Stack.load(root, log)
    t0 = time.monotonic()
    stack.stop(name)
    stack.start(SERVICES_BY_NAME[name])
    return time.monotonic() - t0


def main(argv: list[str]) -> int:
    """`rlax stack up|status|down|restart NAME|preempt NAME`."""
    import argparse

    p = argparse.ArgumentParser(prog="rlax stack", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["up", "status", "down", "restart", "preempt"])
    p.add_argument("service", nargs="?", help="for restart/preempt: " + ", ".join(SERVICES_BY_NAME))
    p.add_argument("--dir", default=str(DEFAULT_DIR), help="the stack's directory (./stack)")
    p.add_argument(
        "--mlflow",
        action="store_true",
        help=f"up: also start an MLflow tracking server (or {MLFLOW_ENV}=1)",
    )
    args = p.parse_args(argv)
    if args.mlflow:
        os.environ[MLFLOW_ENV] = "1"
    root = Path(args.dir)
    try:
        if args.action == "up":
            up(root)
        elif args.action == "down":
            down(root)
        elif args.action == "status":
            rows = status(root)
            for r in rows:
                state = "healthy" if r["healthy"] else ("running" if r["running"] else "down")
                print(
                    f"{r['service']:<22} {state:<8} pid {r['pid'] or '-':<8} port {r['port'] or '-'}"
                )
            return 0 if all(r["healthy"] for r in rows if r["running"]) else 1
        elif args.service is None:
            p.error(f"{args.action} needs a service: {', '.join(SERVICES_BY_NAME)}")
        elif args.action == "restart":
            print(f"{args.service} healthy again after {restart(args.service, root):.1f}s")
        else:
            killed = Stack.load(root).preempt(args.service)
            print(f"SIGKILLed {args.service}: {len(killed)} processes; `rlax stack up` restarts it")
    except StackError as err:
        print(f"rlax stack: {err}", file=sys.stderr)
        return 1
    return 0
