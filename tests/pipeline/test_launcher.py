"""The launcher's job environment: the persistent compilation cache every job shares."""

from __future__ import annotations

import subprocess
import sys

from pipeline import launcher

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
