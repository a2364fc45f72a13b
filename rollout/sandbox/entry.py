"""Isolation of one sandboxed run, done in a fresh child of the fork server (`zygote`).

The fork server forks a *holder* per run; the holder, still privileged and running no program code:
  1. starts a new session and new namespaces: mount, PID, IPC and network as root (network only unless the
     recipe allows it); when not root, a user namespace carrying a network namespace where the kernel
     allows one;
  2. as root, gives the run a root of its own (an allow-list): an empty tmpfs into which it binds a
     private `/tmp` read-write (with a write cap: on a sized tmpfs of the run's own, which also holds a program
     run's work directory, so the run's files together stay under the cap), then, read-only, the interpreter's prefix, the virtual environment and the
     system libraries (with the task data packages covered by empty directories; on top of the private
     `/tmp` where they lie below it), then the work directory (`/sandbox`, also HOME) read-write, a minimal
     `/dev`; then pivot_root into it, dropping the host tree;
  3. forks the run's init (PID 1 of the new PID namespace), which mounts a `/proc` showing only the run
     and forks the harness process; when the init ends, the kernel kills everything left inside;
  4. the harness process: output pipes on fds 1 and 2, resource limits, no new privileges, the run's uid
     and gid, a fresh empty session keyring, the seccomp filter (`syscall_filter`), every other descriptor
     closed, the clean environment; then the harness (`runner`),
     or, for a command run (`Sandbox.run_command`), `bash -c command` with stdout and stderr on one pipe,
     umask 0 (a work directory outlives the run, and its next run has another uid) and, when asked for, the
     reply pipe at `channel_fd` (a report channel back to the caller) and the command pipe at `call_fd` (the
     caller's answers to what the command asks on its channel).
The holder reports on the status pipe (which no process of the run can reach): {"setup_error"} when a
step fails (an infrastructure failure, not the program's), else {"exit": code} once the init has ended, with
"write_limit" when the run's capped tmpfs was left full (no room or no inode: the run wrote until refused).
"""

import ctypes
import fcntl
import json
import os
import resource
import signal
import sys

import syscall_filter

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
DEVICES = ("null", "zero", "full", "random", "urandom")
WORK_DIR = "/sandbox"
SCRATCH = "/.scratch"
FULL_MARGIN_BYTES = 64 << 10
"""Free space below which a capped run's tmpfs counts as full (writes are refused a page or a chunk short of it)."""
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _bytes(text):
    return None if text is None else text.encode()


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)), f"mount {target}")


