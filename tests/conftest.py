import contextlib
import os
import subprocess
import sys
from pathlib import Path

# One intra-op thread per process: measured faster for these tiny models on 2 cores, and tests start several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


COMPOSER = [sys.executable, "-m", "cli"]


def run_composer(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real `composer` CLI in a fresh interpreter, as a user would (wide enough that rich wraps nothing)."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*COMPOSER, *args], cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def composer():
    return run_composer


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
