"""The long-horizon `recall` family through the real agent loop, tools harness and sandbox, with scripted agents in
place of the policy: an agent whose summaries keep the codes it read succeeds with compaction error 0, one whose
summaries drop them fails with error 1; dropping the oldest turns loses codes; a context large enough needs no
compaction. And the reward reaches the summary tokens: they are trained (loss mask) with the episode's advantage."""

import re

import numpy as np
import pytest

from composer.recipes.env_schema import EnvSection, RecallSettings, TaskSet
from composer.recipes.schema import RLSection, RolloutSection, SamplingSection
from composer.rollout.agent.trajectory import Trajectory
from composer.rollout.engines.vllm_engine import Completion, Engine

PARTS = 6
CONTEXT = 1536


class ScriptedAgent(Engine):
    """Plays a recall task from what its context shows: reads the next part, writes the codes it can see at the end,
    and when asked to summarize writes where it is, with the codes (`keeps_codes`) or without them."""

    def __init__(self, tokenizer, keeps_codes: bool):
        self.tok, self.keeps_codes = tokenizer, keeps_codes
        self.summaries: list[str] = []

    def generate(self, prompts, n=1, seeds=None, max_tokens=None, temperature=None):
        return [[self._reply(prompt)] for prompt in prompts]

    def _reply(self, prompt: list[int]) -> Completion:
        from composer.rollout.agent.loop import SUMMARY_REQUEST

        context = self.tok.decode(prompt)
        codes = dict(re.findall(r"CODE of part (\d+): (\d+)", context)) | dict(re.findall(r"part (\d+) = (\d+)", context))
        read = max([int(k) for k in codes] + [int(k) for k in re.findall(r"read up to part (\d+)", context)], default=0)
        if context.endswith(SUMMARY_REQUEST):
            text = f"I read up to part {read}." + (
                " Codes: " + ", ".join(f"part {k} = {v}" for k, v in sorted(codes.items())) if self.keeps_codes else ""
            )
            self.summaries.append(text)
        elif read < PARTS:
            text = f'<tool_call>{{"name": "read_file", "arguments": {{"path": "notes/part_{read + 1}.txt"}}}}</tool_call>'
        else:
            answer = [int(codes.get(str(k), 0)) for k in range(1, PARTS + 1)]
            program = f"def answer():\n    return {answer}\n".replace("\n", "\\n")
            text = (
                f'<tool_call>{{"name": "write_file", "arguments": {{"path": "solution.py", "content": "{program}"}}}}</tool_call>'
                '<tool_call>{"name": "finish", "arguments": {}}</tool_call>'
            )
        ids = self.tok.encode(text)
        return Completion(list(prompt), ids, [-0.5] * len(ids), None, "stop")

    def load_weights(self, weights_dir):
        raise NotImplementedError

    def update_weights(self, weights_dir, changed, pieces):
        raise NotImplementedError


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from composer.rollout.agent.environment import CodingEnvironment
    from composer.rollout.agent.harness import Tokenizer
    from composer.trainer.checkpoint_init import train_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(4096, 2**20).save_pretrained(directory)
    env = CodingEnvironment(
        EnvSection(tasks=[TaskSet(name="recall", recall=RecallSettings(parts=PARTS))]),
        seed=0,
        sandbox_root=tmp_path_factory.mktemp("sandbox"),
    )
    yield Tokenizer(str(directory)), env
    env.close()


def play(parts, keeps_codes: bool, **rollout) -> tuple[Trajectory, ScriptedAgent]:
    from composer.rollout.agent.loop import EpisodeRunner

    tok, env = parts
    settings = {
        "harness": "tools",
        "max_context": CONTEXT,
        "max_turns": 3 * PARTS,
        "summarize_at": 0.5,
        "max_summaries": 10,
        "sampling": SamplingSection(max_tokens=160),
        **rollout,
    }
    agent = ScriptedAgent(tok, keeps_codes)
    runner = EpisodeRunner(agent, tok, env, RolloutSection(**settings))
    [[trajectory]] = runner.run_tasks([env.pool.task(0, 0)], "g", 1, 0, seed=0)
    return trajectory, agent


def test_summaries_that_keep_the_codes_succeed_and_lose_nothing(parts):
    t, agent = play(parts, keeps_codes=True)
    assert t.info["end_reason"] == "finished" and t.reward == 1.0 and t.info["tests_passed"] == PARTS + 1
    assert t.info["summaries"] >= 2 and t.num_tokens > CONTEXT  # the episode needs more than its context
    assert all(len(s.token_ids) <= CONTEXT for s in t.segments)
    assert t.info["compaction_errors"] and set(t.info["compaction_errors"]) == {0.0}


