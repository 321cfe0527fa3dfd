"""The one place that turns a role into a command line and starts it as a process.

`rlax`, the demo and the Airflow DAGs all start jobs through here, so a laptop run and
a cluster run differ only in where the very same command lands (a local process here;
a Kubernetes pod, a TPU VM or a Dataflow job at scale).

Supervision. Every child starts through `pipeline.ops.processes.spawn`: in its own
process group, stopped as a whole, tied to this process's life. In the foreground
(`run_supervised`, `rlax train` and the other role commands) SIGTERM, SIGINT and SIGHUP
to the parent are forwarded to the child's group.

Three ways to run a job, for three kinds of caller: `run_job` (the foreground of `rlax
train` and the other role commands), `stream` (an Airflow task: the job's output copied
into the task log, the job stopped when asked) and `Fleet` (the demo and chaos: named
jobs in the background, each with its log file, any failure stopping the rest).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pipeline.ops import PROJECT_ROOT
from pipeline.ops.processes import spawn, stop_group

# role -> python module with a `main(argv)` entry point taking `--run URL`
JOBS: dict[str, str] = {
    "data": "pipeline.data_job",
    "sft": "tpu_jobs.sft",
    "train": "tpu_jobs.trainer",
    "rollout": "tpu_jobs.rollout_worker",
    "eval": "tpu_jobs.evaluator",
    "pass-rates": "tpu_jobs.pass_rates",
    "orm": "tpu_jobs.orm",
    "report": "pipeline.report_job",
}
# Jobs that are not about one run (no `--run`): the Beam curation job and the HF tools.
CURATE_MODULE = "beam_jobs.curate"
HF_MODULE = "tpu_jobs.hf"


def job_command(role: str, run_url: str, extra: Sequence[str] = ()) -> list[str]:
    if role not in JOBS:
        raise ValueError(f"unknown job role {role!r}; allowed: {', '.join(JOBS)}")
    return [sys.executable, "-m", JOBS[role], "--run", run_url, *extra]


# JAX's persistent compilation cache, shared by every job of this machine: a worker or
# trainer restarted after preemption, the evaluator after the workers (the same sampler
# programs) and the next run of the same config load compiled programs instead of
# compiling them again. XLA keys entries by program, compiler version and flags, so a
# hit runs the very program a fresh compile would have built. RLAX_COMPILE_CACHE picks
# the directory ("off" disables it); JAX_COMPILATION_CACHE_DIR, if set, wins.
COMPILE_CACHE_ENV = "RLAX_COMPILE_CACHE"
DEFAULT_COMPILE_CACHE = Path.home() / ".cache" / "rlax" / "jax-compile"
# Cache programs that took at least this long to compile (JAX's default, 1 s, skips most
# of the sampler's and trainer's CPU programs, each 0.1-1 s, and there are dozens).
COMPILE_CACHE_MIN_SECONDS = "0.1"


def compile_cache_env(environ: dict[str, str]) -> dict[str, str]:
    """The JAX_* variables that turn on the persistent compilation cache for a job."""
    where = environ.get(COMPILE_CACHE_ENV, str(DEFAULT_COMPILE_CACHE))
    if where.lower() == "off" or "JAX_COMPILATION_CACHE_DIR" in environ:
        return {}
    return {
        "JAX_COMPILATION_CACHE_DIR": where,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": environ.get(
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", COMPILE_CACHE_MIN_SECONDS
        ),
    }


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(compile_cache_env(env))
    return env


def module_command(module: str, args: Sequence[str]) -> list[str]:
    """`python -m MODULE ARGS` for jobs without a role (curation, HF import)."""
    return [sys.executable, "-m", module, *args]


def curate_command(
    inputs: Iterable[str],
    output: str,
    *,
    eval_sets: Iterable[str] = (),
    pass_rates: Iterable[str] = (),
    options: Mapping[str, Any] | None = None,
    beam_args: Iterable[str] = (),
) -> list[str]:
    """`python -m beam_jobs.curate --input G ... --output DIR [--flag value ...]`.

    `options` maps CLI flags without dashes (`near_dup_threshold`) to values; None is
    left out (the job's default), True is a bare flag, False is left out.
    """

    def beam(url: str) -> str:  # Beam takes paths and gs:// URLs, not file:// URLs
        return url.removeprefix("file://")

    args: list[str] = []
    for pattern in inputs:
        args += ["--input", beam(pattern)]
    args += ["--output", beam(output)]
    for pattern in eval_sets:
        args += ["--eval-sets", beam(pattern)]
    for pattern in pass_rates:
        args += ["--pass-rates", beam(pattern)]
    for key, value in (options or {}).items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return module_command(CURATE_MODULE, [*args, *beam_args])


def hf_import_command(checkpoint: str, run_url: str, adapter: str | None = None) -> list[str]:
    """Import a Hugging Face checkpoint as the run's base model (`tpu_jobs.hf import`), and
    a PEFT adapter as a LoRA run's starting adapters when `adapter` names one."""
    extra = ["--adapter", adapter] if adapter else []
    return module_command(HF_MODULE, ["import", checkpoint, *extra, "--run", run_url])


def hf_model_overrides(checkpoint: str) -> list[str]:
    """The `model.*` overrides matching an HF checkpoint (`python -m tpu_jobs.hf config`,
    a child process: reading the checkpoint's config needs transformers)."""
    cmd = module_command(HF_MODULE, ["config", checkpoint])
    done = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), cwd=PROJECT_ROOT)
    if done.returncode != 0:
        raise ValueError(f"cannot read HF checkpoint {checkpoint!r}: {done.stderr.strip()[-2000:]}")
    return done.stdout.split()


