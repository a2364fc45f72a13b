"""Megatron optimizer + distributed checkpoints on CPU: a resumed run continues exactly."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Train 3 steps, checkpoint, train 3 more; then a fresh model and optimizer resume from the checkpoint."""
    ckpt = tmp_path_factory.mktemp("train_state") / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.helpers.workers.train_state", str(ckpt)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return ckpt, json.loads(result.stdout.strip().splitlines()[-1])


def test_resume_continues_bitwise_with_schedule(run):
    _, out = run
    assert out["resumed"] == out["uninterrupted"]  # losses, learning rates and grad norms
    lrs = [row[1] for row in out["first"] + out["uninterrupted"]]
    assert lrs[0] < lrs[4]  # warmup raises the learning rate
    losses = [row[0] for row in out["first"] + out["uninterrupted"]]
    assert losses[-1] < losses[0]
    assert out["state"]["marker"] == 3 and out["state"]["step"] == 3
    assert out["kept"] == ["latest", "step-00000002", "step-00000003"]  # keep_checkpoints=2, no temp dirs


def test_resume_with_another_model_parallel_layout_is_refused(run):
    from composer.recipes.errors import UserError
    from composer.trainer.checkpointing import Checkpointer

    checkpointer = Checkpointer(run[0], keep=2)
    with pytest.raises(UserError, match=r"cannot resume with another model-parallel layout \(tp=1 in the checkpoint, 2 now\)"):
        checkpointer.load(checkpointer.latest(), None, None, {"tp": 2, "pp": 1, "ep": 1, "etp": 1, "cp": 1})
