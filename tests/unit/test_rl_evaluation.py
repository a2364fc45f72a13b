"""Held-out evaluation in RL: the split the task pool owns, the pass@k estimator, intervals, recipe checks."""

import math
import random
from itertools import combinations

import numpy as np
import pytest

from composer.recipes.env_schema import EnvSection, TaskSet
from composer.recipes.errors import UserError
from composer.recipes.schema import RLEvalSection
from composer.rl.evaluation import bootstrap_interval, held_out_sets, pass_at_k
from composer.rollout.agent.environment import CodingEnvironment
from composer.rollout.tasks.pool import held_out_split


def test_pass_at_k_is_the_unbiased_estimator():
    # the probability that at least one of k samples drawn without replacement from n passes, counted exactly
    n, c = 6, 2
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        draws = list(combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))
    assert pass_at_k(4, 0, 1) == 0 and pass_at_k(4, 4, 4) == 1 and pass_at_k(5, 1, 1) == pytest.approx(0.2)


def test_bootstrap_interval_covers_the_mean_and_narrows_with_tasks():
    rng = np.random.default_rng(0)
    small, large = rng.random(20) < 0.3, rng.random(2000) < 0.3
    lo, hi = bootstrap_interval(small)
    assert lo < small.mean() < hi
    lo2, hi2 = bootstrap_interval(large)
    assert hi2 - lo2 < (hi - lo) / 5
    assert bootstrap_interval(np.ones(10)) == (1.0, 1.0)


def test_held_out_split_is_fixed_disjoint_and_independent_of_the_training_seed():
    ts = TaskSet(name="smoke", limit=50, held_out=10)
    training, held_out = held_out_split(ts, 100)
    assert len(held_out) == 10 and not set(training) & set(held_out) and sorted(training + held_out) == list(range(50))
    assert held_out_split(ts, 100) == (training, held_out)
    with pytest.raises(UserError, match="leave some to train on"):
        held_out_split(TaskSet(name="smoke", limit=5, held_out=5), 100)


def test_training_never_draws_a_held_out_task(tmp_path):
    env = CodingEnvironment(EnvSection(tasks=[TaskSet(name="smoke", held_out=30)]), seed=3, sandbox_root=tmp_path)
    [evaluated] = held_out_sets(RLEvalSection(tasks=["smoke"]), env.pool.task_sets, env, seed=3)
    held = {t.id for t in evaluated.tasks}
    assert len(held) == 30
    drawn = {env.pool.draw(random.Random(f"1234/{n}")).id for n in range(2000)}  # as the rollout worker draws group n
    assert len(drawn) == 70 and not drawn & held


def test_a_set_not_trained_on_is_held_out_whole(tmp_path):
    env = CodingEnvironment(EnvSection(tasks=[TaskSet(name="smoke", held_out=5)]), seed=0, sandbox_root=tmp_path)
    [whole] = held_out_sets(RLEvalSection(tasks=["humaneval"], limit=7), env.pool.task_sets, env, seed=0)
    assert [t.id for t in whole.tasks] == [f"HumanEval/{i}" for i in range(7)]