def test_summaries_that_drop_the_codes_fail_with_compaction_error_1(parts):
    from composer.rl.trajectories import episode_stats

    t, _ = play(parts, keeps_codes=False)
    assert t.info["end_reason"] == "finished" and t.reward < 0.5 and t.info["summaries"] >= 2
    assert t.info["compaction_errors"] and set(t.info["compaction_errors"]) == {1.0}
    kept, _ = play(parts, keeps_codes=True)
    stats = episode_stats([kept, t], CONTEXT)
    assert stats["compaction_error_mean"] == pytest.approx(np.mean(kept.info["compaction_errors"] + t.info["compaction_errors"]))
    assert stats["compactions_per_episode"] == (kept.info["compactions"] + t.info["compactions"]) / 2


def test_dropping_the_oldest_turns_loses_codes_and_a_large_context_needs_no_compaction(parts):
    from composer.rollout.agent.loop import DROPPED_NOTE

    tok, _ = parts
    dropped, agent = play(parts, keeps_codes=True, compaction="drop_oldest")
    assert agent.summaries == [] and dropped.info["summaries"] == 0 and dropped.info["compactions"] >= 2
    assert dropped.reward < 1.0 and max(dropped.info["compaction_errors"]) > 0
    for segment in dropped.segments[1:]:
        assert DROPPED_NOTE in tok.decode(segment.token_ids.tolist()) and len(segment.token_ids) <= CONTEXT
    whole, _ = play(parts, keeps_codes=False, max_context=8192, summarize_at=None)
    assert whole.reward == 1.0 and whole.info["compactions"] == 0 and len(whole.segments) == 1


def test_the_episode_reward_reaches_the_summary_tokens(parts):
    """The summary is generated in the segment it ends (loss mask on, the request before it off) and restarts the
    next; the learner's loss gives every segment its episode's advantage: the summaries that kept the codes are
    pushed up, those that dropped them down, and no observation token gets a gradient."""

    from composer.rl.learner_main import learner_sequences
    from composer.rollout.agent.loop import SUMMARY_HEADER, SUMMARY_REQUEST
    from composer.trainer.rl_learner import _aligned
    from composer.trainer.rl_objective import policy_gradient_loss

    tok, _ = parts
    request, header = tok.encode(SUMMARY_REQUEST), tok.encode(SUMMARY_HEADER)
    played = [play(parts, keeps_codes=True), play(parts, keeps_codes=False)]
    summary_spans = []  # (trajectory, segment, first summary token, end)
    for n, (t, agent) in enumerate(played):
        assert len(agent.summaries) == t.info["summaries"] == len(t.segments) - 1
        for i, summary in enumerate(agent.summaries):
            ids, mask = t.segments[i].token_ids.tolist(), t.segments[i].loss_mask
            start = len(ids) - int(np.argmin(mask[::-1]))  # where the trained tail begins
            assert tok.decode(ids[start:]) == summary and mask[start:].all()
            assert ids[start - len(request) : start] == request and not mask[start - len(request) : start].any()
            restart, shown = t.segments[i + 1].token_ids.tolist(), header + ids[start:]
            assert any(restart[j : j + len(shown)] == shown for j in range(len(restart)))  # the next segment starts from it
            summary_spans.append((n, i, start, len(ids)))
    (good, _), (bad, _) = played
    sequences = learner_sequences([[good, bad]], RLSection(advantage="group_mean"), step=0)
    gap = (good.reward - bad.reward) / 2
    assert gap > 0 and [s.advantage for s in sequences] == pytest.approx([gap] * len(good.segments) + [-gap] * len(bad.segments))
    rollout, mask, advantages = _aligned(sequences, max(len(s.tokens) for s in sequences))
    logprobs = rollout.clone().requires_grad_(True)
    loss, _ = policy_gradient_loss(logprobs, rollout, advantages, mask, RLSection(), 1.0)
    loss.backward()
    assert (logprobs.grad[~mask] == 0).all()
    for n, i, start, end in summary_spans:
        row = i if n == 0 else len(good.segments) + i
        pushed = -logprobs.grad[row, start - 1 : end - 1]  # entry t predicts token t + 1
        assert ((pushed > 0) if n == 0 else (pushed < 0)).all()


