"""How `env build` decides a repository task from its runs: the change in pytest's process must fail some of the
project's tests, and the task is split by what the change does across the grading boundary, where it is graded."""

from __future__ import annotations

from composer.rollout.tasks.repository.surveys import validate_with
from composer.rollout.tasks.repository.workspace import TestReport

EXPECTED = ["t::a", "t::b", "t::c"]


def report(failing: set[str], complete: bool = True) -> TestReport:
    outcomes = {i: "failed" if i in failing else "passed" for i in EXPECTED}
    return TestReport(outcomes, complete, (), "", "pytest output tail", "ok" if complete else "timeout", 1.0, 1.0)


def decide(here: set[str], original_across: set[str], change_across: set[str]) -> dict:
    """The verdict when the change fails `here` in pytest's process, and the original and the change fail these
    across the boundary."""
    return validate_with(
        lambda changes, files, seconds: report(here),
        lambda episode, seconds: report(change_across if episode else original_across),
        {"m.py": "changed"},
        ("t",),
        EXPECTED,
        10.0,
    )


def test_a_task_is_split_by_what_its_change_does_across_the_boundary():
    same = decide({"t::a"}, set(), {"t::a"})
    assert same["verdict"] == "validated" and same["fail_to_pass"] == ["t::a"] and same["pass_to_pass"] == ["t::b", "t::c"]
    assert "detail" not in same
    # the change also fails a test across the boundary that it passes here (it wraps the test's object, whose private
    # state the episode never reads): graded there, where the original passes it, so a fix can
    more = decide({"t::a"}, set(), {"t::a", "t::b"})
    assert more["verdict"] == "validated" and more["fail_to_pass"] == ["t::a", "t::b"] and more["pass_to_pass"] == ["t::c"]
    assert more["detail"].startswith("1 tests graded by their outcome on the change across the boundary")


def test_a_task_the_boundary_cannot_grade_is_rejected_naming_why():
    original = decide({"t::a"}, {"t::c"}, {"t::a"})
    assert original["reason"] == "behaves otherwise across the grading boundary"
    assert original["detail"].startswith("t::c: failed on the original across the boundary")
    hidden = decide({"t::a"}, set(), {"t::b"})  # what the change breaks here does not show there
    assert hidden["reason"] == "behaves otherwise across the grading boundary" and "none of the 1 tests" in hidden["detail"]
    assert decide(set(), set(), {"t::a"})["reason"] == "no test fails"  # the project's own tests do not catch it
