"""Task references as agent episodes in the harness (the `references` SFT source).

A task's known-good answer is played through the harness's own tools on a fresh workspace of the task, in the
sandbox, and recorded as the conversation an agent would have had: every observation is the tool's real output.

- A function task: `write_file` solution.py with the reference solution, `run_tests`, `finish`.
- A `recall` task: `read_file` each part in order, one a turn, as its prompt asks, then as a function task (the
  codes written are the ones the reads showed: the demonstration never answers what it did not read).
- A repository task: for each file the task changed (its layer), `search` for the definition of each function of the
  task's scope (where it names functions), `read_file` the lines around each change, then `edit` calls that turn the
  file into the reference's version (the original of a bug, feature or multi task, the commit's source of a history
  task: the grading base's file), each `old_string` the smallest run of whole lines that occurs once; then
  `run_tests` and `finish`.

An episode counts only when the workspace then grades 1.0; a task whose reference does not is skipped (counted).
Only the tasks RL draws are played (`TaskPool.indices`): held-out tasks are never demonstrated.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from composer.rollout.agent.environment import SOLUTION_FILE, CodingEnvironment
from composer.rollout.agent.harness import MAX_READ_LINES, ToolBox, ToolCall
from composer.rollout.tasks.functions import Task
from composer.rollout.tasks.repository.grading_policy import package_of
from composer.rollout.tasks.repository.workspace import RepoTests

READ_CONTEXT = 6
"""Lines shown before and after a change that lies outside any function."""
MAX_READ_SPAN = 120
"""Longest function read whole around a change (a longer one is read a few lines either side of it)."""


def reference_edits(current: str, target: str) -> list[tuple[str, str]] | None:
    """(old_string, new_string) pairs the `edit` tool applies in order to turn `current` into `target`: each change
    of a line diff with the fewest surrounding lines that make `old_string` occur exactly once at that moment; None
    when some change has no such context (a file that repeats itself: write it whole instead)."""
    edits = []
    while current != target:
        a, b = current.splitlines(keepends=True), target.splitlines(keepends=True)
        opcodes = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
        k, (_, i1, i2, j1, j2) = next((k, op) for k, op in enumerate(opcodes) if op[0] != "equal")
        # Context is taken from the lines the two share: all lines before the first change, and the equal block after.
        after = opcodes[k + 1][2] - opcodes[k + 1][1] if k + 1 < len(opcodes) and opcodes[k + 1][0] == "equal" else 0
        for grow in range(max(i1, after) + 1):
            lo, hi = max(0, i1 - grow), i2 + min(grow, after)
            old = "".join(a[lo:hi])
            if old and current.count(old) == 1:
                break
        else:
            return None
        new = "".join(b[j1 - (i1 - lo) : j2 + (hi - i2)])
        edits.append((old, new))
        current = current.replace(old, new, 1)
    return edits


def read_ranges(text: str, changed_lines: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """1-based (start, end) line ranges to read before editing: the innermost function around each change (from its
    decorators) when it has at most MAX_READ_SPAN lines, else a few lines either side; overlapping ranges merged."""
    lines = max(1, len(text.splitlines()))
    try:
        functions = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    except (SyntaxError, ValueError):
        functions = []
    ranges = []
    for first, last in changed_lines:
        around = [
            (min([n.lineno, *(d.lineno for d in n.decorator_list)]), n.end_lineno or n.lineno)
            for n in functions
            if n.lineno <= first and (n.end_lineno or n.lineno) >= last
        ]
        start, end = min(around, key=lambda r: r[1] - r[0]) if around else (first - READ_CONTEXT, last + READ_CONTEXT)
        if end - start + 1 > MAX_READ_SPAN:
            start, end = first - READ_CONTEXT, last + READ_CONTEXT
        ranges.append((max(1, start), min(lines, end, max(1, start) + MAX_READ_LINES - 1)))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _changed_lines(current: str, target: str) -> list[tuple[int, int]]:
    a, b = current.splitlines(), target.splitlines()
    spans = []
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            spans.append((i1 + 1, max(i1 + 1, i2)))  # an insertion is shown at the line it goes before
    return spans


def repo_reference_calls(tests: RepoTests, read: Callable[[str], str]) -> list[ToolCall]:
    """The tool calls of a repository task's reference episode up to its run_tests: `read(path)` gives the
    workspace's text of a file (the task's changed state)."""
    functions = {scope.path: scope.functions for scope in tests.scope}
    calls = []
    for path in sorted(str(p.relative_to(tests.layer)) for p in Path(tests.layer).rglob("*") if p.is_file()):
        current, target = read(path), (tests.grading_base / path).read_text()
        if current == target:
            continue
        for function in functions.get(path, ()):
            name = function.rsplit(".", 1)[-1]
            calls.append(ToolCall("search", {"pattern": rf"def {re.escape(name)}\(", "path": package_of(path, tests.packages) or path}))
        for start, end in read_ranges(current, _changed_lines(current, target)):
            calls.append(ToolCall("read_file", {"path": path, "start_line": start, "end_line": end}))
        edits = reference_edits(current, target)
        if edits is None:
            calls.append(ToolCall("write_file", {"path": path, "content": target}))
        else:
            calls += [ToolCall("edit", {"path": path, "old_string": old, "new_string": new}) for old, new in edits]
    return calls


Observe = Callable[[str, str], str]
"""A tool output's text and its `more` hint -> what the episode shows of it."""