# ----------------------------------------------------------------------- supervision

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_status(returncode: int) -> int:
    """A shell's exit status for a child's return code (128 + N when killed by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def run_supervised(cmd: Sequence[str], env: dict[str, str], grace_s: float = 60.0) -> int:
    """Run `cmd` in the foreground with inherited output, forwarding SIGTERM, SIGINT and
    SIGHUP to its process group; return its exit status."""
    proc = spawn(cmd, env=env)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def forward(sig: int, _frame: Any) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        return exit_status(proc.wait())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # we are leaving by an exception: take the job with us
            stop_group(proc.pid, grace_s, reap=proc)


def start(
    role: str,
    run_url: str,
    extra: Sequence[str] = (),
    *,
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start a job; its output goes to `log_path` (or is inherited when None); `env`: set
    in its environment on top of `job_env()` (chaos arms failpoints so)."""
    cmd = job_command(role, run_url, extra)
    out = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    try:
        return spawn(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env={**job_env(), **(env or {})},
        )
    finally:
        if out is not None:
            out.close()  # the child has its own descriptor


def run_job(role: str, run_url: str, extra: Sequence[str] = ()) -> int:
    """Run a job in the foreground (`rlax train`, ...) under `run_supervised`."""
    return run_supervised(job_command(role, run_url, extra), job_env())


# ------------------------------------------------------------ jobs of a task or stage


class JobFailed(RuntimeError):
    """A job's process exited with a non-zero code (a retry may succeed)."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class JobStopped(RuntimeError):
    """A job was stopped from outside (SIGTERM to its caller, or `stop_when` said so)."""


def failure_text(name: str, returncode: int) -> str:
    """`trainer was killed by SIGKILL` / `trainer exited with code 3`."""
    if returncode < 0:
        return f"{name} was killed by {signal.Signals(-returncode).name}"
    return f"{name} exited with code {returncode}"


def _pump(stream: IO[bytes], capture: list[str] | None) -> None:
    """Copy the child's output to this process's stdout (a task log), line by line."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        if capture is not None:
            capture.append(line)
        print(line, flush=True)


