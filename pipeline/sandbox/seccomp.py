"""A seccomp filter for the sandbox, as the raw BPF program bwrap's `--seccomp FD` loads.

Namespaces already take away the network, the host's files and every capability; the
filter narrows the kernel surface a program can reach on top of that: the system calls
below fail with EPERM (debuggers, mounts, namespaces, keyrings, BPF, io_uring, module
and kexec loading...), and any call made through another ABI (x32, or 32-bit) kills the
process, since the numbers below mean nothing there. Written by hand (no libseccomp) so
it needs no package; one table per architecture, and an architecture without a table
runs without the filter (the namespaces and rlimits still apply).
"""

from __future__ import annotations

import errno
import os
import platform
import struct

# Syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl) of what no graded program needs.
BLOCKED: dict[str, dict[str, int]] = {
    "x86_64": {
        "ptrace": 101,
        "syslog": 103,
        "personality": 135,
        "pivot_root": 155,
        "acct": 163,
        "mount": 165,
        "umount2": 166,
        "swapon": 167,
        "swapoff": 168,
        "reboot": 169,
        "init_module": 175,
        "delete_module": 176,
        "kexec_load": 246,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "unshare": 272,
        "perf_event_open": 298,
        "name_to_handle_at": 303,
        "open_by_handle_at": 304,
        "setns": 308,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "finit_module": 313,
        "kexec_file_load": 320,
        "bpf": 321,
        "userfaultfd": 323,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "mount_setattr": 442,
    },
}
AUDIT_ARCH = {"x86_64": 0xC000003E}
# x32 system calls are the x86_64 numbers with this bit set.
X32_BIT = {"x86_64": 0x40000000}

_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_RET_KILL_PROCESS, _RET_ALLOW = 0x80000000, 0x7FFF0000
_RET_EPERM = 0x00050000 | errno.EPERM
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # in struct seccomp_data


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (default: this one), or None when it has no table."""
    machine = machine or platform.machine()
    if machine not in BLOCKED:
        return None
    numbers = sorted(BLOCKED[machine].values())
    insns = [
        _insn(_BPF_LD_W_ABS, _ARCH_OFFSET),
        _insn(_BPF_JEQ_K, AUDIT_ARCH[machine], jt=1),
        _insn(_BPF_RET_K, _RET_KILL_PROCESS),
        _insn(_BPF_LD_W_ABS, _NR_OFFSET),
        _insn(_BPF_JGE_K, X32_BIT[machine], jf=1),
        _insn(_BPF_RET_K, _RET_KILL_PROCESS),
    ]
    # One comparison per blocked number: equal jumps to the EPERM return at the end.
    for i, nr in enumerate(numbers):
        insns.append(_insn(_BPF_JEQ_K, nr, jt=len(numbers) - i))
    insns += [_insn(_BPF_RET_K, _RET_ALLOW), _insn(_BPF_RET_K, _RET_EPERM)]
    return b"".join(insns)


def program_fd() -> int | None:
    """A file descriptor holding the filter, at offset 0, for one bwrap to read; None
    when this architecture has no table. The caller closes it once bwrap has started."""
    code = program()
    if code is None:
        return None
    fd = os.memfd_create("rlax-seccomp", 0)
    os.write(fd, code)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
