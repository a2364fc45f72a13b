"""Run directories, metrics and atomic writes: what resumable loops rely on."""

import os

import pytest

from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe, recipe_to_yaml
from composer.runtime.run_dir import MetricsWriter, RunDir, atomic_write_bytes, read_metrics
from tests.conftest import RECIPES


def test_run_dir_of_recipe_and_resolved_recipe_saved(tmp_path):
    recipe = load_recipe(RECIPES / "smoke-midtrain.yaml", [f"run.dir={tmp_path}"])
    run = RunDir.of(recipe)
    assert run.root == tmp_path / "smoke-midtrain"
    run.prepare(recipe_to_yaml(recipe), resume=False)
    assert load_recipe(run.recipe_path) == recipe
    assert run.logs.is_dir()


def test_fresh_start_refuses_existing_run_and_resume_needs_one(tmp_path):
    run = RunDir(tmp_path / "r")
    with pytest.raises(UserError, match="--resume: no run at"):
        run.prepare("x: 1\n", resume=True)
    run.prepare("x: 1\n", resume=False)
    with run.metrics() as m:
        m.write(1, loss=2.0)
    with pytest.raises(UserError, match="already holds a run; pass --resume"):
        run.prepare("x: 1\n", resume=False)
    run.prepare("x: 2\n", resume=True)
    assert run.recipe_path.read_text() == "x: 2\n"


def test_metrics_append_and_survive_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as m:
        m.write(1, loss=3.5, lr=0.1)
        m.write(2, loss=float("nan"))
    with path.open("a") as f:
        f.write('{"step": 3, "loss"')  # a writer killed mid-line
    records = list(read_metrics(path))
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss"] == 3.5 and records[1]["loss"] == "nan"
    with MetricsWriter(path) as m:  # reopening appends, never truncates
        m.write(4, loss=1.0)
    assert [r["step"] for r in read_metrics(path)][-1] == 4


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write_bytes(path, b"old")

    with pytest.raises(TypeError):
        atomic_write_bytes(path, object())  # write fails after the temp file exists
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_what_a_rank_forks_dies_with_the_rank():
    """Megatron forks its checkpoint writers without exec; a rank killed mid-save left them running for ever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    rank = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import os, time\n"
                "from composer.runtime.processes import die_with_parent\n"
                "die_with_parent(forks_too=True)\n"
                "child = os.fork()\n"
                "if child == 0:\n"
                "    time.sleep(60); os._exit(0)\n"
                "print(child, flush=True); time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    child = int(rank.stdout.readline())
    rank.kill()
    rank.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        if open(f"/proc/{child}/stat").read().split()[2] == "Z":
            return  # gone, waiting for init to reap it
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the forked child outlived its rank")
