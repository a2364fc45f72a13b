"""The sandbox's fork server: a Python started once, which forks a fresh, isolated child per run.

Started by `rollout.sandbox.runs` with a clean environment and a SOCK_SEQPACKET socket (fd in argv[1]); it
imports the isolation code, the harness and the modules programs commonly import, then waits. Each
message is a run's plan (JSON) with its pipes attached (SCM_RIGHTS): command, reply, stdout, stderr,
status. It forks a holder (`entry.run`) and answers {"pid": holder}. It never sees a program or a
test: those go from the grader straight to the run over the pipes, so its memory (which every run
inherits) holds nothing a program could use. It reaps its children, and when the grader's end of the
socket closes it kills the runs still going and exits.
"""

import ctypes
import json
import os
import select
import signal
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    # entry imports the seccomp filter: without libseccomp (or pyseccomp) the fork server refuses to start.
    import entry
    import runner

    START_ERROR = None
except (ImportError, RuntimeError, OSError) as e:
    START_ERROR = f"the sandbox cannot load its seccomp filter ({type(e).__name__}: {e}); install libseccomp2 and pyseccomp"

sys.path.pop(0)
# Imported once here instead of in every run.
PRELOAD = (
    "collections",
    "itertools",
    "functools",
    "math",
    "re",
    "string",
    "heapq",
    "bisect",
    "typing",
    "fractions",
    "decimal",
    "statistics",
    "datetime",
    "copy",
    "operator",
    "hashlib",
    "dataclasses",
    "numpy",
    "numpy.random",
)
PR_SET_CHILD_SUBREAPER = 36
FD_NAMES = ("cmd", "reply", "stdout", "stderr", "status")
MAX_PLAN_BYTES = 1 << 20
"""A plan is one message on the socket (SOCK_SEQPACKET): a longer one would be cut."""


def _preload() -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:
            pass


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    if START_ERROR is not None:
        sock.send(json.dumps({"ready": False, "error": START_ERROR}).encode())
        return
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _preload()
    children: set[int] = set()
    sock.send(b'{"ready": true}')
    while True:
        try:
            while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:
                children.discard(pid)
        except ChildProcessError:
            pass
        if not select.select([sock], [], [], 1.0)[0]:
            continue
        try:
            # (a plan holds its command: the grading boundary's server is 60 KB of source in `-c`)
            message, fds, _, _ = socket.recv_fds(sock, MAX_PLAN_BYTES, len(FD_NAMES))
        except OSError:
            break
        if not message:
            break
        plan = json.loads(message)
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                entry.run(plan, dict(zip(FD_NAMES, fds)), runner.serve)
            finally:
                os._exit(127)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        sock.send(json.dumps({"pid": pid}).encode())
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    main()
