"""The first code of every sandboxed process: isolate, limit, drop privileges, then exec the harness.

Started by `rollout.sandbox` as `python -I -S sandbox_entry.py PLAN_JSON` in a new session, with the
parent's privileges (the standard library only, and no threads, so nothing here can deadlock). In order:
  1. new namespaces: mount, PID and network as root (network only unless the recipe allows it); when
     not root, a user namespace carrying a network namespace where the kernel allows one;
  2. masks (mount namespace only): each listed directory is covered by an empty root-owned tmpfs into
     which only the children the interpreter needs are bound back, hiding the project, /root and the
     world-writable temp directories, and opening the interpreter's path to the sandbox uid;
  3. with a PID namespace: fork its init, which mounts a /proc showing only the sandbox, starts the
     harness and reaps orphans; when the init ends, the kernel kills and reaps everything left inside,
     and this process passes the harness's exit status on;
  4. resource limits (CPU, address space, processes, file size, open files, no core dumps);
  5. no new privileges (setuid binaries stay powerless), then the sandbox uid and gid, no extra groups;
  6. exec the interpreter on the harness, in the work directory, with the clean environment.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)
_SIGNALS = {int(s) for s in signal.Signals}


def _check(rc: int, what: str) -> None:
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)), f"mount {target}")


def unshare(plan: dict) -> None:
    flags = 0
    if plan["mount_namespace"]:
        flags |= CLONE_NEWNS | CLONE_NEWPID
    if plan["network_namespace"]:
        flags |= CLONE_NEWNET if plan["root"] else CLONE_NEWUSER | CLONE_NEWNET
    if flags:
        _check(_libc.unshare(flags), "unshare")
    if plan["mount_namespace"]:
        # Nothing mounted here may propagate back to the host.
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        for directory, keep in plan["masks"]:
            _mask(directory, keep)


def _mask(directory: str, keep: list[str]) -> None:
    # Open the kept children first: once the tmpfs covers `directory` they are reachable only by fd.
    kept = {name: os.open(os.path.join(directory, name), os.O_PATH | os.O_DIRECTORY) for name in keep}
    _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0711,size=64k")
    for name, fd in kept.items():
        target = os.path.join(directory, name)
        os.mkdir(target, 0o755)
        _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
        os.close(fd)


def limit(plan: dict) -> None:
    for name, value in plan["limits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))


def drop_privileges(plan: dict) -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    uid = plan["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _end(code: int) -> None:
    """Exit with `code` as `os.waitstatus_to_exitcode` gives it: a negative code is "killed by signal
    -code", passed on as that signal."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def _init(harness: int) -> None:
    """PID 1 of the sandbox: reap every child until the harness ends, then exit with its status (a
    fatal signal as 128 + signal: PID 1 cannot send itself one)."""
    while True:
        pid, status = os.wait()
        if pid == harness:
            code = os.waitstatus_to_exitcode(status)
            os._exit(128 - code if code < 0 else code)


def _start_harness(plan: dict) -> None:
    limit(plan)
    drop_privileges(plan)
    os.chdir(plan["cwd"])
    os.execve(plan["argv"][0], plan["argv"], plan["env"])


def main() -> None:
    plan = json.loads(sys.argv[1])
    unshare(plan)
    if not plan["mount_namespace"]:
        _start_harness(plan)
    init = os.fork()
    if init == 0:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        harness = os.fork()
        if harness == 0:
            _start_harness(plan)
        _init(harness)
    _, status = os.waitpid(init, 0)
    code = os.waitstatus_to_exitcode(status)
    if code - 128 in _SIGNALS:
        code = 128 - code
    _end(code)


if __name__ == "__main__":
    main()