def stream(
    cmd: Sequence[str],
    *,
    name: str,
    stop_when: Callable[[], str | None] | None = None,
    check_every_s: float = 5.0,
    grace_s: float = 60.0,
    capture: list[str] | None = None,
    tag: str = "[launcher]",
) -> None:
    """Run `cmd`, copy its output to stdout line by line, raise JobFailed if it fails.

    `stop_when()` is polled every `check_every_s`; a non-empty answer stops the job
    (SIGTERM to its group, then SIGKILL after `grace_s`) and raises JobStopped with it.
    A SIGTERM to this process (Airflow stopping the task, a node being drained) stops the
    job the same way.
    """
    print(f"{tag} starting {name}: {shlex.join(cmd)}", flush=True)
    proc = spawn(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=job_env(), cwd=PROJECT_ROOT
    )
    assert proc.stdout is not None
    reader = threading.Thread(target=_pump, args=(proc.stdout, capture), daemon=True)
    reader.start()
    stopped: list[str] = []
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stopped.append("got SIGTERM"))
    try:
        next_check = time.monotonic() + check_every_s
        while proc.poll() is None and not stopped:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1.0)
            if stop_when is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + check_every_s
                why = stop_when()
                if why:
                    stopped.append(why)
    finally:
        if proc.poll() is None:
            stop_group(proc.pid, grace_s, reap=proc)
        reader.join(10)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if stopped:
        raise JobStopped(f"{name} stopped: {stopped[0]} (exit code {proc.returncode})")
    if proc.returncode != 0:
        raise JobFailed(
            f"{failure_text(name, proc.returncode)}; its output is above", proc.returncode
        )


def stream_role(
    role: str, run_url: str, extra: Sequence[str] = (), *, name: str | None = None, **kw: Any
) -> None:
    """`stream` the job of `role` for the run at `run_url`."""
    stream(job_command(role, run_url, extra), name=name or role, **kw)


def log_dir(run_url: str) -> Path:
    """Where the background jobs of a run write their logs: `<run>/logs/` for a local
    run; for a remote run (nowhere to write files there) a folder under `.rlax-logs/`
    named for its URL: gs://b/runs/r1 -> `.rlax-logs/b_runs_r1`."""
    from pipeline.storage import local_path, split_url  # not at the top: see _WATCHDOG

    path = local_path(run_url)
    if path is not None:
        return path / "logs"
    parsed = split_url(run_url)
    return Path(".rlax-logs") / f"{parsed.bucket}/{parsed.key}".rstrip("/").replace("/", "_")


@dataclass
class Fleet:
    """Named jobs of one stage in the background, each writing `log_dir/NAME.log` (the
    run's `log_dir` by default); any non-zero exit fails the stage (`check`) and stops
    the rest."""

    run_url: str
    log_dir: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.log_dir is None:
            self.log_dir = log_dir(self.run_url)

    def start(
        self,
        name: str,
        role: str,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen:
        self.procs[name] = start(role, self.run_url, extra, log_path=self.log_path(name), env=env)
        return self.procs[name]

    def log_path(self, name: str) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return self.log_path(name).read_text(errors="replace")[-chars:]

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def check(self, tolerated: Iterable[int] = ()) -> None:
        """Raise JobFailed (after stopping the others) if a job exited with a non-zero
        code other than `tolerated` ones (chaos tolerates its own SIGKILLs)."""
        ok = {0, *tolerated}
        for name, p in self.procs.items():
            code = p.poll()
            if code is not None and code not in ok:
                self.stop()
                raise JobFailed(
                    f"{failure_text(name, code)}; last output:\n{self.log_tail(name)}", code
                )

    def wait(self, name: str, poll_s: float = 1.0) -> None:
        """Wait until job `name` exits, failing early if any job of the stage fails."""
        while self.alive(name):
            self.check()
            time.sleep(poll_s)
        self.check()

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop every job still running, each as a whole process group: all get SIGTERM
        at once (the trainer checkpoints on it), then each gets what is left of `grace_s`."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            stop_group(p.pid, max(0.1, deadline - time.monotonic()), reap=p)