def _bind(source: str, target: str, read_only: bool, recursive: bool = False) -> None:
    if os.path.isdir(source):
        os.makedirs(target, 0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        if not os.path.exists(target):
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | (MS_RDONLY | MS_NODEV if read_only else 0)
    _mount(None, target, None, flags)


def _scratch(plan: dict) -> tuple[str, str]:
    """The run's /tmp and work directory: on a tmpfs of the write cap's size and inodes (the kernel refuses
    writes past it; it ends with the run's mount namespace), or the host directories the plan names."""
    cap = plan.get("write_cap")
    if not cap:
        return plan["tmp"], plan["work"]
    scratch = plan["new_root"] + SCRATCH
    os.makedirs(scratch, 0o700)
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={cap[0]},nr_inodes={cap[1]}")
    uid = plan["uid"] if plan["uid"] is not None else os.getuid()
    for name in ("tmp", "work"):
        os.mkdir(f"{scratch}/{name}", 0o700)
        os.chown(f"{scratch}/{name}", uid, uid)
    # A command's work directory is the caller's (a workspace, capped by its own filesystem).
    return f"{scratch}/tmp", plan["work"] if plan.get("command") is not None else f"{scratch}/work"


def _write_limit_reached() -> bool:
    """The capped tmpfs (seen at /tmp from the holder) has no room or no inode left."""
    try:
        st = os.statvfs("/tmp")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_MARGIN_BYTES or st.f_favail == 0


def _build_root(plan: dict) -> None:
    root = plan["new_root"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    tmp, work = _scratch(plan)
    # The private /tmp first: read-only binds below /tmp (a checkout and its .venv in the system's temporary
    # directory) go on top of it and stay visible.
    _bind(tmp, root + "/tmp", read_only=False)
    for path in plan["read_only"]:
        _bind(path, root + path, read_only=True)
    for path in plan.get("writable_binds", ()):
        _bind(path, root + path, read_only=False)
    for path in plan["hidden"]:
        # An empty read-only directory (or file) over a package's files inside a read-only bind.
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=0555,size=4k")
        elif os.path.lexists(root + path):
            _bind(plan["empty_file"], root + path, read_only=True)
    for link, target in plan["symlinks"]:
        os.symlink(target, root + link)
    # Recursive: a work directory may hold mounts of its own (a grading run's read-only view of a repository).
    _bind(work, root + WORK_DIR, read_only=False, recursive=True)
    if plan.get("write_cap"):
        _check(_libc.umount2((root + SCRATCH).encode(), MNT_DETACH), "detach the scratch tmpfs")  # the binds keep it
        os.rmdir(root + SCRATCH)
    os.makedirs(root + "/dev", 0o755)
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for device in DEVICES:
        _bind(f"/dev/{device}", f"{root}/dev/{device}", read_only=False)
    os.makedirs(root + "/dev/shm")
    _mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777,size=16m")
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc", 0o555)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    # pivot_root(".", "."): the old root ends up on top of the new one, and is detached at once.
    os.chdir(root)
    _check(_libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def isolate(plan: dict) -> None:
    flags = 0
    if plan["mount_namespace"]:
        # IPC: SysV segments and queues and POSIX message queues are the run's own and end with it.
        flags |= CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC
    if plan["network_namespace"]:
        flags |= CLONE_NEWNET if plan["root"] else CLONE_NEWUSER | CLONE_NEWNET
    if flags:
        _check(_libc.unshare(flags), "unshare")
    if plan["mount_namespace"]:
        # Nothing mounted here may propagate back to the host.
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        _build_root(plan)


def _limit(plan: dict) -> None:
    for name, value in plan["limits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))


def _drop_privileges(plan: dict) -> None:
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    uid = plan["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    # A new, empty session keyring owned by the run's uid (else the fork server's, root's, is inherited);
    # the filter then refuses every keyring call, so nothing can be added to it or to the uid's keyring.
    if _libc.syscall(SYS_KEYCTL[os.uname().machine], KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"keyctl(JOIN_SESSION_KEYRING): {os.strerror(errno)}")
    syscall_filter.load()


def _report(status_fd: int, message: dict) -> None:
    try:
        os.write(status_fd, (json.dumps(message) + "\n").encode())
    except OSError:
        pass


def _start_harness(plan: dict, fds: dict, serve) -> None:
    """Become the harness process of the run; never returns."""
    try:
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        command = plan.get("command")
        os.dup2(fds["stdout"], 1)
        os.dup2(fds["stdout"] if command is not None else fds["stderr"], 2)
        channel = plan.get("channel_fd") if command is not None else None
        calls = plan.get("call_fd") if channel is not None else None
        # A copy out of the way of the descriptors about to be placed.
        call_end = fcntl.fcntl(fds["cmd"], fcntl.F_DUPFD, 10) if calls is not None else None
        if channel is not None:
            # The reply pipe, unused by commands, at a known descriptor: what the command reports to the caller.
            if fds["status"] == channel:
                fds["status"] = fcntl.fcntl(channel, fcntl.F_DUPFD, 10)
            os.dup2(fds["reply"], channel)
        if calls is not None:
            # The command pipe, unused by commands, at a known descriptor: what the caller answers the channel with.
            if fds["status"] == calls:
                fds["status"] = fcntl.fcntl(calls, fcntl.F_DUPFD, 10)
            os.dup2(call_end, calls)
        _limit(plan)
        _drop_privileges(plan)
        os.chdir(plan["cwd"])
        os.environ.clear()
        os.environ.update(plan["env"])
        # A command keeps the status pipe until its exec (close-on-exec) to report a failing exec.
        keep = {0, 1, 2, fds["status"]} if command is not None else {0, 1, 2, fds["cmd"], fds["reply"]}
        if channel is not None:
            keep.add(channel)
        if calls is not None:
            keep.add(calls)
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        sys.argv = ["solution.py"]
        if command is not None:
            os.set_inheritable(fds["status"], False)
            os.umask(0)
            os.execve("/bin/bash", ["bash", "-c", command], plan["env"])
    except BaseException as e:
        _report(fds["status"], {"setup_error": f"harness setup: {e}"})
        os._exit(121)
    try:
        serve(fds["cmd"], fds["reply"], plan)
    finally:
        os._exit(0)


def _init(harness: int) -> None:
    """PID 1 of the run: reap every child until the harness ends, then exit with its status (a fatal signal
    as 128 + signal: PID 1 cannot send itself one)."""
    while True:
        pid, status = os.wait()
        if pid == harness:
            code = os.waitstatus_to_exitcode(status)
            os._exit(128 - code if code < 0 else code)


def run(plan: dict, fds: dict, serve) -> None:
    """The holder of one run (see the module docstring); never returns."""
    status_fd = fds["status"]
    try:
        os.setsid()
        # The run's cgroup (one memory limit and one CPU count for everything it starts), joined first.
        for procs in plan.get("cgroup_procs", ()):
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        isolate(plan)
        child = os.fork()
    except BaseException as e:
        _report(status_fd, {"setup_error": f"{type(e).__name__}: {e}"})
        os._exit(120)
    if child == 0:
        if not plan["mount_namespace"]:
            _start_harness(plan, fds, serve)
        try:
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            harness = os.fork()
        except BaseException as e:
            _report(status_fd, {"setup_error": f"init: {type(e).__name__}: {e}"})
            os._exit(122)
        if harness == 0:
            _start_harness(plan, fds, serve)
        for fd in fds.values():
            os.close(fd)
        _init(harness)
    for name, fd in fds.items():
        if name != "status":
            os.close(fd)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if plan["mount_namespace"] and code - 128 in {int(s) for s in signal.Signals}:
        code = 128 - code
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    full = bool(plan.get("write_cap")) and plan["mount_namespace"] and _write_limit_reached()
    _report(status_fd, {"exit": code, "cpu": usage.ru_utime + usage.ru_stime, "write_limit": full})
    os._exit(0)
