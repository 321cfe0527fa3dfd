"""What one sandboxed run may use: `Limits`, checked on construction.

The per-run limits (time, memory, processes, file size, output) travel with each request
to a pre-started worker; `extra_ro_paths`, `packages` and `tmpfs_mb` belong to the worker
itself (its mounts and imports are fixed when it starts), so the pool keeps one set of
workers per distinct combination of them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from pipeline.errors import check

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run.

    timeout_s: wall-clock limit; past it every process of the run is killed ("timeout").
    memory_mb: RLIMIT_AS of each process of the run (the interpreter's own ~30 MiB
        included); an allocation past it fails ("memory" when Python raises MemoryError).
    cpu_s: RLIMIT_CPU per process; None means the wall limit rounded up plus one second,
        so a busy loop is stopped by the wall clock first.
    processes: RLIMIT_NPROC inside the sandbox's user namespace (the worker counts as one).
    file_size_mb: RLIMIT_FSIZE: the largest file a run may write (in its private /tmp).
    tmpfs_mb: size of the private /tmp (and /dev/shm), so many small files cannot fill memory.
    output_bytes: stdout and stderr together; past it the run is killed ("output_limit").
    open_files: RLIMIT_NOFILE.
    extra_ro_paths: absolute host paths bound read-only at the same place inside (for
        example one package's site-packages directory for a verifier); default none. They
        must be readable by the sandbox's host user: `nobody` when the caller is root.
    packages: top-level modules of the host's environment (a trusted verifier's
        dependencies, such as math-verify and sympy) whose files are bound read-only
        inside, put on the worker's `sys.path` and imported by the worker before its first
        run, so each run forks with them warm (importing sympy costs seconds). Only those
        packages' own files become visible, not the rest of site-packages.
    warmup: trusted code (never model text) the worker runs once after importing
        `packages`, so that caches it fills (compiled regexes, parsers) are warm in every
        run forked from it.
    """

    timeout_s: float = 10.0
    memory_mb: int = 512
    cpu_s: float | None = None
    processes: int = 32
    file_size_mb: int = 16
    tmpfs_mb: int = 64
    output_bytes: int = MIB
    open_files: int = 256
    extra_ro_paths: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    warmup: str = ""

    def __post_init__(self) -> None:
        check(0 < self.timeout_s <= 3600, "sandbox.timeout_s", self.timeout_s, "0 < s <= 3600")
        # Below ~64 MiB the forked interpreter itself cannot allocate.
        check(self.memory_mb >= 64, "sandbox.memory_mb", self.memory_mb, ">= 64")
        check(self.cpu_s is None or self.cpu_s > 0, "sandbox.cpu_s", self.cpu_s, "None or > 0")
        check(
            self.processes >= 2,
            "sandbox.processes",
            self.processes,
            ">= 2 (the worker and the run)",
        )
        check(self.file_size_mb >= 1, "sandbox.file_size_mb", self.file_size_mb, ">= 1")
        check(self.tmpfs_mb >= 1, "sandbox.tmpfs_mb", self.tmpfs_mb, ">= 1")
        check(self.output_bytes >= 1, "sandbox.output_bytes", self.output_bytes, ">= 1")
        check(self.open_files >= 16, "sandbox.open_files", self.open_files, ">= 16")
        for path in self.extra_ro_paths:
            check(
                os.path.isabs(path) and os.path.exists(path),
                "sandbox.extra_ro_paths",
                path,
                "absolute paths that exist on the host",
            )

        for name in self.packages:
            check(
                name.isidentifier(),
                "sandbox.packages",
                name,
                "top-level module names (such as 'sympy')",
            )

    def worker_key(self) -> tuple[tuple[str, ...], tuple[str, ...], str, int]:
        """What a worker fixes when it starts (its mounts, imports and warm-up): runs that
        differ here need different workers."""
        return (self.extra_ro_paths, self.packages, self.warmup, self.tmpfs_mb)

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """(soft, hard) rlimits the worker sets in each run's process, by `resource` name."""
        cpu = math.ceil(self.cpu_s if self.cpu_s is not None else self.timeout_s + 1)
        fixed = {
            "RLIMIT_AS": self.memory_mb * MIB,
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_FSIZE": self.file_size_mb * MIB,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_CORE": 0,
            # No POSIX message queues: they live in the worker's IPC namespace, outside
            # any directory the worker empties, so one could carry data to a later run.
            "RLIMIT_MSGQUEUE": 0,
        }
        # CPU: the soft limit sends SIGXCPU (reported as "timeout"); at the hard one the
        # kernel sends SIGKILL, which would be indistinguishable from other kills.
        return {"RLIMIT_CPU": (cpu, cpu + 1)} | {name: (v, v) for name, v in fixed.items()}
