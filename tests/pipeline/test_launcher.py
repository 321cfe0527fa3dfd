"""The launcher: the jobs' environment (the persistent compilation cache every job shares)
and the supervision of child processes (no job outlives the command that started it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.layout import worker_ids
from pipeline.ops import launcher

JIT = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)))"


def _without_jax_cache(monkeypatch) -> None:
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        monkeypatch.delenv(name, raising=False)


def test_jobs_share_a_persistent_compilation_cache(tmp_path, monkeypatch):
    _without_jax_cache(monkeypatch)
    cache = tmp_path / "cache"
    monkeypatch.setenv(launcher.COMPILE_CACHE_ENV, str(cache))
    env = launcher.job_env()
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(cache)
    # A real job process writes its compiled program there (the tiny one compiles in well
    # under the default 0.1 s floor, so lower it for this check).
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    subprocess.run([sys.executable, "-c", JIT], env=env, check=True, capture_output=True)
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "no compiled program was cached"
    # A second process loads it instead of compiling: no new entry.
    subprocess.run([sys.executable, "-c", JIT], env=env, check=True, capture_output=True)
    assert sorted(p.name for p in cache.iterdir()) == entries


def test_compilation_cache_can_be_turned_off_or_set_by_jax_itself(monkeypatch):
    _without_jax_cache(monkeypatch)
    monkeypatch.setenv(launcher.COMPILE_CACHE_ENV, "off")
    assert "JAX_COMPILATION_CACHE_DIR" not in launcher.job_env()
    monkeypatch.delenv(launcher.COMPILE_CACHE_ENV)
    env = launcher.job_env()
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(launcher.DEFAULT_COMPILE_CACHE)
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == launcher.COMPILE_CACHE_MIN_SECONDS
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")  # JAX's own setting wins
    assert launcher.job_env()["JAX_COMPILATION_CACHE_DIR"] == "/elsewhere"


# ----------------------------------------------------------------------- supervision
# The probe's finding 3: after kill -9 or SIGTERM of `rlax train` or `rlax rollout` the job
# kept running as an orphan (an orphaned trainer took a new epoch and kept training).


def _children_with(marker: str) -> list:
    import psutil

    out = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if marker in " ".join(proc.info["cmdline"] or []):
                out.append(proc)
    return out


def _wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


@pytest.fixture
def waiting_run(tmp_path):
    """A run with data but no weights: its rollout worker waits (polls) for version 0."""
    from pipeline.problem_sets import write_data
    from pipeline.run import Run
    from tests.runs import tiny_config

    run = Run.create(str(tmp_path / "run"), tiny_config())
    write_data(run)
    return run


def _gone(proc) -> bool:
    """Exited (or a zombie); it may exit between the two questions, which is an answer too."""
    import psutil

    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_stopping_rlax_rollout_stops_its_worker(waiting_run, sig, tmp_path):
    rlax = Path(sys.executable).parent / "rlax"
    parent = subprocess.Popen(
        [str(rlax), "rollout", "--run", waiting_run.url, "--worker-id", f"probe-{sig.name}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        worker = _wait_until(
            lambda: (
                _children_with(f"probe-{sig.name}")
                and [p for p in _children_with(f"probe-{sig.name}") if p.pid != parent.pid]
            ),
            60,
            "the worker process started",
        )[0]
        parent.send_signal(sig)
        # SIGKILL: the worker gets SIGTERM from PR_SET_PDEATHSIG; SIGTERM: rlax forwards it.
        _wait_until(lambda: _gone(worker), 20, "exit")
        code = parent.wait(20)
        # SIGTERM: rlax exits with the worker's status, 0 when it had installed its handler
        # (it stops after its poll), 143 when the signal came while it was still starting.
        assert code == -9 if sig == signal.SIGKILL else code in (0, 143)
    finally:
        with contextlib.suppress(ProcessLookupError):
            parent.kill()


WATCHED = """
import sys, time
from pipeline.ops import processes
naps = f"sleep {sys.argv[1]}"
processes.spawn(["bash", "-c", f"{naps} & {naps} & wait"], watchdog=True, grace_s=2)
print("spawned", flush=True)
time.sleep(300)
"""


def test_the_watchdog_stops_a_childs_whole_group_when_the_parent_is_killed():
    """What keeps Airflow's dozen processes from outliving `rlax airflow` killed by -9: the
    child's own children (here two sleeps under bash) are stopped too."""
    naps = f"{300 + os.getpid() % 1000}.{time.time_ns() % 10**6:06d}"  # ours alone
    parent = subprocess.Popen(
        [sys.executable, "-c", WATCHED, naps],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert parent.stdout.readline().strip() == b"spawned"
        sleeps = _wait_until(
            lambda: [p for p in _children_with(f"sleep {naps}") if p.name() == "sleep"],
            10,
            "the grandchildren started",
        )
        group = os.getpgid(sleeps[0].pid)
        assert group != os.getpgid(parent.pid)
    finally:
        parent.kill()
        parent.wait()

    def group_gone() -> bool:
        try:
            os.killpg(group, 0)
            return False
        except ProcessLookupError:
            return True

    _wait_until(group_gone, 15, f"process group {group} is gone")


def test_exit_status_of_a_signalled_child_is_128_plus_the_signal():
    assert launcher.exit_status(-15) == 143 and launcher.exit_status(3) == 3


# ------------------------------------------------ command lines and streamed jobs


def test_curate_command_mirrors_the_cli():
    cmd = launcher.curate_command(
        ["a/*.jsonl", "b/*.csv"],
        "out",
        eval_sets=["e.jsonl"],
        options={"near_dup_threshold": 0.7, "staging": None, "overwrite": True, "x": False},
        beam_args=["--direct_num_workers=2"],
    )
    assert cmd[:3] == [sys.executable, "-m", "beam_jobs.curate"]
    assert cmd[3:] == [
        "--input", "a/*.jsonl", "--input", "b/*.csv", "--output", "out",
        "--eval-sets", "e.jsonl", "--near-dup-threshold", "0.7", "--overwrite",
        "--direct_num_workers=2",
    ]  # fmt: skip
    from beam_jobs.curate import parse_args

    opts = parse_args(cmd[3:])
    assert opts.inputs == ("a/*.jsonl", "b/*.csv") and opts.near_dup_threshold == 0.7
    assert opts.overwrite and opts.beam_args == ("--direct_num_workers=2",)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_stream_streams_output_and_fails_with_the_child(capsys):
    lines: list[str] = []
    launcher.stream(_py("print('hello'); print('world')"), name="ok", capture=lines)
    assert lines == ["hello", "world"]
    assert "hello" in capsys.readouterr().out
    with pytest.raises(launcher.JobFailed, match="exited with code 3") as err:
        launcher.stream(_py("import sys; print('boom'); sys.exit(3)"), name="bad")
    assert err.value.returncode == 3
    with pytest.raises(launcher.JobFailed, match="killed by SIGKILL"):
        launcher.stream(_py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), name="k")


def test_stream_stops_the_job_when_asked():
    code = "import signal, sys, time\n"
    code += "signal.signal(signal.SIGTERM, lambda *a: (print('checkpointing'), sys.exit(0)))\n"
    code += "print('up', flush=True)\nwhile True: time.sleep(0.1)\n"
    lines: list[str] = []
    with pytest.raises(launcher.JobStopped, match="run aborted"):
        launcher.stream(
            _py(code),
            name="trainer",
            stop_when=lambda: "run aborted" if lines else None,
            check_every_s=0.2,
            capture=lines,
        )
    assert lines == ["up", "checkpointing"]  # it got SIGTERM (graceful), not SIGKILL


def test_curate_command_takes_run_urls_and_worker_names():
    cmd = launcher.curate_command(["file:///data/*.jsonl"], "file:///runs/r/curated")
    assert cmd[3:] == ["--input", "/data/*.jsonl", "--output", "/runs/r/curated"]
    assert worker_ids(2) == ["worker0", "worker1"]
