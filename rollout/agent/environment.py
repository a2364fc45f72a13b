"""The coding environment of RL: a seeded task pool, a sandbox, the recipe's reward rule, and the workspaces episodes
work in (a function task's is one file, solution.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from composer.recipes.env_schema import EnvSection
from composer.recipes.errors import UserError
from composer.recipes.schema import SSHSection
from composer.rollout.sandbox.graders import case_tests, guarded_reward
from composer.rollout.sandbox.hosts import SandboxFleet
from composer.rollout.sandbox.results import CommandResult, SandboxResult, Statement
from composer.rollout.sandbox.trees import remove_tree
from composer.rollout.tasks.files import PathRefused, read_text, write_text
from composer.rollout.tasks.functions import Task, defines
from composer.rollout.tasks.pool import TaskPool
from composer.rollout.tasks.repository.remote import open_repo_workspace
from composer.rollout.tasks.repository.workspace import RepoTests
from composer.rollout.tasks.workspace import Workspace, is_full, mount_capped, owned_dir, reclaim, unmount

log = logging.getLogger("composer.env")

SOLUTION_FILE = "solution.py"
FUNCTION_TOOLS_NOTE = (
    "\n\n[Your workspace holds solution.py, which starts as the code above. Make `{entry_point}` in "
    "solution.py correct with the tools; the hidden tests call it once you finish.]\n"
)


class CodingEnvironment:
    """Draws tasks and grades completions by running them against the hidden tests in the sandbox fleet
    (`env.sandbox.hosts`, remote ones reached with `ssh`); the recipe's guards decide what a flagged episode
    earns, and a canary that scores raises the alarm."""

    def __init__(self, config: EnvSection, seed: int, sandbox_root: Path | None = None, ssh: SSHSection | None = None):
        self.sandbox = SandboxFleet(
            config.sandbox, ssh or SSHSection(), root=sandbox_root, weights={t.name: t.weight for t in config.tasks}
        )
        try:
            self.pool = TaskPool(config.tasks, self.sandbox, seed, canaries=config.canaries)
        except BaseException:
            self.sandbox.close()
            raise
        self.reward = config.reward
        self.guards = config.guards

    def draw(self) -> Task:
        return self.pool.draw()

    def grade(self, task: Task, completion: str) -> SandboxResult:
        return self.grade_program(task, task.program(completion))

    def grade_program(self, task: Task, program: str) -> SandboxResult:
        if isinstance(task.tests, RepoTests):
            raise UserError(
                f"{task.id}: a repository task is graded through its workspace "
                "(rollout.tasks.repository.task_set.open_workspace), not as one program"
            )
        result = self.sandbox.run(program, task.tests, "all_or_nothing" if task.canary else self.reward, task_set=task.family)
        flags = result.flags
        if task.canary and result.reward > 0:
            log.warning(
                "cheating alarm: canary %s scored %.2f (%d/%d); flags %s",
                task.id,
                result.reward,
                result.passed,
                result.total,
                ", ".join(flags) or "none",
            )
            flags = tuple(sorted({*flags, "canary_passed"}))
        return self._guarded(dataclasses.replace(result, flags=flags))

    def close(self) -> None:
        self.sandbox.close()

    def _guarded(self, result: SandboxResult) -> SandboxResult:
        """`result` with the reward the recipe's guards give its flags (applying them twice changes nothing)."""
        return dataclasses.replace(result, reward=guarded_reward(result.reward, result.flags, tuple(self.guards.flags), self.guards.reward))

    def task_prompt(self, task: Task, tools: bool) -> str:
        """What the policy is told of `task` (with tools, where a function task's work goes)."""
        if isinstance(task.tests, RepoTests) or not tools:
            return task.prompt
        return task.prompt + FUNCTION_TOOLS_NOTE.format(entry_point=task.entry_point)

    def open_workspace(self, task: Task, tools: bool) -> Workspace:
        """A fresh workspace for an episode of `task` (a repository task's view of its project, else solution.py);
        the caller closes it."""
        if isinstance(task.tests, RepoTests):
            return open_repo_workspace(self.sandbox, task.tests, self.reward)
        return FunctionWorkspace(self, task, tools)

    def grade_workspace(self, workspace: Workspace) -> SandboxResult:
        """The workspace's grade, through the recipe's guards (a repository task's flags, e.g. `tests_modified`)."""
        return self._guarded(workspace.grade())


