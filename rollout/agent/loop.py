"""The agent loop: episodes of a task, single- or multi-turn, with self-summarization past the context.

Every episode works in a workspace (`CodingEnvironment.open_workspace`: solution.py for a function task, the task's
repository for a repo task) and earns the workspace's grade when it ends. The recipe's harness says what a reply does:

- `rollout.harness: reply` (function tasks): the reply's code becomes solution.py and is graded at once; the test
  results are the next observation, and the episode ends when every test passes or the turns run out.
- `rollout.harness: tools`: the reply calls tools (rollout.harness: read, search, edit, write, shell, run the tests,
  finish) in the chat template's tool-call form; their results are tool messages of the template. The episode ends at
  finish, at the turn limit or when the context is full; the workspace as it is then is graded.

Observations are tokens the learner does not train on. Compaction: when the context reaches
`summarize_at * max_context` at a turn boundary (or one more turn would leave no room to summarize), the context is
compacted into a new segment, as `rollout.compaction` says:

- `summarize` (self-summarization): the policy is asked to summarize its work (SUMMARY_REQUEST) and the context
  restarts as [task, SUMMARY_HEADER + summary, latest observation]. The summary is generated (loss mask on) in the
  segment that ends with it, and every segment of an episode is trained with the episode's advantage: the reward
  reaches the summary tokens, so RL trains what the summaries keep.
- `drop_oldest`: the context restarts as [task, DROPPED_NOTE, the newest turns that fit in half the trigger].

For a task that knows the facts an episode needs (`Task.facts`), each compaction records its compaction error: of the
facts the old context held that the compaction had to carry (those not in the latest observation, which both kinds
show again), the share the new context lacks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from composer.recipes.schema import RolloutSection
from composer.rollout.agent.environment import SOLUTION_FILE, CodingEnvironment
from composer.rollout.agent.harness import ChatFormat, Tokenizer, ToolBox, run_reply
from composer.rollout.agent.trajectory import Segment, Trajectory
from composer.rollout.engines.vllm_engine import Completion, Engine
from composer.rollout.sandbox.results import SandboxResult
from composer.rollout.tasks.files import write_text
from composer.rollout.tasks.functions import Task
from composer.rollout.tasks.workspace import Workspace

SUMMARY_REQUEST = "\n\n[The context is nearly full. Summarize the task, what you tried and what the tests said, so you can continue from the summary alone.]\nSummary:"
SUMMARY_HEADER = "\n\n[Summary of your earlier work]\n"
OBSERVATION_HEADER = "\n\n[Test results]\n"
NEXT_TURN = "\n\n[Fix the code and reply with the complete solution.]\n"
DROPPED_NOTE = "\n\n[Earlier turns were dropped to fit the context.]\n"


@dataclass
class _SegmentBuilder:
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: np.ndarray | None = None
    turn_starts: list[int] = field(default_factory=list)
    """Where each turn (a reply, then what it was shown) begins in `tokens`."""

    def observe(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def act(self, completion: Completion) -> None:
        self.tokens += completion.token_ids
        self.mask += [True] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        # The engine routed the whole context of this call: it covers every earlier position too.
        self.routes = completion.routed_experts

    def build(self) -> Segment:
        return Segment(np.array(self.tokens), np.array(self.mask), np.array(self.logprobs), _cover(self.routes, len(self.tokens)))


def _cover(routes: np.ndarray | None, num_tokens: int) -> np.ndarray | None:
    """Routes for positions [0, num_tokens-1): an observation appended after the last reply has none yet,
    and those tokens are not trained, so the last known row stands in for them."""
    if routes is None:
        return None
    need = num_tokens - 1
    if len(routes) >= need:
        return routes[:need]
    return np.concatenate([routes, np.repeat(routes[-1:], need - len(routes), axis=0)])


@dataclass
class _Episode:
    id: str
    seed: int
    prompt_ids: list[int]
    segments: list[_SegmentBuilder]
    task: Task
    workspace: Workspace | None = None
    result: SandboxResult | None = None
    """The grade of the workspace, once graded."""
    graded: bool = False
    """`result` grades the workspace as it is now."""
    turns: int = 0
    summaries: int = 0
    summary_tokens: list[int] = field(default_factory=list)
    summary_kept: list[float | None] = field(default_factory=list)
    """Per summary, the share of the facts it had to carry that the context it restarts kept (None: nothing to carry)."""
    compactions: int = 0
    compaction_errors: list[float] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0
    tests_run: int = 0
    done: bool = False
    end_reason: str = ""
    last_observation: list[int] = field(default_factory=list)
    """The latest observation without the end of the reply before it (what a restart from a summary shows again)."""
    summarizing: bool = False

    @property
    def current(self) -> _SegmentBuilder:
        return self.segments[-1]


@dataclass(frozen=True)
class _Outcome:
    """What the sandbox side of one turn produced."""

    closing: list[int]
    """The end of the reply's turn the policy did not write (chat templates)."""
    observation: list[int]
    result: SandboxResult | None = None
    finished: bool = False
    calls: int = 0
    errors: int = 0
    malformed: int = 0
    tests_run: int = 0


