"""Self-summarization trained by RL, through the real learner (Megatron-Core, the tiny MoE, world size 1, CPU).

Two scripted episodes of one group, each compacted once (the agent loop's layout): segment 0 is [task, reply,
observation, summary request, SUMMARY]; segment 1 restarts as [task, summary header, SUMMARY, observation, reply].
Both episodes act alike; only their summaries differ, and one episode is rewarded 1, the other 0. The engine's part
(the logprobs and expert routes of each segment, recorded in the context the tokens were generated in) is simulated
by the learner's own starting weights with free routing, as vLLM would report them for the same weights.

What a user relies on: the summary is trained in the context it was written in (the learner recomputes exactly the
recorded logprobs, with the recorded routes, there, not in the context that shows it again), and the episode's
reward moves it: after a few learner steps the rewarded episode's summary is more likely and the other less.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from composer.recipes.loader import load_recipe
from composer.recipes.schema import OptimSection, ParallelismSection, RLSection, TrainSection
from composer.rollout.agent.trajectory import Segment, Trajectory

pytestmark = pytest.mark.engines

REPO = Path(__file__).resolve().parents[2]
VOCAB = 512


def span(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1, VOCAB, n).tolist()


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    from composer.trainer.checkpoint_init import init_hf_checkpoint
    from composer.trainer.distributed import shutdown_distributed
    from composer.trainer.rl_learner import RLLearner

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("summary-credit")
    model = load_recipe(REPO / "recipes/smoke-midtrain.yaml", [f"model.vocab_size={VOCAB}"]).model
    checkpoint = init_hf_checkpoint(model, root / "init", tokenizer_bytes=2**16)
    model = model.model_copy(update={"checkpoint": str(checkpoint)})
    rl = RLSection(group_size=2, advantage="group_mean", skip_uniform_groups=False)
    train = TrainSection(steps=6, micro_batch_size=4, global_batch_size=4)  # the two tests take 3 steps each
    yield RLLearner(
        model, ParallelismSection(), OptimSection(lr=3e-3, weight_decay=0.0, schedule="constant"), train, rl, root / "checkpoints"
    )
    shutdown_distributed()


def engine_record(learner, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """What the engine reports for one segment: per token the logprob given the tokens before it (0 for token 0) and
    per position the experts every layer routed to ([T-1, layers, top_k])."""
    from composer.trainer.logprobs import layout_for, sequence_logprobs
    from composer.trainer.router_replay import routing

    model, m = learner.core.model, learner.core.model_section
    layout = layout_for(model, [len(tokens)], packed=False)
    with routing(model) as used:
        logprobs = sequence_logprobs(model, layout, [np.array(tokens)], with_grad=False)
    routes = torch.zeros(len(tokens), m.num_layers, m.moe_top_k, dtype=torch.int64)
    routes[:, used.layers] = used.routes()[0]
    return np.concatenate([[0.0], logprobs[0].numpy()]), routes[:-1].numpy()


def episode(learner, rng, name: str, shared: dict[str, list[int]], summary: list[int], reward: float) -> tuple[Trajectory, slice]:
    """A compacted episode, each segment recorded in its own context; the summary's place in segment 0."""
    task, reply, seen, request, header, later, reply2 = (
        shared[k] for k in ("task", "reply", "seen", "request", "header", "later", "reply2")
    )
    layouts = [
        [(task, False), (reply, True), (seen, False), (request, False), (summary, True)],
        [(task, False), (header, False), (summary, False), (later, False), (reply2, True)],
    ]
    segments = []
    for parts in layouts:
        tokens = [t for ids, _ in parts for t in ids]
        mask = np.concatenate([np.full(len(ids), trained) for ids, trained in parts])
        logprobs, routes = engine_record(learner, tokens)
        segments.append(Segment(tokens, mask, np.where(mask, logprobs, 0.0), routes))
    start = len(segments[0].token_ids) - len(summary)
    info = {"summaries": 1, "summary_tokens": [len(summary)], "compactions": 1}
    return Trajectory(name, "g", "scripted/0", 0, reward, segments, info), slice(start, start + len(summary))


def logprobs_in(learner, tokens: np.ndarray, routes: np.ndarray | None) -> np.ndarray:
    """The learner's current logprob of each token of a sequence (replaying `routes` when given)."""
    from composer.trainer.logprobs import layout_for, sequence_logprobs
    from composer.trainer.router_replay import replay_for_micro_batch, routing

    model = learner.core.model
    layout = layout_for(model, [len(tokens)], packed=False)
    replay = replay_for_micro_batch(model, "r3", [routes], layout) if routes is not None else None
    with routing(model, replay):
        return np.concatenate([[0.0], sequence_logprobs(model, layout, [tokens], with_grad=False)[0].numpy()])