def test_recipe_check_refuses_evaluating_on_training_tasks(composer, write_recipe):
    from tests.conftest import RECIPES

    base = (RECIPES / "smoke-rl.yaml").resolve()
    path = write_recipe(f"extends: {base}\nenv:\n  tasks:\n    - name: smoke\nrl:\n  eval:\n    tasks: [smoke]\n")
    result = composer("recipe", "validate", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "env.tasks.0.held_out" in result.stderr + result.stdout
    bad_k = write_recipe(f"extends: {base}\nrl:\n  eval:\n    tasks: [smoke]\n    samples: 2\n    pass_k: [1, 4]\n", "k.yaml")
    result = composer("recipe", "validate", str(bad_k))
    assert result.returncode == 2 and "pass_k" in result.stderr + result.stdout


def test_interval_math_matches_a_normal_approximation():
    values = np.array([1.0] * 30 + [0.0] * 70)
    lo, hi = bootstrap_interval(values)
    half = 1.96 * math.sqrt(0.3 * 0.7 / 100)
    assert lo == pytest.approx(0.3 - half, abs=0.02) and hi == pytest.approx(0.3 + half, abs=0.02)


def test_evaluations_are_due_once_per_window_at_the_start_and_at_the_end(tmp_path):
    import json

    from composer.rl.evaluation import Evaluator

    tasks = [TaskSet(name="smoke", held_out=10)]
    env = CodingEnvironment(EnvSection(tasks=tasks), seed=0, sandbox_root=tmp_path / "sandbox")
    config = RLEvalSection(tasks=["smoke"], every=10)
    evaluator = Evaluator(config, tasks, env, steps=25, seed=0, root=tmp_path)
    assert [v for v in (0, 0, 3, 11, 10, 19, 20, 24, 25, 25) if evaluator.claim(v)] == [0, 11, 20, 25]
    evaluator.close()
    # a resumed driver does not redo what eval_metrics.jsonl holds (v0 and v12), even for another version of a window
    (tmp_path / "eval_metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 12)))
    resumed = Evaluator(config, tasks, env, steps=25, seed=0, root=tmp_path)
    assert [v for v in (1, 13, 20, 25) if resumed.claim(v)] == [20, 25]
    resumed.close()


@pytest.mark.parametrize("after, exit_code", [(1, 0), (0, 1)], ids=["learned", "not-shown"])
def test_the_learning_benchmark_exits_non_zero_when_learning_is_not_shown(tmp_path, after, exit_code):
    """benchmarks/rl_learning.py --report on a finished run: all held-out tasks solved after none before is learning;
    the same results before and after is not, and the benchmark says so in its exit status."""
    import json
    import subprocess
    import sys

    from composer.recipes.loader import load_recipe, recipe_to_yaml
    from tests.conftest import RECIPES, REPO

    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "recipe.yaml").write_text(recipe_to_yaml(load_recipe(RECIPES / "smollm2-rl.yaml", ["train.steps=2"])))
    for version, solved in (("v000000", 0), ("v000002", after)):
        tasks = {f"rgym/sum/{i}": {"greedy": bool(solved), "samples": 0, "correct": 0} for i in range(20)}
        (run / "eval" / f"{version}.json").write_text(json.dumps(tasks))
    (run / "eval_metrics.jsonl").write_text(
        "".join(json.dumps({"step": step, "time": 100.0 * (step + 1), "eval_seconds": 10.0}) + "\n" for step in (0, 2))
    )
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": step, "reward_mean": 0.5, "response_tokens_mean": 40.0, "uniform_group_fraction": 0.0}) + "\n"
            for step in (1, 2)
        )
    )
    done = subprocess.run(
        [sys.executable, "benchmarks/rl_learning.py", "--report", str(run)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == exit_code, done.stdout + done.stderr
    assert ("LEARNED" if after else "NOT shown") in done.stdout


def test_batches_skip_what_the_log_holds_and_keep_task_numbers(tmp_path):
    from composer.rl.evaluation import EvalSet, GradedEpisode, GradedLog, episode_batches
    from composer.rollout.tasks.functions import smoke_task

    tasks = [smoke_task(i) for i in range(5)]
    sets = [EvalSet("smoke", tasks, 0)]
    log = GradedLog(tmp_path / "graded.jsonl")
    batches = episode_batches(sets, samples=0, log=log, batch_tasks=2)  # greedy only
    assert [(b.mode, [n for n, _ in b.numbered]) for b in batches] == [("greedy", [0, 1]), ("greedy", [2, 3]), ("greedy", [4])]
    done = [GradedEpisode("smoke", tasks[n].id, "greedy", 0, True, 1.0, 4, 4, [], False, "solved", 1, 0, []) for n in (0, 2)]
    log.add(done)
    log.close()
    resumed = GradedLog(tmp_path / "graded.jsonl")  # what a rerun finds
    assert set(resumed.episodes) == {e.key for e in done}
    batches = episode_batches(sets, samples=4, log=resumed, batch_tasks=4)
    assert [(b.mode, [n for n, _ in b.numbered]) for b in batches] == [
        ("greedy", [1, 3, 4]),
        ("sampled", [0]),
        ("sampled", [1]),
        ("sampled", [2]),
        ("sampled", [3]),
        ("sampled", [4]),
    ]
    resumed.close()