class FunctionWorkspace(Workspace):
    """The one-file workspace of a function task: solution.py in a directory of its own, graded as the program the
    hidden tests score (through the guards). With tools it starts as the task's code (the signature and docstring to
    complete), and the prompt's imports and helpers go before it at grading as they do for a reply; without tools each
    reply's program replaces it whole."""

    def __init__(self, env: CodingEnvironment, task: Task, tools: bool):
        self._env = env
        self._task = task
        self._preamble = f"{task.preamble}\n\n" if tools and task.preamble else ""
        area = env.sandbox.root / "workspaces"  # beside the repository tasks' views
        area.mkdir(parents=True, exist_ok=True)
        reclaim(area)  # what a killed driver left
        self.root = owned_dir("solution-", area)
        # As root, on a tmpfs of the workspace's cap: what the episode's commands write stays within it.
        self._capped = os.geteuid() == 0
        if self._capped:
            config = env.sandbox.config
            mount_capped(self.root, config.workspace_max_write_mb << 20, config.workspace_max_inodes)
            os.chmod(self.root, 0o777)
        write_text(self.root, SOLUTION_FILE, task.continues if tools and defines(task.continues, task.entry_point) else "")
        for path, text in task.files if tools else ():
            write_text(self.root, path, text)

    def shell(self, command: str, timeout_s: float) -> CommandResult:
        result = self._env.sandbox.local.run_command(command, self.root, timeout_s)
        if self._capped and is_full(self.root):
            result = dataclasses.replace(result, flags=tuple(sorted({*result.flags, "write_limit"})))
        return result

    def run_tests(self) -> CommandResult:
        """The hidden tests' verdict on solution.py: how many pass and the first failure's reason, never the tests."""
        result = self.grade()
        lines = [f"{result.passed}/{result.total} tests passed ({result.status})."] + ([result.detail[:400]] if result.detail else [])
        return CommandResult(
            0 if result.reward == 1.0 else 1, result.status, "\n".join(lines), result.wall_seconds, infra_failure=result.infra_failure
        )

    def grade(self) -> SandboxResult:
        try:
            solution = read_text(self.root, SOLUTION_FILE)
        except (PathRefused, OSError):  # removed, made a symlink or a directory: nothing to score
            solution = ""
        return self._env.grade_program(self._task, self._preamble + solution)

    def close(self) -> None:
        if self._capped:
            unmount(self.root)
            self._capped = False
        remove_tree(self.root)


@dataclass
class ReferenceReport:
    """How the reference solutions of one task set fare against their own hidden tests."""

    task_set: str
    checked: int = 0
    passed: int = 0
    skipped: int = 0
    wall_seconds: float = 0.0
    failures: list[tuple[str, SandboxResult]] = field(default_factory=list)
    all_calls: int = 0
    """Tasks whose every case is a (call, expected) pair (no test code runs at grading time)."""
    by_statements: list[tuple[str, str]] = field(default_factory=list)
    """Tasks with cases judged by their own test statements (in the grader), and the first reason."""


def check_references(
    env: CodingEnvironment, max_tasks: int | None, workers: int, on_task: Callable[[str], None] = lambda task_set: None
) -> list[ReferenceReport]:
    """Run every task set's reference solutions (its first `max_tasks` tasks, all when None) in the sandbox."""
    reports = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for set_index, task_set in enumerate(env.pool.task_sets):
            if task_set.name == "repo":
                continue  # no reference solutions: `repo_tasks.check_repo_tasks` tests originals and changes
            report = ReferenceReport(task_set.name)
            indices = env.pool.indices(set_index)[:max_tasks]

            def check(index: int, set_index: int = set_index) -> tuple[Task | None, SandboxResult | None]:
                task = env.pool.task(set_index, index)
                result = env.sandbox.run(task.reference, task.tests, "all_or_nothing") if task else None
                on_task(env.pool.task_sets[set_index].name)
                return task, result

            for task, result in pool.map(check, indices):
                if task is None:
                    report.skipped += 1
                    continue
                report.checked += 1
                report.wall_seconds += result.wall_seconds
                cases = case_tests(task.tests)
                statements = [c.reason for c in cases.cases if isinstance(c, Statement)]
                if statements:
                    report.by_statements.append((task.id, statements[0]))
                else:
                    report.all_calls += 1
                if result.reward == 1.0 and result.status == "ok" and not result.flags:
                    report.passed += 1
                else:
                    report.failures.append((task.id, result))
            reports.append(report)
    return reports