def whole(text: str, more: str) -> str:
    return text


def reference_messages(env: CodingEnvironment, task: Task, toolbox: ToolBox, observe: Observe = whole) -> list[dict] | None:
    """A task's reference as the harness's episode (real tool outputs from a real workspace and sandbox, each shown as
    `observe` gives it), or None when the workspace does not grade 1.0 after it."""
    messages = [{"role": "user", "content": env.task_prompt(task, tools=True)}]
    workspace = env.open_workspace(task, tools=True)
    try:
        if isinstance(task.tests, RepoTests):
            steps = repo_reference_calls(task.tests, workspace.read_file)
        elif task.family == "recall":
            reads = [ToolCall("read_file", {"path": path}) for path, _ in task.files]
            steps = [*reads, ToolCall("write_file", {"path": SOLUTION_FILE, "content": task.reference})]
        else:
            steps = [ToolCall("write_file", {"path": SOLUTION_FILE, "content": task.reference})]
        for call in [*steps, ToolCall("run_tests", {}), ToolCall("finish", {})]:
            output = toolbox.call(workspace, call)
            if output.text.startswith("error:") and call.name != "search":
                return None  # a step the harness refused: not a demonstration
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}],
                }
            )
            if not output.finished:
                messages.append({"role": "tool", "name": call.name, "content": observe(output.text, output.more)})
        passed = env.grade_workspace(workspace).reward == 1.0
    finally:
        workspace.close()
    return messages if passed else None


def reference_episodes(env: CodingEnvironment, toolbox: ToolBox, observe: Observe = whole) -> Iterator[tuple[str, list[dict] | None]]:
    """(where, messages or None when skipped) for every training task of the environment's task sets with a
    reference (function tasks with one, every repository task), in task order; the sandbox runs them concurrently."""
    work = []
    for set_index, task_set in enumerate(env.pool.task_sets):
        for index in env.pool.indices(set_index):  # never the held-out tasks
            work.append((task_set.name, set_index, index))

    def play(item: tuple[str, int, int]) -> tuple[str, list[dict] | None]:
        name, set_index, index = item
        task = env.pool.task(set_index, index)
        if task is None or not (task.reference or isinstance(task.tests, RepoTests)):
            return f"{name} task {index}", None
        return f"{name} task {task.id}", reference_messages(env, task, toolbox, observe)

    pool = ThreadPoolExecutor(max_workers=max(1, env.sandbox.max_concurrent))
    try:
        yield from pool.map(play, work)
    finally:  # a refusal stops the episodes not yet started
        pool.shutdown(cancel_futures=True)