def test_summary_tokens_are_trained_in_their_own_context_by_the_episode_reward(learner):
    from composer.rl.learner_main import learner_sequences

    rng = np.random.default_rng(0)
    shared = {
        k: span(rng, n) for k, n in (("task", 12), ("reply", 6), ("seen", 10), ("request", 5), ("header", 4), ("later", 8), ("reply2", 6))
    }
    good, good_span = episode(learner, rng, "g-0", shared, span(rng, 8), reward=1.0)
    bad, bad_span = episode(learner, rng, "g-1", shared, span(rng, 8), reward=0.0)

    # The same summary tokens shown again in segment 1 have other logprobs there: the context matters.
    shown = good.segments[1].token_ids.tolist()
    summary = good.segments[0].token_ids[good_span].tolist()
    at = next(j for j in range(len(shown)) if shown[j : j + len(summary)] == summary)
    elsewhere = logprobs_in(learner, good.segments[1].token_ids, None)[at : at + len(summary)]
    recorded = good.segments[0].logprobs[good_span]
    assert np.abs(elsewhere - recorded).max() > 1e-2

    sequences = learner_sequences([[good, bad]], learner.rl, step=0)
    assert [len(s.tokens) for s in sequences] == [len(s.token_ids) for t in (good, bad) for s in t.segments]  # a sequence per segment
    assert [s.advantage for s in sequences] == [0.5, 0.5, -0.5, -0.5]
    before = {
        n: logprobs_in(learner, t.segments[0].token_ids, None)[s].sum() for n, (t, s) in enumerate(((good, good_span), (bad, bad_span)))
    }
    first = learner.train_step(sequences)
    # The learner recomputed every trained token, summaries included, in its segment with the engine's routes: the
    # logprobs it started from are the recorded ones, and its routers agree with the replayed routes.
    assert first["trained_tokens"] == sum(int(s.loss_mask[1:].sum()) for t in (good, bad) for s in t.segments)
    assert first["on_policy_logprob_abs_diff"] < 1e-5
    assert all(v == 0.0 for k, v in first.items() if k.startswith("routing_disagreement"))
    for _ in range(2):
        learner.train_step(learner_sequences([[good, bad]], learner.rl, step=1))
    after = {
        n: logprobs_in(learner, t.segments[0].token_ids, t.segments[0].routed_experts)[s].sum()
        for n, (t, s) in enumerate(((good, good_span), (bad, bad_span)))
    }
    assert after[0] > before[0] + 1.0  # the rewarded episode's summary, in its own context, became more likely
    assert after[1] < before[1] - 1.0  # the unrewarded one's less


def test_the_shaped_summary_term_trains_summaries_when_the_episode_rewards_tie(learner):
    """`rl.summary_reward`: both episodes score the same, so the task gives no signal; the summary that kept the facts
    still needed (share 1) is pushed up and the one that lost them (share 0), through the per-token advantage."""
    from composer.rl.learner_main import learner_sequences

    rng = np.random.default_rng(1)
    shared = {
        k: span(rng, n) for k, n in (("task", 12), ("reply", 6), ("seen", 10), ("request", 5), ("header", 4), ("later", 8), ("reply2", 6))
    }
    kept, kept_span = episode(learner, rng, "k-0", shared, span(rng, 8), reward=0.5)
    lost, lost_span = episode(learner, rng, "k-1", shared, span(rng, 8), reward=0.5)
    kept.info["summary_kept"], lost.info["summary_kept"] = [1.0], [0.0]
    rl = learner.rl.model_copy(update={"summary_reward": 1.0})
    sequences = learner_sequences([[kept, lost]], rl, step=5)
    assert [s.advantage for s in sequences] == [0.0] * 4 and sequences[1].bonus is None and sequences[3].bonus is None
    before = [
        logprobs_in(learner, t.segments[0].token_ids, t.segments[0].routed_experts)[s].sum()
        for t, s in ((kept, kept_span), (lost, lost_span))
    ]
    for _ in range(3):
        learner.train_step(sequences)
    after = [
        logprobs_in(learner, t.segments[0].token_ids, t.segments[0].routed_experts)[s].sum()
        for t, s in ((kept, kept_span), (lost, lost_span))
    ]
    assert after[0] > before[0] + 1.0 and after[1] < before[1] - 1.0