def test_the_shaped_summary_term_reaches_only_the_summaries_and_follows_what_they_kept(parts):
    """`rl.summary_reward`: the episodes record per summary the share of the codes still needed that it kept; with
    equal episode rewards (no signal from the task) the summary that kept the codes is still pushed up and the one
    that dropped them down, by the weight times the difference from the group's mean, and no other token moves."""
    from composer.rl.learner_main import learner_sequences

    (good, _), (bad, _) = play(parts, keeps_codes=True), play(parts, keeps_codes=False)
    # (None: a summary with nothing to carry, every code read so far still in the observation it restarts with)
    assert set(good.info["summary_kept"]) - {None} == {1.0} and set(bad.info["summary_kept"]) - {None} == {0.0}
    good.reward = bad.reward = 0.5
    off = learner_sequences([[good, bad]], RLSection(), step=0)
    assert all(s.advantage == 0.0 and s.bonus is None for s in off)
    shaped = learner_sequences([[good, bad]], RLSection(summary_reward=0.4), step=0)
    assert [s.advantage for s in shaped] == [0.0] * len(shaped)
    kept = [k for t in (good, bad) for k in t.info["summary_kept"] if k is not None]
    rows = [(t, i) for t in (good, bad) for i in range(len(t.segments))]
    for sequence, (t, i) in zip(shaped, rows):
        if i >= t.info["summaries"] or t.info["summary_kept"][i] is None:
            assert sequence.bonus is None  # the last segment ends without a summary
            continue
        length = t.info["summary_tokens"][i]
        assert (sequence.bonus[: len(sequence.tokens) - length] == 0).all()
        assert sequence.bonus[len(sequence.tokens) - length :] == pytest.approx(
            0.4 * (t.info["summary_kept"][i] - np.mean(kept)) * np.ones(length)
        )


def test_decoys_name_other_numbers_and_tasks_without_them_stay_the_same():
    import hashlib

    from composer.rollout.tasks.recall import recall_task

    plain = recall_task(3, RecallSettings(parts=4))
    # as the family made it before decoys existed: earlier runs' held-out tasks are still the same tasks
    assert plain.facts == ("783", "850", "507", "695")
    assert hashlib.sha256(repr((plain.files, plain.prompt)).encode()).hexdigest()[:16] == "86486a1fca9bf705"
    hard = recall_task(3, RecallSettings(parts=4, decoys=3))
    assert "revoked codes do not count" in hard.prompt and "revoked" not in plain.prompt
    for k, (_, text) in enumerate(hard.files, 1):
        revoked = re.findall(rf"revoked code of part {k}: (\d+)", text)
        assert len(revoked) == 3 and hard.facts[k - 1] not in revoked
        assert re.findall(r"CODE of part (\d+): (\d+)", text) == [(str(k), hard.facts[k - 1])]


def test_the_reference_episode_reads_every_part_in_turn_then_answers_what_it_read(parts):
    """The `references` SFT source on recall: one read_file a turn, in order, each shown the real file; then the
    codes written, the tests run, finish; the workspace grades 1.0."""
    from composer.rl.sft_references import reference_messages
    from composer.rollout.agent.harness import ToolBox

    _, env = parts
    task = env.pool.task(0, 0)
    messages = reference_messages(env, task, ToolBox(shell_seconds=10))
    assert messages is not None
    calls = [m["tool_calls"][0]["function"] for m in messages if m["role"] == "assistant"]
    assert [c["name"] for c in calls] == ["read_file"] * PARTS + ["write_file", "run_tests", "finish"]
    assert [c["arguments"]["path"] for c in calls[:PARTS]] == [f"notes/part_{k}.txt" for k in range(1, PARTS + 1)]
    shown = [m["content"] for m in messages if m["role"] == "tool"][:PARTS]
    assert all(f"CODE of part {k}: {code}" in text for k, (code, text) in enumerate(zip(task.facts, shown), 1))
    assert str([int(c) for c in task.facts]) in calls[PARTS]["arguments"]["content"]


def test_the_repository_layout_puts_the_codes_in_modules_the_reference_reads_first(tmp_path):
    """`recall.layout: repository`: the codes are constants of source modules app/part_K.py (valid Python, decoys
    named REVOKED_); the reference episode reads them in turn and its answer grades 1.0 in the sandbox."""
    from composer.rl.sft_references import reference_messages
    from composer.rollout.agent.environment import CodingEnvironment
    from composer.rollout.agent.harness import ToolBox
    from composer.rollout.tasks.recall import recall_task

    settings = RecallSettings(parts=3, layout="repository", decoys=1)
    task = recall_task(0, settings)
    assert task.id == "recall/repository/3/0" and "write the numbers themselves" in task.prompt
    for k, (path, text) in enumerate(task.files, 1):
        namespace: dict = {}
        exec(compile(text, path, "exec"), namespace)  # a module of the task's own making, not the agent's
        assert path == f"app/part_{k}.py" and namespace[f"PART_{k}_CODE"] == int(task.facts[k - 1])
        assert namespace[f"REVOKED_PART_{k}_CODE"] != namespace[f"PART_{k}_CODE"]
    env = CodingEnvironment(EnvSection(tasks=[TaskSet(name="recall", recall=settings)]), seed=0, sandbox_root=tmp_path)
    try:
        messages = reference_messages(env, env.pool.task(0, 0), ToolBox(shell_seconds=10))
    finally:
        env.close()
    assert messages is not None
    calls = [m["tool_calls"][0]["function"] for m in messages if m["role"] == "assistant"]
    reads = [c["arguments"]["path"] for c in calls if c["name"] == "read_file"]
    assert reads == ["app/part_1.py", "app/part_2.py", "app/part_3.py"]
