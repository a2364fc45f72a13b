"""The seccomp filter every sandboxed run gets (built with libseccomp through `pyseccomp`, loaded by `entry` in the
harness process after the uid change and before any program code; inherited by everything the run starts).

A deny-list at least as strict as container runtimes' default profiles: the kernel's attack surface a program never
needs (io_uring, perf events, BPF, userfaultfd, keyrings), and every way out of or around the run's namespaces and
caps (new namespaces, mounts, ptrace, modules, kexec, the clock, the host name, the kernel log, file handles).
A refused call fails with EPERM (clone3 with ENOSYS: its flags sit in memory a filter cannot read, and glibc then
falls back to clone, whose flags it can). Calls of another ABI (32-bit x86 on x86_64) kill the process: libseccomp's
default for a foreign architecture.

Imported by the fork server as a plain module (beside `entry`), so it imports nothing of composer. Without libseccomp
the import fails and the fork server refuses to start: no run goes without the filter.
"""

import errno

import pyseccomp as seccomp

DENIED = (
    # the kernel's surface: asynchronous I/O rings, performance counters, BPF programs, fault handling
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "perf_event_open",
    "bpf",
    "userfaultfd",
    # keyrings: a run gets a fresh session keyring before the filter and may not touch any
    "keyctl",
    "add_key",
    "request_key",
    # namespaces and mounts: no nested user namespace (full capabilities there, tmpfs outside every cap)
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    # other processes, the kernel, the machine
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "clock_settime",
    "clock_adjtime",
    "settimeofday",
    "adjtimex",
    "open_by_handle_at",
    "name_to_handle_at",
    "swapon",
    "swapoff",
    "reboot",
    "sethostname",
    "setdomainname",
    "syslog",
    "acct",
    "quotactl",
    "lookup_dcookie",
    "iopl",
    "ioperm",
    "vhangup",
)
NAMESPACE_FLAGS = (
    0x00000080,  # CLONE_NEWTIME
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)


def build() -> seccomp.SyscallFilter:
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    deny = seccomp.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            f.add_rule(deny, name)
        except (OSError, RuntimeError, ValueError):
            pass  # not a system call of this architecture
    for flag in NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    # Only personality(PER_LINUX): any other persona (no ASLR, READ_IMPLIES_EXEC, ...) is refused, and so is the
    # query (0xffffffff): libseccomp cannot express "neither 0 nor 0xffffffff" on one argument.
    f.add_rule(deny, "personality", seccomp.Arg(0, seccomp.GT, 0))
    return f


_FILTER = build()
"""Built once in the fork server; each run loads it (a few microseconds, no allocation after the fork)."""


def load() -> None:
    _FILTER.load()
