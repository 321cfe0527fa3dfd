"""A project-local Airflow: `airflow standalone` on SQLite with the LocalExecutor.

    rlax airflow                 # `make airflow`: serve the UI on 127.0.0.1 until Ctrl-C
    rlax demo --airflow          # `make airflow-demo`: the demo run as a DAG run

AIRFLOW_HOME is `./airflow_home` (gitignored) unless given; the DAGs are `dags/`. The
API server (UI, REST) binds 127.0.0.1 only (the scheduler's and triggerer's log servers,
which serve task log files to JWT-signed requests, bind every interface: standalone has no
setting for their host); the admin password is generated once into
`AIRFLOW_HOME/simple_auth_manager_passwords.json.generated` (the simple auth manager's
passwords file). `airflow standalone` starts the API server, scheduler, DAG processor,
triggerer and LocalExecutor workers as its children and leaves them running if only
the parent is stopped, so it is started in a session of its own and stopped as a whole
process group.

Only the standard library at module level: the CLI imports this lazily, and the driver
talks to Airflow over its REST API with the project's one client (`LocalAirflow` is an
`airflow_rest.AirflowAPI`), never by importing Airflow.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.net import free_port
from pipeline.ops import PROJECT_ROOT, processes
from pipeline.ops.airflow_rest import AirflowAPI, AirflowError
from pipeline.ops.airflow_settings import ADMIN, airflow_settings

DEFAULT_HOME = PROJECT_ROOT / "airflow_home"
DAGS_FOLDER = Path(airflow_settings("local")["AIRFLOW__CORE__DAGS_FOLDER"])
RL_DAG_ID = "rlax_rl_training"
PASSWORDS_FILE = "simple_auth_manager_passwords.json.generated"


def ensure_password(home: Path, user: str = ADMIN) -> str:
    """The user's password in the simple auth manager's passwords file (created if needed:
    the auth manager keeps passwords it finds and only generates missing ones)."""
    path = home / PASSWORDS_FILE
    passwords: dict[str, str] = {}
    if path.is_file():
        try:
            passwords = json.loads(path.read_text() or "{}")
        except json.JSONDecodeError:
            passwords = {}
    if user not in passwords:
        passwords[user] = secrets.token_urlsafe(12)
        home.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(passwords) + "\n")
        path.chmod(0o600)
    return passwords[user]


def _secret(home: Path, name: str) -> str:
    """A random secret made once per AIRFLOW_HOME (all components must agree on it)."""
    path = home / name
    if not path.is_file():
        home.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(64))
        path.chmod(0o600)
    return path.read_text().strip()


def airflow_env(
    home: Path, port: int, *, parallelism: int = 8, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment of a local `airflow standalone` (LocalExecutor, SQLite, 127.0.0.1)."""
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ)
    env.update(airflow_settings("local"))
    env.update(
        {
            # Signs the API's JWTs, and the requests to the components' log servers.
            "AIRFLOW__API_AUTH__JWT_SECRET": _secret(home, "jwt_secret"),
            "AIRFLOW__API__SECRET_KEY": _secret(home, "api_secret_key"),
            # The scheduler's and triggerer's log servers bind all interfaces on fixed
            # ports (8793/8794) that a second local Airflow would collide with: free ones.
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW_HOME": str(home),
            "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
            # One worker process per slot (~60 MB each): the default 32 costs ~1.8 GB.
            "AIRFLOW__CORE__PARALLELISM": str(parallelism),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / PASSWORDS_FILE),
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
            # Task processes reach the API server here; it defaults to port 8080.
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": str(free_port()),
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


class LocalAirflow(AirflowAPI):
    """`airflow standalone` in the background, driven over the REST API as any deployed
    Airflow is (the `AirflowAPI` calls), started and stopped here."""

    def __init__(
        self,
        home: Path = DEFAULT_HOME,
        port: int = 0,  # 0: a free one
        parallelism: int = 8,
        env_extra: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"http://127.0.0.1:{port}", ADMIN, "")
        self.home, self.port, self.parallelism = Path(home), port, parallelism
        self.env_extra = dict(env_extra or {})
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.home / "standalone.log"

    @property
    def password_file(self) -> Path:
        return self.home / PASSWORDS_FILE

    # ------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 300.0) -> LocalAirflow:
        self.home = Path(self.home).resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        # The metadata database, the secrets and the task logs: this user's alone.
        self.home.chmod(0o700)
        self.port = self.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = ensure_password(self.home)
        env = airflow_env(self.home, self.port, parallelism=self.parallelism, extra=self.env_extra)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        try:
            # Its own process group, stopped as a whole; the watchdog stops that group if
            # this process dies (standalone's own children would outlive it).
            self.proc = processes.spawn(
                [str(Path(sys.executable).parent / "airflow"), "standalone"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=PROJECT_ROOT,
                watchdog=True,
                umask=0o077,  # airflow.db and the logs it creates: 0600 / 0700
            )
        finally:
            log.close()
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float) -> None:
        """Until the API server answers and the scheduler and DAG processor are healthy."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AirflowError(
                    f"airflow standalone exited with code {self.proc.returncode}; "
                    f"log tail:\n{self.log_tail()}"
                )
            try:
                last = self.health(retry=False)
                if all(
                    (last.get(part) or {}).get("status") == "healthy"
                    for part in ("metadatabase", "scheduler", "dag_processor")
                ):
                    return
            except Exception:  # noqa: BLE001 - not up yet: the client's errors vary by stage
                pass
            time.sleep(1.0)
        raise AirflowError(
            f"Airflow not healthy after {timeout:.0f}s (last health: {last}); "
            f"log tail:\n{self.log_tail()}"
        )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole process group (scheduler, workers, API server...), then SIGKILL."""
        if self.proc is None:
            return
        processes.stop_group(self.proc.pid, timeout, reap=self.proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> LocalAirflow:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_alive(self) -> None:
        """A run is not waited for after `airflow standalone` died."""
        if self.proc is not None and self.proc.poll() is not None:
            raise AirflowError(f"airflow standalone died; log tail:\n{self.log_tail()}")


# ------------------------------------------------------------------ progress


def plain(answer: Any) -> dict[str, Any]:
    """A client answer (a model) as the REST API's JSON: states as strings, dates as ISO
    text. Dicts pass through."""
    return answer if isinstance(answer, dict) else json.loads(answer.to_json())


def task_label(ti: Mapping[str, Any]) -> str:
    label = ti["task_id"]
    if ti.get("map_index", -1) is not None and ti.get("map_index", -1) >= 0:
        label += f"[{ti.get('rendered_map_index') or ti['map_index']}]"
    return label


class ProgressPrinter:
    """Prints task state changes of a DAG run as they happen, and the progress the roles
    record in the run's metrics streams (SFT step, trainer step)."""

    def __init__(
        self,
        out=None,
        run_url: str | None = None,
        steps: int | None = None,
        sft_steps: int | None = None,
    ) -> None:
        self.out = out or sys.stdout
        self.states: dict[str, tuple[str | None, int]] = {}
        self.run_url = run_url
        # metrics stream -> (label, total steps or None, the record's value to show)
        self.streams = {
            "sft": ("SFT step", sft_steps, "loss"),
            "train": ("trainer step", steps, "reward_mean"),
        }
        self.last: dict[str, int] = {}
        self.t0 = time.monotonic()

    def _print(self, text: str) -> None:
        print(f"  [{time.monotonic() - self.t0:5.0f}s] {text}", file=self.out, flush=True)

    def __call__(self, run: Any, tis: list[Any]) -> None:
        tis = [plain(ti) for ti in tis]
        for ti in sorted(tis, key=lambda t: (t.get("start_date") or "~", task_label(t))):
            key = f"{ti['task_id']}/{ti.get('map_index', -1)}"
            state = (ti.get("state"), int(ti.get("try_number") or 0))
            if self.states.get(key) != state:
                self.states[key] = state
                tries = f" (try {state[1]})" if state[1] > 1 else ""
                self._print(f"{task_label(ti):<24} {state[0] or 'waiting'}{tries}")
        self._metrics_progress()

    def _metrics_progress(self) -> None:
        if not self.run_url:
            return
        try:
            from pipeline.storage import open_store

            store = open_store(self.run_url)
            latest = {s: store.list(f"metrics/{s}/") for s in self.streams}
        except Exception:  # noqa: BLE001 - progress is best effort; the run may not exist yet
            return
        for stream, keys in latest.items():
            if not keys:
                continue
            step = int(keys[-1].rsplit("/", 1)[-1].split(".")[0])
            if step != self.last.get(stream):
                self.last[stream] = step
                label, total, name = self.streams[stream]
                try:
                    value = f"  {name} {json.loads(store.read(keys[-1]))[name]:.4f}"
                except Exception:  # noqa: BLE001 - best effort, as above
                    value = ""
                self._print(f"{label} {step}" + (f"/{total}" if total else "") + value)


# ------------------------------------------------------------------ commands


def serve(home: Path = DEFAULT_HOME, port: int = 8080, parallelism: int = 8) -> int:
    """`make airflow`: run Airflow in the foreground until Ctrl-C, then stop it all."""
    af = LocalAirflow(home=home, port=port or free_port(), parallelism=parallelism)
    print(f"starting Airflow (AIRFLOW_HOME={Path(home).resolve()}); log: {af.log_path}")
    try:
        af.start()
        # The password on the user's own terminal (as `airflow standalone` prints it):
        # a first-time user copies it from here instead of looking for the file.
        print(
            f"\nAirflow UI: {af.url}\nuser: {ADMIN}  password: {af.password}  "
            f"(kept in {af.password_file})\n"
            f"Trigger rlax_rl_training (DAGs -> rlax_rl_training -> Trigger); each run's "
            f"report is its Report tab.\nDAGs: {DAGS_FOLDER}\nCtrl-C stops it.",
            flush=True,
        )
        while af.proc is not None and af.proc.poll() is None:
            time.sleep(1.0)
        print(f"airflow standalone exited; log tail:\n{af.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping Airflow ...", flush=True)
        af.stop()


def run_dag(
    conf: Mapping[str, Any],
    *,
    dag_id: str = RL_DAG_ID,
    home: Path = DEFAULT_HOME,
    port: int = 0,
    parallelism: int = 8,
    timeout: float = 6 * 3600,
    run_url: str | None = None,
    steps: int | None = None,
    sft_steps: int | None = None,
) -> tuple[str, str]:
    """Start Airflow, trigger `dag_id` with `conf`, follow it, stop Airflow.

    Returns (final state, dag run id)."""
    af = LocalAirflow(home=home, port=port, parallelism=parallelism)
    print(f"starting Airflow in the background (AIRFLOW_HOME={Path(home).resolve()}) ...")
    t0 = time.monotonic()
    try:
        af.start()
        print(f"Airflow up in {time.monotonic() - t0:.0f}s: {af.url} (log: {af.log_path})")
        af.wait_for_dag(dag_id)
        run_id = af.trigger(dag_id, conf)
        print(f"triggered {dag_id} run {run_id} with conf {json.dumps(dict(conf))}")
        state = af.wait_for_run(
            dag_id,
            run_id,
            timeout,
            ProgressPrinter(run_url=run_url, steps=steps, sft_steps=sft_steps),
        )
        if state != "success":
            for ti in map(plain, af.task_instances(dag_id, run_id)):
                if ti.get("state") == "failed":
                    log = af.task_log(dag_id, run_id, ti["task_id"], ti["try_number"])
                    print(f"--- {task_label(ti)} (try {ti['try_number']}) log tail ---")
                    print(log[-3000:])
        return state, run_id
    finally:
        print("stopping Airflow ...", flush=True)
        af.stop()


def demo_via_airflow(
    cfg: Any,
    *,
    config_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    run: str | None = None,
    workers: int | None = None,
    eval_every: int = 5,
    home: Path = DEFAULT_HOME,
    port: int = 0,
) -> int:
    """`rlax demo --airflow`: the demo run as a run of the rlax_rl_training DAG.

    `cfg` is the already validated RunConfig (so a bad override fails before Airflow
    starts); the DAG rebuilds the same config from the conf (config file + overrides)."""
    root = _absolute(cfg.storage.root)
    url = _absolute(run) if run else f"{root}/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    # The DAG's Params take a run name under a storage root and a config file inside the
    # project (docs/security.md), so a --run URL is split into its parent and its name.
    root, _, name = url.rpartition("/")
    config = Path(config_path).resolve()
    if not config.is_relative_to(PROJECT_ROOT):
        raise AirflowError(
            f"config {config} is outside the project; the DAG reads config files relative "
            f"to {PROJECT_ROOT}: copy it under configs/ (or run `rlax demo` without --airflow)"
        )
    conf: dict[str, Any] = {
        "run_id": name,
        "storage_root": root,
        "config_file": str(config.relative_to(PROJECT_ROOT)),
        "eval_every": eval_every,
        "overrides": list(overrides),
    }
    if workers:
        conf["workers"] = workers
    t0 = time.monotonic()
    state, run_id = run_dag(
        conf,
        home=home,
        port=port,
        parallelism=max(8, cfg.workers + 2),  # trainer + every worker at once, + headroom
        run_url=url,
        steps=cfg.trainer.steps,
        sft_steps=cfg.sft.steps,
    )
    took = f"{time.monotonic() - t0:.0f}s"
    if state != "success":
        print(f"DAG run {run_id} {state} after {took}; task logs under {Path(home) / 'logs'}")
        return 1
    from pipeline.storage import local_path

    report = f"{url}/report/report.md"
    if (path := local_path(report)) is not None and path.is_file():
        print("\n" + path.read_text())
    print(f"\ndone in {took} (DAG run {run_id}); report: {report}")
    return 0


def _absolute(root: str) -> str:
    """Local paths absolute (relative to the working directory, as for `rlax demo`)."""
    from pipeline.storage import local_path  # lazily, as everywhere in this module

    path = local_path(root)
    return root.rstrip("/") if path is None else str(path.expanduser().resolve())
