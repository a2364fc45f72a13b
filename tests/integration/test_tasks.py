"""Tasks with real hidden tests in the real sandbox: HumanEval, CodeI/O, rgym, smoke, the pool, code extraction, the CLI."""

import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from composer.recipes.env_schema import EnvSection, SandboxSection, TaskSet
from composer.rollout.agent.environment import CodingEnvironment
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.functions import (
    RGYM_DATASETS,
    RGYM_PER_DATASET,
    CodeIOSource,
    HumanEvalSource,
    ReasoningGymSource,
    extract_code,
    smoke_task,
)
from composer.rollout.tasks.pool import TaskPool
from tests.conftest import RECIPES

WORKERS = 4


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return Sandbox(SandboxSection(cpu_seconds=10, wall_seconds=20, memory_mb=1024), root=tmp_path_factory.mktemp("sandboxes"))


@pytest.fixture(scope="module")
def humaneval(sandbox):
    source = HumanEvalSource()
    return [source.task(i, sandbox) for i in range(len(source))]


def grade_all(sandbox, jobs):
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return list(pool.map(lambda job: sandbox.run(*job), jobs))


# --- extracting code ---------------------------------------------------------------------------


def test_extract_code_from_fences_or_raw_text():
    assert extract_code("Sure:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1"
    assert extract_code("```\nx = 1\n```") == "x = 1"
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut off by the token limit
    assert extract_code("    return x + 1\n\n") == "    return x + 1"  # a raw continuation keeps its indent
    two = "```python\nimport math\n```\nthen\n```python\ndef area(r):\n    return math.pi * r * r\n```"
    assert extract_code(two, "area").startswith("def area")
    assert extract_code(two) == "import math"
    assert extract_code("```bash\nrm -rf /\n```\nraw") == "```bash\nrm -rf /\n```\nraw"


# --- HumanEval ---------------------------------------------------------------------------------


def test_all_humaneval_canonical_solutions_score_one(sandbox, humaneval):
    assert len(humaneval) == 164
    # The canonical solution is a body that continues the prompt, as a completion model writes it.
    solutions = [t.reference[len(t.continues) :] for t in humaneval]
    results = grade_all(sandbox, [(t.program(s), t.tests) for t, s in zip(humaneval, solutions)])
    failed = {t.id: (r.status, r.detail, r.stderr_tail[-300:]) for t, r in zip(humaneval, results) if r.reward != 1.0}
    assert failed == {}
    assert all(r.total >= 1 for r in results)


def test_humaneval_whole_function_in_a_fence_scores_one(sandbox, humaneval):
    # A chat model answers with the whole function; the prompt's imports and helpers come first.
    sample = random.Random(0).sample(humaneval, 16)
    answers = []
    for t in sample:
        function = t.reference[t.reference.index(f"def {t.entry_point}(") :]
        answers.append(f"Here it is:\n```python\n{function}```\n")
    results = grade_all(sandbox, [(t.program(a), t.tests) for t, a in zip(sample, answers)])
    assert [r.reward for r in results] == [1.0] * len(sample)


def test_humaneval_empty_and_wrong_solutions_score_zero(sandbox, humaneval):
    # (A constant answer can pass a boolean task's `assert not candidate(...)`; this sample has none.)
    sample = random.Random(1).sample(humaneval, 24)
    empty = grade_all(sandbox, [(t.program(""), t.tests) for t in sample])
    wrong = grade_all(sandbox, [(t.program(f"```python\ndef {t.entry_point}(*args):\n    return object()\n```"), t.tests) for t in sample])
    assert [r.reward for r in empty] == [0.0] * len(sample)
    assert [r.reward for r in wrong] == [0.0] * len(sample)


def test_humaneval_partial_credit_per_assertion(sandbox, humaneval):
    task = next(t for t in humaneval if t.id == "HumanEval/0")  # has_close_elements, 7 assertions
    always_true = "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```"
    result = sandbox.run(task.program(always_true), task.tests)
    assert (result.passed, result.total) == (4, 7)


# --- CodeI/O -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def codeio():
    return CodeIOSource()


def test_codeio_loads_every_row(codeio):
    assert len(codeio) == 3002


def test_codeio_references_pass_their_hidden_tests_and_wrong_programs_do_not(sandbox, codeio):
    indices = random.Random(2).sample(range(len(codeio)), 12)
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        tasks = [t for t in pool.map(lambda i: codeio.task(i, sandbox), indices) if t is not None]
    assert len(tasks) >= 8
    assert all(len(t.tests.inputs) == 8 for t in tasks)
    references = grade_all(sandbox, [(t.reference, t.tests) for t in tasks])
    assert [r.reward for r in references] == [1.0] * len(tasks)
    wrong = "```python\ndef main_solution(**kwargs):\n    return None\n```"
    results = grade_all(sandbox, [(t.program(wrong), t.tests) for t in tasks])
    assert all(r.reward < 1.0 for r in results)


def test_codeio_tests_are_deterministic_and_hide_expected_outputs(sandbox, codeio):
    first, again = codeio.task(0, sandbox), codeio.task(0, sandbox)
    assert first.tests == again.tests
    # A program that returns its inputs and every string in its process's memory: no expected output is there.
    snoop = (
        "```python\nimport gc, sys\ndef main_solution(**kwargs):\n"
        "    return repr(kwargs) + repr(sys.argv) + repr([o for o in gc.get_objects() if isinstance(o, (dict, list, tuple))])[:1000000]\n```"
    )
    result = sandbox.run(first.program(snoop), first.tests)
    seen = " ".join(case.output or "" for case in result.cases)
    assert next(iter(json.loads(first.tests.inputs[0]))) in seen and result.reward == 0.0
    assert not any(expected in seen for expected in first.tests.expected)


# --- rgym ---------------------------------------------------------------------------------------


def test_rgym_answers_are_computed_by_the_program_and_checked_against_the_generator(sandbox):
    source = ReasoningGymSource()
    assert len(source) == len(RGYM_DATASETS) * RGYM_PER_DATASET
    tasks = [source.task(i, sandbox) for i in range(0, len(source), RGYM_PER_DATASET)]  # one per generator
    assert len({t.id for t in tasks}) == len(RGYM_DATASETS) and all("`answer()`" in t.prompt for t in tasks)
    bits = next(t for t in tasks if "count_bits" in t.id)
    number = int(bits.prompt.split("the number ")[1].split("?")[0])
    backward = next(t for t in tasks if "spell_backward" in t.id)
    word = backward.prompt.split("): ")[1].split()[0]
    completions = [(t, f"```python\n{t.reference}```", 1.0) for t in tasks] + [
        (bits, f"```python\ndef answer():\n    return bin({number}).count('1')\n```", 1.0),
        (bits, f"```python\ndef answer():\n    return bin({number}).count('0')\n```", 0.5),  # runs, returns an int
        (bits, f"```python\ndef answer():\n    return str(bin({number}).count('1'))\n```", 0.0),
        (bits, "```python\ndef count_bits(n):\n    return bin(n).count('1')\n```", 0.0),
        (backward, f"Here:\n```python\ndef answer():\n    return {word!r}[::-1]\n```", 1.0),
        (backward, f"```python\ndef answer():\n    return {word!r}\n```", 0.5 if word != word[::-1] else 1.0),
        (backward, "I do not know.", 0.0),
    ]
    results = grade_all(sandbox, [(t.program(c), t.tests) for t, c, _ in completions])
    assert [r.reward for r in results] == [reward for _, _, reward in completions]


def test_rgym_tasks_are_the_same_on_every_machine(sandbox):
    first, second = ReasoningGymSource(), ReasoningGymSource()
    assert [first.task(i, sandbox) for i in range(0, len(first), 97)] == [second.task(i, sandbox) for i in range(0, len(second), 97)]
    chain_sum = first.task(RGYM_DATASETS.index("chain_sum") * RGYM_PER_DATASET, sandbox)  # seeded by the generator's name
    assert chain_sum.id == "rgym/chain_sum/0" and "9 + 1 =" in chain_sum.prompt and chain_sum.tests.cases[-1] == "assert candidate() == 10"


# --- smoke -------------------------------------------------------------------------------------


def test_smoke_task_rewards_steps_toward_the_answer(sandbox):
    task = smoke_task(3)
    k = int(task.reference.split("return ")[1])
    assert f"Return {k}." in task.prompt and task.prompt.endswith("return")
    near = (k + 1) if k < 9 else (k - 1)
    far = k + 50
    answers = {
        str(k): 1.0,
        f" {k}  trailing words are ignored": 1.0,
        str(near): 0.75,
        str(far): 0.5,
        "'text'": 0.25,
        "": 0.0,
        "undefined_name": 0.0,
        "3+": 0.0,
        "False": 0.5 + 0.25 * (k <= 2) + 0.25 * (k == 0),
    }  # bools are ints: a step toward numbers
    results = grade_all(sandbox, [(task.program(a), task.tests) for a in answers])
    assert {a: r.reward for a, r in zip(answers, results)} == answers


def test_smoke_tasks_are_deterministic():
    assert smoke_task(7) == smoke_task(7)
    assert len({smoke_task(i).reference for i in range(100)}) == 10


# --- the pool ----------------------------------------------------------------------------------


def draw_ids(pool: TaskPool, n: int) -> list[str]:
    return [pool.draw().id for _ in range(n)]


def test_pool_draws_are_reproducible_weighted_and_limited(sandbox):
    sets = [TaskSet(name="smoke", weight=3.0), TaskSet(name="humaneval", weight=1.0, limit=5)]
    draws = draw_ids(TaskPool(sets, sandbox, seed=11), 400)
    assert draws == draw_ids(TaskPool(sets, sandbox, seed=11), 400)
    assert draws != draw_ids(TaskPool(sets, sandbox, seed=12), 400)
    families = Counter(d.split("/")[0] for d in draws)
    assert 240 <= families["smoke"] <= 360  # weight 3 : 1
    assert {d for d in draws if d.startswith("HumanEval")} <= {f"HumanEval/{i}" for i in range(5)}


def test_pool_skips_and_counts_codeio_rows_whose_reference_fails(sandbox):
    pool = TaskPool([TaskSet(name="codeio", limit=92)], sandbox, seed=0)
    assert pool.task(0, 91) is None  # its input generator calls a function that does not exist
    assert pool.task(0, 90).id == "codeio/90"
    assert pool.skipped == {"codeio": 1}
    assert 91 not in pool.indices(0) and len(pool.indices(0)) == 91


def test_environment_grades_with_the_recipe_reward_rule(tmp_path):
    config = EnvSection(tasks=[TaskSet(name="smoke")], reward="all_or_nothing", sandbox=SandboxSection(cpu_seconds=5, wall_seconds=10))
    env = CodingEnvironment(config, seed=0, sandbox_root=tmp_path)
    task = env.draw()
    k = int(task.reference.split("return ")[1])
    assert env.grade(task, f"```python\n{k}\n```").reward == 1.0
    wrong = env.grade(task, str((k + 1) % 10))
    assert wrong.passed >= 2 and wrong.reward == 0.0  # some tests pass, but not all


# --- the CLI -----------------------------------------------------------------------------------


def test_env_check_reports_reference_pass_rates(composer, write_recipe):
    recipe = write_recipe(
        f"extends: {RECIPES / 'smoke-rl.yaml'}\n"
        "env:\n  tasks:\n    - {name: smoke, limit: 4}\n    - {name: humaneval, limit: 4}\n    - {name: codeio, limit: 3}\n"
        "rl: {eval: null}\n"  # nothing is held out here to evaluate on
    )
    result = composer("env", "check", str(recipe), "--workers", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 5}
    assert set(rows) >= {"smoke", "humaneval", "codeio"}
    assert "100.0%" in rows["smoke"] and "100.0%" in rows["humaneval"]
    text = " ".join(result.stdout.split())
    for protected in ("humaneval: 4/4", "codeio: 3/3", "smoke: 4/4"):
        assert f"{protected} task(s) fully protected" in text


def test_env_check_needs_an_env_section(composer):
    result = composer("env", "check", str(RECIPES / "smoke-midtrain.yaml"))
    assert result.returncode == 2
    assert "no `env` section" in result.stderr and "Traceback" not in result.stderr
