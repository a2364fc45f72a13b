"""The agent loop: episodes of a task, single- or multi-turn, with self-summarization past the context.

A turn: the policy writes a reply; if it holds code, the environment writes it as the solution, runs the
hidden tests and returns their output as the next observation (tokens the learner does not train on).
The episode ends when every test passes, the turns run out, or the context cannot hold another turn.

With tools (`rollout.tools`) the policy works on a file, solution.py: a ```python block in a reply replaces
it, and the reply's last line chooses the tool: RUN runs solution.py in the sandbox and shows its output,
TEST (the default) runs the hidden tests. The episode's reward is the hidden tests' score of the last solution.

Self-summarization: when the context reaches `summarize_at * max_context` at a turn boundary, the policy is
asked to summarize its work; the context restarts as [task, summary, latest observation] in a new segment.
The summary is generated (and trained) in the segment that ends with it, under the episode's reward.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from recipes.errors import UserError
from recipes.schema import RolloutSection
from rollout.engine import Completion, Engine
from rollout.environment import CodingEnvironment
from rollout.sandbox import SandboxResult
from rollout.tasks import Task, fenced_code
from rollout.trajectories import Segment, Trajectory

SUMMARY_REQUEST = "\n\n[The context is nearly full. Summarize the task, what you tried and what the tests said, so you can continue from the summary alone.]\nSummary:"
SUMMARY_HEADER = "\n\n[Summary of your earlier work]\n"
OBSERVATION_HEADER = "\n\n[Test results]\n"
NEXT_TURN = "\n\n[Fix the code and reply with the complete solution.]\n"
TOOLS_GUIDE = ("\n\n[Tools: a ```python block in your reply replaces solution.py. End the reply with a line RUN to run "
               "solution.py and read its output, or TEST to run the hidden tests on it; every reply ends with TEST unless "
               "it says RUN.]\n")
RUN_HEADER = "\n\n[Output of solution.py]\n"


class Tokenizer:
    """Text <-> token ids with an HF tokenizer, never adding special tokens inside an episode."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def chat_prompt(self, text: str) -> list[int]:
        """`text` as a user turn in the tokenizer's chat template, followed by the opening of the assistant's reply."""
        if not self._tok.chat_template:
            raise UserError("rollout.chat_template: the policy's tokenizer has no chat template")
        return self.encode(self._tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


@dataclass
class _SegmentBuilder:
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: np.ndarray | None = None

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
    task: Task | None = None
    result: SandboxResult | None = None
    turns: int = 0
    summaries: int = 0
    summary_tokens: list[int] = field(default_factory=list)
    done: bool = False
    end_reason: str = ""
    last_observation: list[int] = field(default_factory=list)
    summarizing: bool = False
    solution: str = ""
    """The code the hidden tests score (with tools: solution.py as the policy last wrote it)."""
    graded: str | None = None
    """The solution `result` belongs to."""

    @property
    def current(self) -> _SegmentBuilder:
        return self.segments[-1]


class EpisodeRunner:
    """Runs the `group_size` episodes of one task in lock-step, batching each turn into one engine call."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, env: CodingEnvironment, rollout: RolloutSection):
        self.engine = engine
        self.tok = tokenizer
        self.env = env
        self.cfg = rollout
        self._next_turn = tokenizer.encode(NEXT_TURN)
        self._summary_request = tokenizer.encode(SUMMARY_REQUEST)
        self._summary_header = tokenizer.encode(SUMMARY_HEADER)
        # A group's episodes are graded at once, as many as the sandbox fleet runs at a time.
        self._graders = ThreadPoolExecutor(max_workers=env.sandbox.max_concurrent, thread_name_prefix="grade")

    def run_group(self, task: Task, group_id: str, group_size: int, policy_version: int, seed: int) -> list[Trajectory]:
        return self.run_tasks([task], group_id, group_size, policy_version, seed)[0]

    def run_tasks(self, tasks: list[Task], group_id: str, group_size: int, policy_version: int, seed: int,
                  temperature: float | None = None) -> list[list[Trajectory]]:
        """`group_size` episodes of each task, all in lock-step (one engine call per turn); `temperature`
        overrides the recipe's (held-out evaluation samples greedily with 0)."""
        episodes: list[_Episode] = []
        for t, task in enumerate(tasks):
            text = task.prompt + (TOOLS_GUIDE if self.cfg.tools else "")
            prompt_ids = self.tok.chat_prompt(text) if self.cfg.chat_template else self.tok.encode(text)
            if len(prompt_ids) + self.cfg.sampling.max_tokens > self.cfg.max_context:
                raise ValueError(f"task {task.id}: prompt of {len(prompt_ids)} tokens leaves no room in max_context={self.cfg.max_context}")
            prefix = group_id if len(tasks) == 1 else f"{group_id}-{t}"
            for i in range(group_size):
                episodes.append(_Episode(f"{prefix}-{i}", seed * 1000 + t * group_size + i, prompt_ids, [_SegmentBuilder()], task=task))
        for e in episodes:
            e.current.observe(e.prompt_ids)
        while active := [e for e in episodes if not e.done]:
            completions = self.engine.generate(
                [e.current.tokens for e in active], seeds=[e.seed + 7919 * (e.turns + e.summaries) for e in active],
                temperature=temperature,
            )
            turns = []
            for episode, [completion] in zip(active, completions):
                episode.current.act(completion)
                if episode.summarizing:
                    self._restart_from_summary(episode, completion)
                else:
                    turns.append((episode, self._turn(episode.task, episode, completion)))
            for (episode, (tool, _)), result in zip(turns, self._graders.map(lambda turn: turn[1][1](), turns)):
                self._after_turn(episode.task, episode, tool, result)
        # An episode that ended on a RUN or a summary is scored on the solution it left.
        ungraded = [e for e in episodes if e.graded != e.solution]
        for e, result in zip(ungraded, self._graders.map(lambda e: self.env.grade(e.task, e.solution), ungraded)):
            e.result, e.graded = result, e.solution
        trajectories = [self._trajectory(e.task, group_id, e, policy_version) for e in episodes]
        return [trajectories[t * group_size : (t + 1) * group_size] for t in range(len(tasks))]

    def _turn(self, task: Task, e: _Episode, completion: Completion) -> tuple[str, Callable[[], SandboxResult]]:
        """The tool a reply asks for and the sandbox work it needs (run by the caller, concurrently)."""
        e.turns += 1
        reply = self.tok.decode(completion.token_ids)
        if not self.cfg.tools:
            e.solution = reply
        elif (code := fenced_code(reply, task.entry_point)) is not None:
            e.solution = code
        solution = e.solution
        if self.cfg.tools and reply_tool(reply) == "run" and e.turns < self.cfg.max_turns:
            return "run", lambda: self.env.run(task, solution)
        return "test", lambda: self.env.grade(task, solution)

    def _after_turn(self, task: Task, e: _Episode, tool: str, result: SandboxResult) -> None:
        if tool == "run":
            return self._observe(e, self._run_output(result))
        e.result, e.graded = result, e.solution
        if e.result.reward == 1.0:
            return self._end(e, "solved")
        if e.turns >= self.cfg.max_turns:
            return self._end(e, "max_turns")
        self._observe(e, self.tok.encode(OBSERVATION_HEADER + _feedback(e.result))[: self._observation_cap])

    def _run_output(self, result: SandboxResult) -> list[int]:
        """The status, then as much of the end of the program's output as fits (where its error is)."""
        status = "exit 0" if result.status == "ok" else f"{result.status}: {result.detail}"
        head = self.tok.encode(f"{RUN_HEADER}[{status}]\n")
        room = max(self._observation_cap - len(head), 0)
        output = self.tok.encode(result.stdout_tail + result.stderr_tail)
        return head + (output[-room:] if room else [])

    def _observe(self, e: _Episode, observation: list[int]) -> None:
        """Show the policy `observation` and open its next turn (summarizing first when the context asks for it)."""
        e.last_observation = observation + self._next_turn
        e.current.observe(e.last_observation)
        if self._needs_summary(e):
            if e.summaries >= self.cfg.max_summaries:
                return self._end(e, "max_summaries")
            e.current.observe(self._summary_request)
            e.summarizing = True
        if len(e.current.tokens) + self.cfg.sampling.max_tokens > self.cfg.max_context:
            self._end(e, "context_full")

    @property
    def _observation_cap(self) -> int:
        return self.cfg.sampling.max_tokens

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
        fresh.observe(e.prompt_ids + self._summary_header + summary.token_ids + e.last_observation)
        e.segments.append(fresh)
        if len(fresh.tokens) + self.cfg.sampling.max_tokens > self.cfg.max_context:
            self._end(e, "summary_too_long")

    @staticmethod
    def _end(e: _Episode, reason: str) -> None:
        e.done = True
        e.end_reason = reason

    def _trajectory(self, task: Task, group_id: str, e: _Episode, policy_version: int) -> Trajectory:
        result = e.result
        return Trajectory(
            id=e.id,
            group_id=group_id,
            task_id=task.id,
            policy_version=policy_version,
            reward=result.reward if result else 0.0,
            segments=[s.build() for s in e.segments],
            info={
                "end_reason": e.end_reason,
                "turns": e.turns,
                "summaries": e.summaries,
                "summary_tokens": e.summary_tokens,
                "tests_passed": result.passed if result else 0,
                "tests_total": result.total if result else 0,
                "sandbox_status": result.status if result else "none",
                "flags": list(result.flags) if result else [],
                "infra_failure": result.infra_failure if result else False,
                "canary": task.canary,
            },
        )


def reply_tool(reply: str) -> Literal["run", "test"]:
    """The tool a reply asks for on its last non-empty line: RUN, else TEST."""
    lines = [line.strip() for line in reply.strip().splitlines() if line.strip()]
    return "run" if lines and lines[-1] == "RUN" else "test"


def _feedback(result: SandboxResult) -> str:
    lines = [f"{result.passed}/{result.total} tests passed ({result.status})."]
    if result.detail:
        lines.append(result.detail[:400])
    return "\n".join(lines)
