"""Run directories, metrics and atomic writes: what resumable loops rely on."""

import os

import pytest

from recipes.errors import UserError
from recipes.loader import load_recipe, recipe_to_yaml
from recipes.runs import MetricsWriter, RunDir, atomic_write_bytes, read_metrics
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
