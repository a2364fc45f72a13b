"""Workspaces: an episode's writable files and the sandboxed commands that act on them.

A `Workspace` is what the agent harness works with, whatever the task: the one-file workspace of function tasks
(HumanEval, CodeI/O, smoke) or a repository task's copy-on-write view of its project (`RepoWorkspace`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rollout.sandbox import CommandResult, SandboxResult


class Workspace(Protocol):
    root: Path
    """The episode's writable view of the task's files, on the host (at /sandbox inside the sandbox)."""

    def shell(self, command: str, timeout_s: float) -> CommandResult:
        """Run `command` in the sandbox, in `root`."""
        ...

    def run_tests(self) -> CommandResult:
        """The agent-visible test run (what "run the tests" shows)."""
        ...

    def grade(self) -> SandboxResult:
        """The trusted, guarded grade of the final state (reward, flags)."""
        ...

    def close(self) -> None:
        """Destroy the view and everything the episode started."""
        ...
