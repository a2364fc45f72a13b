"""`composer eval` per kind: the share of tool calls that parse, of episodes that run the tests and of episodes that call
finish, next to pass@1."""

from __future__ import annotations

import pytest

from composer.rl.checkpoint_eval import set_summary
from composer.rl.evaluation import EvalSet, GradedEpisode
from composer.rollout.agent.harness import ToolBox, run_reply
from composer.rollout.sandbox.results import CommandResult


def episode(task: str, passed: bool, calls: int, malformed: int, end: str, tests_run: int = 0) -> GradedEpisode:
    return GradedEpisode("repo", task, "greedy", 0, passed, float(passed), 0, 1, [], False, end, 3, 0, [], [], calls, malformed, tests_run)


def test_per_kind_shares_of_parsed_calls_and_finish_beside_pass_at_1():
    greedy = [
        episode("repo/nx/bug/1", True, 4, 0, "finished", tests_run=2),
        episode("repo/nx/bug/2", False, 6, 2, "max_turns"),
        episode("repo/nx/feature/1", False, 0, 0, "max_turns"),
    ]
    s = set_summary(EvalSet("repo", [], 0), greedy, [], [])
    bug, feature = s["kinds"]["repo/nx/bug"], s["kinds"]["repo/nx/feature"]
    assert bug["tool_calls"] == 10 and bug["tool_calls_parsed"] == pytest.approx(0.8)
    assert bug["finish_called"] == 0.5 and bug["greedy_pass@1"] == 0.5 and bug["tests_run"] == 0.5
    assert feature["tool_calls"] == 0 and feature["tool_calls_parsed"] is None and feature["finish_called"] == 0.0
    assert feature["tests_run"] == 0.0


def test_an_old_graded_log_without_call_counts_still_reads():
    old = dict(
        set="s", task="smoke/1", mode="greedy", sample=0, passed=True, reward=1.0, tests_passed=1, tests_total=1, flags=[],
        infra_failure=False, end_reason="solved", turns=1, summaries=0, summary_tokens=[],
    )  # fmt: skip
    assert GradedEpisode(**old).malformed_calls == 0 and GradedEpisode(**old).tests_run == 0


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def test_a_reply_counts_the_calls_the_harness_cannot_parse():
    reply = '<tool_call>{"name": "read_file", "arguments": "{bad"}</tool_call> <tool_call>{"name": "browse"}</tool_call>'
    turn = run_reply(reply, None, None, CharTokenizer(), 4000)  # malformed calls never reach the workspace
    assert (turn.calls, turn.malformed, turn.errors, turn.finished) == (2, 2, 2, False)
    assert run_reply("no call here", None, None, CharTokenizer(), 4000).malformed == 0


class Tests:
    def run_tests(self):
        return CommandResult(0, "ok", "3 passed", 0.1)


def test_a_reply_counts_the_test_runs_it_made():
    reply = '<tool_call>{"name": "run_tests", "arguments": {}}</tool_call><tool_call>{"name": "finish", "arguments": {}}</tool_call>'
    turn = run_reply(reply, Tests(), ToolBox(10), CharTokenizer(), 4000)
    assert (turn.calls, turn.tests_run, turn.finished) == (2, 1, True) and "3 passed" in turn.messages[0]["content"]


def test_a_compacted_episode_counts_every_segments_tokens_and_drop_oldest_has_no_summary_length():
    import numpy as np

    from composer.rollout.agent.trajectory import Segment, Trajectory

    segments = [Segment(np.arange(10), np.arange(10) >= 6, np.zeros(10)), Segment(np.arange(7), np.arange(7) >= 5, np.zeros(7))]
    info = {"end_reason": "finished", "summaries": 0, "summary_tokens": [], "compaction_errors": [0.5], "compactions": 1}
    graded = GradedEpisode.of("recall", "greedy", 0, Trajectory("e", "g", "recall/4/0", 0, 0.5, segments, info))
    assert (graded.tokens, graded.generated_tokens) == (17, 6)
    s = set_summary(EvalSet("recall", [], 0), [graded], [], [])
    assert s["tokens_per_episode"] == 17 and s["compaction_error"] == 0.5 and "summary_tokens_mean" not in s
