"""The agent loop with real vLLM and the real sandbox: multi-turn episodes, self-summarization past the context."""

import numpy as np
import pytest

from recipes.loader import load_recipe
from recipes.schema import EnvSection, RolloutSection, SamplingSection, TaskSet
from tests.conftest import RECIPES

pytestmark = pytest.mark.engines

MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from trainer.checkpoint_init import init_hf_checkpoint

    model = load_recipe(RECIPES / "smoke-midtrain.yaml").model
    return init_hf_checkpoint(model, tmp_path_factory.mktemp("agent") / "tiny", tokenizer_bytes=2**20)


ROLLOUT = RolloutSection(max_context=MAX_CONTEXT, max_turns=30, summarize_at=0.6, max_summaries=30,
                         kv_cache_gib=0.0625, dtype="float32", sampling=SamplingSection(max_tokens=48))


@pytest.fixture(scope="module")
def parts(tiny_model, tmp_path_factory):
    """A real engine, tokenizer and coding environment (smoke and HumanEval tasks)."""
    from rollout.agent import Tokenizer
    from rollout.engine import EmbeddedEngine
    from rollout.environment import CodingEnvironment

    env = CodingEnvironment(EnvSection(tasks=[TaskSet(name="smoke"), TaskSet(name="humaneval")]), seed=0,
                            sandbox_root=tmp_path_factory.mktemp("sandbox"))
    return EmbeddedEngine(tiny_model, ROLLOUT, seed=0, routed_experts=True), Tokenizer(str(tiny_model)), env


@pytest.fixture(scope="module", params=[False, True], ids=["replies", "tools"])
def episodes(parts, request):
    from rollout.agent import TOOLS_GUIDE, EpisodeRunner

    engine, tokenizer, env = parts
    runner = EpisodeRunner(engine, tokenizer, env, ROLLOUT.model_copy(update={"tools": request.param}))
    task = env.pool.task(0, 0)
    prompt = task.prompt + (TOOLS_GUIDE if request.param else "")
    return runner.run_group(task, "g0", group_size=2, policy_version=3, seed=1), tokenizer, prompt


def test_long_episodes_run_to_their_end_within_the_context(episodes):
    trajectories, _, _ = episodes
    for t in trajectories:
        assert t.info["end_reason"] in ("max_turns", "solved")
        assert t.num_tokens >= 5 * MAX_CONTEXT
        assert t.info["summaries"] >= 3 and len(t.segments) == t.info["summaries"] + 1
        assert all(len(s.token_ids) <= MAX_CONTEXT for s in t.segments)
        assert t.policy_version == 3 and t.group_id == "g0"


def test_segment_structure_and_masks(episodes):
    from rollout.agent import SUMMARY_HEADER, SUMMARY_REQUEST

    trajectories, tok, prompt_text = episodes
    prompt = tok.encode(prompt_text)
    request = tok.encode(SUMMARY_REQUEST)
    for t in trajectories:
        for i, s in enumerate(t.segments):
            tokens = s.token_ids.tolist()
            assert tokens[: len(prompt)] == prompt and not s.loss_mask[: len(prompt)].any()
            assert (s.logprobs[~s.loss_mask] == 0).all() and (s.logprobs[s.loss_mask] <= 0).all() and s.loss_mask.any()
            assert s.routed_experts.shape == (len(tokens) - 1, 2, 2)
            if i + 1 < len(t.segments):
                # a segment that was summarized ends with: the request (not trained), then the summary (trained) ...
                summary_start = len(tokens) - int(np.argmin(s.loss_mask[::-1]))
                assert tokens[summary_start - len(request): summary_start] == request
                summary = tokens[summary_start:]
                # ... and the next segment restarts from the task, the summary and the latest test results
                restart = t.segments[i + 1].token_ids.tolist()
                header = tok.encode(SUMMARY_HEADER)
                assert restart[len(prompt): len(prompt) + len(header) + len(summary)] == header + summary


def test_segments_share_the_episode_advantage(episodes):
    from recipes.schema import RLSection
    from rl.learner_main import learner_sequences

    trajectories, _, _ = episodes
    trajectories[0].reward, trajectories[1].reward = 1.0, 0.0
    sequences = learner_sequences([trajectories], RLSection(advantage="group_mean"), step=0)
    n0 = len(trajectories[0].segments)
    assert [s.advantage for s in sequences] == [0.5] * n0 + [-0.5] * len(trajectories[1].segments)


def test_summarization_metrics(episodes):
    from rollout.trajectories import episode_stats

    trajectories, _, _ = episodes
    stats = episode_stats(trajectories, MAX_CONTEXT)
    assert stats["summaries_per_episode"] >= 3
    assert stats["episode_tokens_over_context"] >= 5
    assert 0 < stats["summary_tokens_mean"] <= 48
    assert "reward_with_summaries" in stats and "reward_without_summaries" not in stats


def test_tools_run_the_solution_and_test_the_last_one(parts):
    from rollout.agent import RUN_HEADER, TOOLS_GUIDE, EpisodeRunner, _Episode, _SegmentBuilder
    from rollout.engine import Completion

    engine, tok, env = parts
    runner = EpisodeRunner(engine, tok, env, ROLLOUT.model_copy(update={"tools": True, "summarize_at": None}))
    task = env.pool.task(1, 0)  # HumanEval/0: has_close_elements
    episode = _Episode("e", 0, tok.encode(task.prompt + TOOLS_GUIDE), [_SegmentBuilder()])

    def reply(text: str) -> str:
        ids = tok.encode(text)
        tool, sandbox_work = runner._turn(task, episode, Completion([], ids, [0.0] * len(ids), None, "stop"))
        runner._after_turn(task, episode, tool, sandbox_work())
        return tok.decode(episode.last_observation)

    seen = reply("```python\ndef has_close_elements(numbers, threshold):\n    return False\nprint(6 * 7)\n```\nRUN")
    assert seen.startswith(RUN_HEADER) and "42" in seen and "[exit 0]" in seen
    assert episode.result is None and not episode.done  # RUN shows output; the hidden tests did not run
    seen = reply("```python\nraise ValueError('boom')\n```\nRUN")
    assert "ValueError: boom" in seen and "crash" in seen
    seen = reply("Back to the first idea.\n```python\ndef has_close_elements(numbers, threshold):\n    return False\n```")
    assert "tests passed" in seen and 0 < episode.result.reward < 1  # no tool named: TEST
    solved = "def has_close_elements(numbers, threshold):\n    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])"
    reply(f"```python\n{solved}\n```\nTEST")
    assert episode.done and episode.end_reason == "solved" and episode.result.reward == 1.0


def test_tool_episodes_with_the_real_engine(parts):
    from rollout.agent import TOOLS_GUIDE, EpisodeRunner

    engine, tok, env = parts
    runner = EpisodeRunner(engine, tok, env, ROLLOUT.model_copy(update={"tools": True, "max_turns": 3, "summarize_at": None}))
    task = env.pool.task(1, 0)
    for t in runner.run_group(task, "g1", group_size=2, policy_version=0, seed=2):
        tokens = t.segments[0].token_ids.tolist()
        assert tok.decode(tokens).startswith(task.prompt + TOOLS_GUIDE)
        assert t.info["end_reason"] in ("solved", "max_turns", "context_full") and t.info["turns"] <= 3
        assert t.info["tests_total"] > 0  # the last solution was scored, whatever the last tool was
        assert t.info["infra_failure"] is False and isinstance(t.info["flags"], list) and t.info["canary"] is False
