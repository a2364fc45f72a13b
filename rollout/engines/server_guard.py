"""Runs a vLLM server (`python -m composer.rollout.engines.server_guard SERVER_ARGS...`) and ends it, with every process it started,
when composer stops it or dies: vLLM's graceful shutdown can hang (uvicorn waits for requests of a client that is
gone), so after a grace period the whole process group is killed."""

import os
import signal
import subprocess
import sys

from composer.runtime.processes import die_with_parent

GRACE_SECONDS = 10
MODULE = __spec__.name
"""This entry point, as `python -m` names it (the engines start servers through it)."""


def main() -> None:
    die_with_parent(signal.SIGTERM)
    server = subprocess.Popen([sys.executable, *sys.argv[1:]])

    def stop(_signum, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.terminate()
        try:
            server.wait(GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    server.wait()
    os.killpg(0, signal.SIGKILL)  # the server is gone: its engine processes go too


if __name__ == "__main__":
    main()