class EpisodeRunner:
    """Runs the `group_size` episodes of one task in lock-step, batching each turn into one engine call."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, env: CodingEnvironment, rollout: RolloutSection):
        self.engine = engine
        self.tok = tokenizer
        self.env = env
        self.cfg = rollout
        self.tools = rollout.harness == "tools"
        self.chat = ChatFormat(tokenizer, rollout.chat_template, tools=self.tools)
        self.toolbox = ToolBox(shell_seconds=env.sandbox.config.wall_seconds)
        self._next_turn = tokenizer.encode(NEXT_TURN)
        self._summary_request = tokenizer.encode(SUMMARY_REQUEST)
        self._summary_header = tokenizer.encode(SUMMARY_HEADER)
        self._dropped_note = tokenizer.encode(DROPPED_NOTE)
        self._message_overhead = self.chat.tool_message_overhead() if self.tools else 0
        # Sandbox work of a turn (grading, tools) runs for all of a batch's episodes at once, as many as the fleet runs.
        self._graders = ThreadPoolExecutor(max_workers=env.sandbox.max_concurrent, thread_name_prefix="grade")

    def run_group(self, task: Task, group_id: str, group_size: int, policy_version: int, seed: int) -> list[Trajectory]:
        return self.run_tasks([task], group_id, group_size, policy_version, seed)[0]

    def run_tasks(
        self,
        tasks: list[Task],
        group_id: str,
        group_size: int,
        policy_version: int,
        seed: int,
        temperature: float | None = None,
        task_numbers: list[int] | None = None,
    ) -> list[list[Trajectory]]:
        """`group_size` episodes of each task, all in lock-step (one engine call per turn); `temperature`
        overrides the recipe's (held-out evaluation samples greedily with 0). Episodes are seeded by `seed` and the
        number of their task (`task_numbers`, default 0, 1, ...: a task keeps its seeds in any batch)."""
        episodes: list[_Episode] = []
        for t, task in zip(task_numbers or range(len(tasks)), tasks):
            prompt_ids = self.chat.prompt(self.env.task_prompt(task, tools=self.tools))
            if len(prompt_ids) + self.cfg.sampling.max_tokens > self.cfg.max_context:
                raise ValueError(f"task {task.id}: prompt of {len(prompt_ids)} tokens leaves no room in max_context={self.cfg.max_context}")
            prefix = group_id if len(tasks) == 1 and task_numbers is None else f"{group_id}-{t}"
            for i in range(group_size):
                episodes.append(_Episode(f"{prefix}-{i}", seed * 1000 + t * group_size + i, prompt_ids, [_SegmentBuilder()], task))
        opened = [self._graders.submit(self.env.open_workspace, e.task, self.tools) for e in episodes]
        try:
            for e, workspace in zip(episodes, opened):
                e.workspace = workspace.result()
                e.current.observe(e.prompt_ids)
            self._play(episodes, temperature)
            ungraded = [e for e in episodes if not e.graded]
            for e, result in zip(ungraded, self._graders.map(lambda e: self.env.grade_workspace(e.workspace), ungraded)):
                e.result, e.graded = result, True
        finally:
            wait(opened)  # each opened workspace is closed, even when opening another failed
            for workspace in opened:
                if workspace.exception() is None:
                    workspace.result().close()
        trajectories = [self._trajectory(group_id, e, policy_version) for e in episodes]
        return [trajectories[t * group_size : (t + 1) * group_size] for t in range(len(tasks))]

    def _play(self, episodes: list[_Episode], temperature: float | None) -> None:
        while active := [e for e in episodes if not e.done]:
            completions = self.engine.generate(
                [e.current.tokens for e in active],
                seeds=[e.seed + 7919 * (e.turns + e.summaries) for e in active],
                temperature=temperature,
            )
            turns = []
            for episode, [completion] in zip(active, completions):
                if not episode.summarizing:
                    episode.current.turn_starts.append(len(episode.current.tokens))
                episode.current.act(completion)
                if episode.summarizing:
                    self._restart_from_summary(episode, completion)
                else:
                    episode.turns += 1
                    turns.append((episode, self._turn(episode, completion)))
            for (episode, _), outcome in zip(turns, self._graders.map(lambda turn: turn[1](), turns)):
                self._after_turn(episode, outcome)

    def _turn(self, e: _Episode, completion: Completion) -> Callable[[], _Outcome]:
        """The sandbox work a reply asks for (run by the caller, concurrently with the other episodes')."""
        reply_ids = completion.token_ids
        reply = self.tok.decode(reply_ids)
        if self.tools:

            def use_tools() -> _Outcome:
                turn = run_reply(reply, e.workspace, self.toolbox, self.tok, self._observation_cap, self._message_overhead)
                closing, body = self.chat.after_reply(reply_ids, turn.messages)
                return _Outcome(
                    closing,
                    body,
                    finished=turn.finished,
                    calls=turn.calls,
                    errors=turn.errors,
                    malformed=turn.malformed,
                    tests_run=turn.tests_run,
                )

            return use_tools

        def grade_reply() -> _Outcome:
            write_text(e.workspace.root, SOLUTION_FILE, e.task.program(reply))
            result = self.env.grade_workspace(e.workspace)
            return _Outcome(
                [], self.tok.encode(OBSERVATION_HEADER + _feedback(result))[: self._observation_cap] + self._next_turn, result=result
            )

        return grade_reply

    def _after_turn(self, e: _Episode, outcome: _Outcome) -> None:
        e.tool_calls += outcome.calls
        e.tool_errors += outcome.errors
        e.malformed_calls += outcome.malformed
        e.tests_run += outcome.tests_run
        e.graded = outcome.result is not None
        if outcome.result is not None:
            e.result = outcome.result
        if outcome.result is not None and outcome.result.reward == 1.0:
            return self._end(e, "solved")
        if outcome.finished:
            return self._end(e, "finished")
        if e.turns >= self.cfg.max_turns:
            return self._end(e, "max_turns")
        self._observe(e, outcome.closing, outcome.observation)

    def _observe(self, e: _Episode, closing: list[int], observation: list[int]) -> None:
        """Show the policy `observation` and open its next turn (summarizing first when the context asks for it)."""
        e.last_observation = observation
        e.current.observe(closing + observation)
        if self._needs_summary(e):
            if e.compactions >= self.cfg.max_summaries:
                return self._end(e, "max_summaries")
            if self.cfg.compaction == "drop_oldest":
                return self._drop_oldest(e)
            e.current.observe(self._summary_request)
            e.summarizing = True
        if len(e.current.tokens) + self.cfg.sampling.max_tokens > self.cfg.max_context:
            self._end(e, "context_full")

    @property
    def _observation_cap(self) -> int:
        return self.cfg.max_observation_tokens or self.cfg.sampling.max_tokens

    def _needs_summary(self, e: _Episode) -> bool:
        """At the trigger, or when one more turn would leave no room to summarize after it."""
        if self.cfg.summarize_at is None:
            return False
        reply = self.cfg.sampling.max_tokens
        another_turn = reply + self._observation_cap + len(self._next_turn)
        summary = len(self._summary_request) + reply
        used = len(e.current.tokens)
        return used >= self.cfg.summarize_at * self.cfg.max_context or used + another_turn + summary > self.cfg.max_context

    def _restart_from_summary(self, e: _Episode, summary: Completion) -> None:
        e.summaries += 1
        e.summary_tokens.append(len(summary.token_ids))
        e.summarizing = False
        fresh = _SegmentBuilder()
        closing = self.chat.after_reply(summary.token_ids, [])[0] if self.tools else []
        fresh.observe(e.prompt_ids + self._summary_header + summary.token_ids + closing + e.last_observation)
        e.summary_kept.append(self._compacted(e, e.current.tokens[: len(e.current.tokens) - len(summary.token_ids)], fresh))
        if len(fresh.tokens) + self.cfg.sampling.max_tokens > self.cfg.max_context:
            self._end(e, "summary_too_long")

    def _drop_oldest(self, e: _Episode) -> None:
        """Restart from the task and the newest turns that fit in half the trigger (at least the latest observation)."""
        old, head = e.current, e.prompt_ids + self._dropped_note
        budget = self.cfg.summarize_at * self.cfg.max_context / 2
        start = next((s for s in old.turn_starts if len(head) + len(old.tokens) - s <= budget), None)
        fresh = _SegmentBuilder()
        if start is None:
            fresh.observe(head + e.last_observation)
        else:
            fresh.observe(head + old.tokens[start:])
            fresh.turn_starts = [len(head) + s - start for s in old.turn_starts if s >= start]
        self._compacted(e, old.tokens, fresh)
        if len(fresh.tokens) + self.cfg.sampling.max_tokens > self.cfg.max_context:
            self._end(e, "context_full")

    def _compacted(self, e: _Episode, old_tokens: list[int], fresh: _SegmentBuilder) -> float | None:
        """`fresh` continues the episode; when the task knows its facts, the compaction error is recorded and the
        share of the facts to carry that `fresh` kept is returned (None when there was nothing to carry)."""
        e.segments.append(fresh)
        e.compactions += 1
        if not e.task.facts:
            return None
        to_carry = self._facts_in(e.task, old_tokens) - self._facts_in(e.task, e.last_observation)
        if not to_carry:
            return None
        kept = len(self._facts_in(e.task, fresh.tokens) & to_carry) / len(to_carry)
        e.compaction_errors.append(1 - kept)
        return kept

    def _facts_in(self, task: Task, tokens: list[int]) -> set[str]:
        text = self.tok.decode(tokens)
        return {f for f in task.facts if re.search(rf"(?<![0-9A-Za-z]){re.escape(f)}(?![0-9A-Za-z])", text)}

    @staticmethod
    def _end(e: _Episode, reason: str) -> None:
        e.done = True
        e.end_reason = reason

    def _trajectory(self, group_id: str, e: _Episode, policy_version: int) -> Trajectory:
        result = e.result
        return Trajectory(
            id=e.id,
            group_id=group_id,
            task_id=e.task.id,
            policy_version=policy_version,
            reward=result.reward if result else 0.0,
            segments=[s.build() for s in e.segments],
            info={
                "end_reason": e.end_reason,
                "turns": e.turns,
                "summaries": e.summaries,
                "summary_tokens": e.summary_tokens,
                "summary_kept": e.summary_kept,
                "compactions": e.compactions,
                "compaction_errors": e.compaction_errors,
                "tool_calls": e.tool_calls,
                "tool_errors": e.tool_errors,
                "malformed_calls": e.malformed_calls,
                "tests_run": e.tests_run,
                "tests_passed": result.passed if result else 0,
                "tests_total": result.total if result else 0,
                "sandbox_status": result.status if result else "none",
                "flags": list(result.flags) if result else [],
                "infra_failure": result.infra_failure if result else False,
                "canary": e.task.canary,
            },
        )


def _feedback(result: SandboxResult) -> str:
    lines = [f"{result.passed}/{result.total} tests passed ({result.status})."]
    if result.detail:
        lines.append(result.detail[:400])
    return "\n".join(lines)
