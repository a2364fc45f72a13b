"""The agent loop with real vLLM and the real sandbox: multi-turn episodes, self-summarization past the context."""

import numpy as np
import pytest

from composer.recipes.env_schema import EnvSection, TaskSet
from composer.recipes.loader import load_recipe
from composer.recipes.schema import RolloutSection, SamplingSection
from tests.conftest import RECIPES

pytestmark = pytest.mark.engines

MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    model = load_recipe(RECIPES / "smoke-midtrain.yaml").model
    return init_hf_checkpoint(model, tmp_path_factory.mktemp("agent") / "tiny", tokenizer_bytes=2**20)


ROLLOUT = RolloutSection(
    max_context=MAX_CONTEXT,
    max_turns=30,
    summarize_at=0.6,
    max_summaries=30,
    kv_cache_gib=0.0625,
    dtype="float32",
    sampling=SamplingSection(max_tokens=48),
)


@pytest.fixture(scope="module")
def parts(tiny_model, tmp_path_factory):
    """A real engine, tokenizer and coding environment (smoke and HumanEval tasks)."""
    from composer.rollout.agent.environment import CodingEnvironment
    from composer.rollout.agent.harness import Tokenizer
    from composer.rollout.engines.vllm_engine import EmbeddedEngine

    env = CodingEnvironment(
        EnvSection(tasks=[TaskSet(name="smoke"), TaskSet(name="humaneval")]), seed=0, sandbox_root=tmp_path_factory.mktemp("sandbox")
    )
    # The engine holds the tiny model's whole context (the tools episodes use it); the reply episodes stay in MAX_CONTEXT.
    engine = EmbeddedEngine(tiny_model, ROLLOUT.model_copy(update={"max_context": 1024}), seed=0, routed_experts=True)
    return engine, Tokenizer(str(tiny_model)), env


@pytest.fixture(scope="module")
def episodes(parts):
    from composer.rollout.agent.loop import EpisodeRunner

    engine, tokenizer, env = parts
    runner = EpisodeRunner(engine, tokenizer, env, ROLLOUT)
    task = env.pool.task(0, 0)
    return runner.run_group(task, "g0", group_size=2, policy_version=3, seed=1), tokenizer, task.prompt


def test_long_episodes_run_to_their_end_within_the_context(episodes):
    trajectories, _, _ = episodes
    for t in trajectories:
        assert t.info["end_reason"] in ("max_turns", "solved")
        assert t.num_tokens >= 5 * MAX_CONTEXT
        assert t.info["summaries"] >= 3 and len(t.segments) == t.info["summaries"] + 1
        assert all(len(s.token_ids) <= MAX_CONTEXT for s in t.segments)
        assert t.policy_version == 3 and t.group_id == "g0"


def test_segment_structure_and_masks(episodes):
    from composer.rollout.agent.loop import SUMMARY_HEADER, SUMMARY_REQUEST

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
                assert tokens[summary_start - len(request) : summary_start] == request
                summary = tokens[summary_start:]
                # ... and the next segment restarts from the task, the summary and the latest test results
                restart = t.segments[i + 1].token_ids.tolist()
                header = tok.encode(SUMMARY_HEADER)
                assert restart[len(prompt) : len(prompt) + len(header) + len(summary)] == header + summary


def test_segments_share_the_episode_advantage(episodes):
    from composer.recipes.schema import RLSection
    from composer.rl.learner_main import learner_sequences

    trajectories, _, _ = episodes
    trajectories[0].reward, trajectories[1].reward = 1.0, 0.0
    sequences = learner_sequences([trajectories], RLSection(advantage="group_mean"), step=0)
    n0 = len(trajectories[0].segments)
    assert [s.advantage for s in sequences] == [0.5] * n0 + [-0.5] * len(trajectories[1].segments)


def test_summarization_metrics(episodes):
    from composer.rl.trajectories import episode_stats

    trajectories, _, _ = episodes
    stats = episode_stats(trajectories, MAX_CONTEXT)
    assert stats["summaries_per_episode"] >= 3
    assert stats["episode_tokens_over_context"] >= 5
    assert 0 < stats["summary_tokens_mean"] <= 48
    assert "reward_with_summaries" in stats and "reward_without_summaries" not in stats


def test_tool_episodes_with_the_real_engine(parts):
    """The tools harness around real sampling: whatever the policy writes, the episode is graded, observations are
    untrained, routes cover every position, and self-summarization keeps each segment inside the context."""
    from composer.rollout.agent.loop import EpisodeRunner

    engine, tok, env = parts
    rollout = ROLLOUT.model_copy(update={"harness": "tools", "max_context": 1024, "max_turns": 6, "summarize_at": 0.8})
    runner = EpisodeRunner(engine, tok, env, rollout)
    task = env.pool.task(1, 0)
    for t in runner.run_group(task, "g1", group_size=2, policy_version=0, seed=2):
        assert t.info["end_reason"] in ("finished", "max_turns", "max_summaries", "context_full") and t.info["turns"] <= 6
        assert t.info["tests_total"] == 7 and t.info["infra_failure"] is False and t.info["canary"] is False
        assert t.info["tool_calls"] + t.info["tool_errors"] >= 1  # every reply is a call or an error observation
        for s in t.segments:
            assert len(s.token_ids) <= 1024 and s.loss_mask.any() and not s.loss_mask[0]
            assert s.routed_experts.shape == (len(s.token_ids) - 1, 2, 2)
            assert (s.logprobs[~s.loss_mask] == 0).all()
        assert "Tools (call one or more per reply" in tok.decode(t.segments[0].token_ids.tolist())
