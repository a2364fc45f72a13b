import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

# One intra-op thread per process: measured faster for these tiny models on 2 cores, and tests start several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from composer.runtime.processes import free_port

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


COMPOSER = [sys.executable, "-m", "composer.cli"]


def run_ranks(nproc: int, module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m module args...` as `nproc` local ranks under torchrun (the launchers' own command line), output
    captured; one intra-op thread per rank (faster than sharing the cores)."""
    from composer.cluster.launch import torchrun_argv

    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        torchrun_argv(sys.executable, nproc, module, list(args)), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_composer(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real `composer` CLI in a fresh interpreter, as a user would (wide enough that rich wraps nothing)."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*COMPOSER, *args], cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def composer():
    return run_composer


@pytest.fixture(scope="module")
def init(tmp_path_factory) -> Path:
    """The recipe default's tiny model, made by `composer model init` once per test module."""
    out = tmp_path_factory.mktemp("init") / "model"
    result = run_composer("model", "init", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    return out


@pytest.fixture
def write_recipe(tmp_path):
    """Write a recipe file (text) into the test's directory; returns its path."""

    def write(text: str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


@pytest.fixture(autouse=True, scope="module")
def _release_process_groups():
    """Engines set process-wide state (torch.distributed, Megatron and vLLM parallel groups); each test module
    starts without the previous module's."""
    yield
    if "torch" not in sys.modules:
        return
    import gc

    import torch.distributed as dist

    if "vllm" in sys.modules:
        from vllm.distributed import parallel_state as vllm_groups

        # vLLM keeps its groups in module globals; one may sit on a world group a test already destroyed.
        for name, value in vars(vllm_groups).items():
            if isinstance(value, vllm_groups.GroupCoordinator):
                with contextlib.suppress(ValueError):
                    value.destroy()
                setattr(vllm_groups, name, None)
    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


SYSTEM_MISSING = Path(sys.prefix) / ".composer-system-missing"
"""The Debian packages scripts/setup.sh could not install for this environment, one `packages: apt's error` a line."""


def not_installed(packages: str, record: Path = SYSTEM_MISSING) -> str:
    """The skip reason of a test that needs Debian's `packages` (named as scripts/setup.sh names them): the failed
    install that setup.sh recorded, else how to install them."""
    failures = dict(line.split(": ", 1) for line in record.read_text().splitlines() if ": " in line) if record.is_file() else {}
    if packages in failures:
        return f"scripts/setup.sh could not install {packages} ({failures[packages]}); its next run tries again"
    return f"{packages} not installed (apt-get install {packages}; scripts/setup.sh does as root)"


SSHD = "/usr/sbin/sshd"


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """An OpenSSH server on 127.0.0.1 with its own host key; yields (port, client key, known_hosts, workdir)."""
    if not os.path.exists(SSHD) or not shutil.which("ssh-keygen"):
        pytest.skip(not_installed("openssh-server"))
    d = tmp_path_factory.mktemp("sshd")
    host_pub = keygen(d / "host_key")
    client_pub = keygen(d / "client_key")
    (d / "authorized_keys").write_text(client_pub + "\n")
    port = free_port()
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    proc = subprocess.Popen(
        [
            SSHD,
            "-D",
            "-e",
            "-f",
            "/dev/null",
            "-p",
            str(port),
            "-h",
            str(d / "host_key"),
            "-o",
            "ListenAddress=127.0.0.1",
            "-o",
            f"AuthorizedKeysFile={d / 'authorized_keys'}",
            "-o",
            f"PidFile={d / 'sshd.pid'}",
            "-o",
            "StrictModes=no",
            "-o",
            "Subsystem sftp internal-sftp",
            "-o",
            "PermitRootLogin=prohibit-password",
        ],
        stderr=open(d / "sshd.log", "wb"),
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()}")
            time.sleep(0.05)
    known_hosts = d / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {' '.join(host_pub.split()[:2])}\n")
    try:
        yield port, d / "client_key", known_hosts, d
    finally:
        proc.terminate()
        proc.wait(timeout=10)
