"""The coding environment of RL: a seeded task pool, a sandbox, and the recipe's reward rule."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from recipes.errors import UserError
from recipes.schema import EnvSection
from rollout.graders import Statement, guarded_reward
from rollout.repo_tasks import RepoTests
from rollout.sandbox import Sandbox, SandboxResult, ScriptRun, case_tests
from rollout.tasks import Task, TaskPool

log = logging.getLogger("composer.env")


class CodingEnvironment:
    """Draws tasks and grades completions by running them against the hidden tests in the sandbox; the
    recipe's guards decide what a flagged episode earns, and a canary that scores raises the alarm."""

    def __init__(self, config: EnvSection, seed: int, sandbox_root: Path | None = None):
        self.sandbox = Sandbox(config.sandbox, root=sandbox_root)
        self.pool = TaskPool(config.tasks, self.sandbox, seed, canaries=config.canaries)
        self.reward = config.reward
        self.guards = config.guards

    def draw(self) -> Task:
        return self.pool.draw()

    def grade(self, task: Task, completion: str) -> SandboxResult:
        return self.grade_program(task, task.program(completion))

    def grade_program(self, task: Task, program: str) -> SandboxResult:
        if isinstance(task.tests, RepoTests):
            raise UserError(f"{task.id}: a repository task is graded through its workspace "
                            "(rollout.repo_tasks.open_workspace), not as one program")
        result = self.sandbox.run(program, task.tests, "all_or_nothing" if task.canary else self.reward)
        flags = result.flags
        if task.canary and result.reward > 0:
            log.warning("cheating alarm: canary %s scored %.2f (%d/%d); flags %s", task.id, result.reward,
                        result.passed, result.total, ", ".join(flags) or "none")
            flags = tuple(sorted({*flags, "canary_passed"}))
        reward = guarded_reward(result.reward, flags, tuple(self.guards.flags), self.guards.reward)
        return dataclasses.replace(result, reward=reward, flags=flags)

    def run(self, task: Task, completion: str) -> SandboxResult:
        """Run the program a completion makes for `task` as a script, no tests (the policy's RUN tool)."""
        return self.sandbox.run(task.program(completion), ScriptRun())


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


def check_references(env: CodingEnvironment, max_tasks: int | None, workers: int,
                     on_task: Callable[[str], None] = lambda task_set: None) -> list[ReferenceReport]:
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
