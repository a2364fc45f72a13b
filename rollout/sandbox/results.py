"""What the sandbox is asked to run and what it reports: the tests of a function task, as the grader runs them
(calls, statements, assertions, generated inputs, a script), and the results of a program run or a shell command.
Plain types only: every part of the sandbox (the grader, the hosts' server, the fleet) imports them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

_INVISIBLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def visible(text: str) -> str:
    """Text from a run made safe to show a person (console, logs, the report, flag details): every control character
    but newline and tab (ESC, so ANSI/OSC sequences; BEL, CR, backspace, NUL, C1 bytes) and the bidirectional and
    zero-width format characters written as visible escapes (`\\x1b`, `\\u202e`), nothing left to interpret. Applying it
    twice changes nothing."""
    return _INVISIBLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def _make_visible(result, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(result, name)
        shown = tuple(map(visible, value)) if isinstance(value, tuple) else visible(value)
        if shown != value:
            object.__setattr__(result, name, shown)


Status = Literal["ok", "timeout", "memory", "crash", "infra"]
RewardMode = Literal["fraction", "all_or_nothing"]
Compare = Literal["==", "is", "is not", "truthy", "falsy", "close", "within", "isinstance", "json"]


# --- tests, as the grader runs them ------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """Call the entry point on `args`/`kwargs` (plain data); passes when the output compares to `expected`."""

    args: tuple = ()
    kwargs: tuple[tuple[str, object], ...] = ()
    expected: object = None
    compare: Compare = "=="
    tolerance: float = 0.0
    """For "close": |output - expected| < tolerance; for "within": <= tolerance."""
    seed: int | None = None
    """Reseed `random` (and numpy) before the call; None keeps the state the program left."""


@dataclass(frozen=True)
class Statement:
    """A statement of the tests, run in the grader with `candidate` calling the entry point in the sandbox."""

    code: str
    reason: str
    """Why it is not a Call."""


@dataclass(frozen=True)
class CaseTests:
    entry_point: str
    cases: tuple[Call | Statement, ...]
    setup: str = ""
    """Trusted code (test helpers, the prompt's helpers) run in the grader before the Statements."""
    seed: int = 0
    """Seeds `random` in the sandbox before the program loads."""


@dataclass(frozen=True)
class AssertionTests:
    """Test statements on `candidate` (the entry point), `setup` (trusted test code) first; a case passes
    when its statement runs without raising. Graded as `graders.rewrite_assertions` rewrites them."""

    entry_point: str
    setup: str
    cases: tuple[str, ...]


@dataclass(frozen=True)
class CallTests:
    """Call the entry point on JSON keyword arguments; the outputs are compared as JSON values."""

    entry_point: str
    inputs: tuple[str, ...]
    expected: tuple[str, ...]
    seed: int


@dataclass(frozen=True)
class GeneratedCalls:
    """Draw inputs from the program's own generator and record the entry point's outputs (builds CallTests)."""

    entry_point: str
    generator: str
    count: int
    seed: int


@dataclass(frozen=True)
class ScriptRun:
    """No tests: run the program as a script (`__name__ == "__main__"`); what it prints is the result."""


Tests = AssertionTests | CallTests | GeneratedCalls | ScriptRun | CaseTests


@dataclass(frozen=True)
class CaseResult:
    ok: bool
    error: str | None = None
    input: str | None = None
    output: str | None = None


@dataclass(frozen=True)
class SandboxResult:
    reward: float
    passed: int
    total: int
    status: Status
    detail: str
    stdout_tail: str
    stderr_tail: str
    wall_seconds: float
    uid: int | None = None
    """The uid the program ran as (None: the caller's)."""
    cases: tuple[CaseResult, ...] = field(default=(), repr=False)
    flags: tuple[str, ...] = ()
    """What the program tried (`graders.FLAGS`), sorted."""
    flag_details: tuple[str, ...] = field(default=(), repr=False)
    infra_failure: bool = False
    """The sandbox or the host failed (after retries); the score says nothing about the program."""

    def __post_init__(self) -> None:
        _make_visible(self, ("detail", "stdout_tail", "stderr_tail", "flag_details"))


@dataclass(frozen=True)
class CommandResult:
    """What a shell command did in the sandbox (`Sandbox.run_command`)."""

    exit_code: int | None
    """The command's exit status (negative: the signal that ended it); None when the sandbox killed it."""
    status: Status
    """`ok`: it ended by itself (any exit status); `timeout`, `memory`, `crash` (a signal, or its output went
    past max_file_mb); `infra`: the sandbox failed."""
    output: str
    """stdout and stderr interleaved; past max_output_kb only the end is kept, after a note of what was cut."""
    wall_seconds: float
    flags: tuple[str, ...] = ()
    """`timeout`, `output_limit` (`graders.FLAGS`)."""
    infra_failure: bool = False
    cpu_seconds: float = 0.0
    """CPU time of everything the command ran (steadier than wall time on a busy host)."""
    channel: bytes = field(default=b"", repr=False)
    """What the command wrote on its report channel (`Sandbox.run_command(channel=True)`), in order."""

    def __post_init__(self) -> None:
        # The observation a tool returns and what logs and reports show: control characters as visible escapes.
        _make_visible(self, ("output",))


@dataclass(frozen=True)
class RunEnvironment:
    """What a command run sees beyond the sandbox's interpreter (`Sandbox.run_command`): a project's virtual
    environment first on PATH, more host paths at their own path (read-only, or writable for its install),
    sys.path entries (relative to the work directory) and variables."""

    path: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    pythonpath: tuple[str, ...] = ()
    variables: tuple[tuple[str, str], ...] = ()


def reward_for(passed: int, total: int, mode: RewardMode) -> float:
    if total == 0:
        return 0.0
    if mode == "all_or_nothing":
        return 1.0 if passed == total else 0.0
    return passed / total
