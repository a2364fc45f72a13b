import os
import subprocess
import sys
from pathlib import Path

# One intra-op thread per process: measured faster for these tiny models on 2 cores, and tests start several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


def run_composer(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real `composer` CLI in a fresh interpreter, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout
    )


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
