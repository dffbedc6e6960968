"""The seccomp filter of sandboxed programs: a classic-BPF program that bwrap loads.

It refuses, with EPERM, the system calls a program under test never needs and
an escape would: tracing and reading other processes' memory, the kernel
keyring, eBPF, perf events, userfaultfd and io_uring (frequent kernel exploit
paths), mounting, namespaces, modules, kexec, reboot, swap, clocks and
file handles. A call from another ABI (32-bit int 0x80, x32) kills the
process, since its numbers differ. Only x86_64 has a table; elsewhere
`program()` returns None and the sandbox notes that no filter applies.
"""

from __future__ import annotations

import errno
import platform
import struct

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ARCH_OFFSET, _NR_OFFSET = 4, 0  # in struct seccomp_data

# x86_64 numbers (arch/x86/entry/syscalls/syscall_64.tbl).
REFUSED_X86_64 = {
    "ptrace": 101, "syslog": 103, "adjtimex": 159, "pivot_root": 155, "chroot": 161,
    "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168,
    "reboot": 169, "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212,
    "clock_settime": 227, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
    "unshare": 272, "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313,
    "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "mount_setattr": 442,
}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
  return struct.pack("=HBBI", code, jt, jf, k)


def program() -> bytes | None:
  """Returns the filter as struct sock_filter[] bytes for `bwrap --seccomp`, or None off x86_64."""
  if platform.machine() != "x86_64":
    return None
  refused = sorted(REFUSED_X86_64.values())
  k = len(refused)
  # [0] load arch, [1] arch ok? skip the kill, [2] kill, [3] load nr, [4] x32? kill,
  # [5..5+k) refused? errno, [5+k] allow, [6+k] errno, [7+k] kill.
  insns = [_insn(_LD_W_ABS, _ARCH_OFFSET), _insn(_JEQ_K, _AUDIT_ARCH_X86_64, jt=1),
           _insn(_RET_K, _RET_KILL_PROCESS), _insn(_LD_W_ABS, _NR_OFFSET), _insn(_JGE_K, _X32_BIT, jt=k + 2)]
  insns += [_insn(_JEQ_K, nr, jt=k - i) for i, nr in enumerate(refused)]
  insns += [_insn(_RET_K, _RET_ALLOW), _insn(_RET_K, _RET_ERRNO | errno.EPERM), _insn(_RET_K, _RET_KILL_PROCESS)]
  return b"".join(insns)
