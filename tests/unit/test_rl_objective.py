"""The RL objective's maths: advantages, truncated IS weights, segment additivity, health metrics."""

import numpy as np
import pytest
import torch

from composer.recipes.schema import RLSection
from composer.trainer.rl_objective import group_advantages, policy_gradient_loss


def test_group_advantages():
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    assert np.allclose(group_advantages(rewards, "group_mean"), [0.5, -0.5, -0.5, 0.5])
    assert np.allclose(group_advantages(rewards, "group_mean_std"), [1, -1, -1, 1], atol=1e-5)
    assert np.allclose(group_advantages(np.ones(4), "group_mean_std"), 0)  # no signal, no nan


def batch(seed=0, b=3, t=6):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3
    return lp, lp + 0.1 * torch.randn(b, t, generator=g), torch.tensor([1.0, -0.5, 2.0])[:b], torch.rand(b, t, generator=g) > 0.3


def test_on_policy_gradient_is_plain_policy_gradient():
    lp, _, adv, mask = batch()
    lp = lp.clone().requires_grad_(True)
    loss, stats = policy_gradient_loss(lp, lp.detach(), adv, mask, RLSection(), normaliser=10.0)
    loss.backward()
    expected = -(adv.unsqueeze(-1) * mask) / 10.0
    assert torch.allclose(lp.grad, expected)
    m = stats.finalize()
    assert m["logprob_abs_diff"] == 0 and m["prob_ratio_mean"] == pytest.approx(1.0) and m["is_clip_fraction"] == 0


def test_truncated_importance_weights():
    lp, rollout, adv, mask = batch()
    rollout = lp - torch.log(torch.tensor(3.0))  # learner prob 3x the rollout prob on every token
    lp = lp.clone().requires_grad_(True)
    loss, stats = policy_gradient_loss(lp, rollout, adv, mask, RLSection(is_cap=2.0), normaliser=1.0)
    loss.backward()
    assert torch.allclose(lp.grad, -2.0 * adv.unsqueeze(-1) * mask)  # weight capped at 2, not 3
    m = stats.finalize()
    assert m["is_clip_fraction"] == pytest.approx(1.0) and m["prob_ratio_mean"] == pytest.approx(3.0, rel=1e-5)


def test_sequence_level_weights_share_one_ratio():
    lp, rollout, adv, mask = batch()
    lp = lp.clone().requires_grad_(True)
    loss, _ = policy_gradient_loss(lp, rollout, adv, mask, RLSection(is_level="sequence", is_cap=100.0), normaliser=1.0)
    loss.backward()
    seq_ratio = torch.exp(((lp.detach() - rollout) * mask).sum(-1, keepdim=True))
    assert torch.allclose(lp.grad, -seq_ratio * adv.unsqueeze(-1) * mask)


def test_loss_of_a_segmented_episode_is_the_sum_of_its_segments():
    lp, rollout, adv, mask = batch(b=1, t=12)
    whole, _ = policy_gradient_loss(lp, rollout, adv, mask, RLSection(), normaliser=7.0)
    parts = [
        policy_gradient_loss(lp[:, s], rollout[:, s], adv, mask[:, s], RLSection(), normaliser=7.0)[0] for s in (slice(0, 5), slice(5, 12))
    ]
    assert torch.allclose(whole, sum(parts))


def test_kl_penalty_pulls_towards_reference():
    lp, _, adv, mask = batch()
    lp = lp.clone().requires_grad_(True)
    ref = lp.detach() - 0.5
    loss, stats = policy_gradient_loss(
        lp, lp.detach(), torch.zeros_like(adv), mask, RLSection(kl_coeff=1.0), normaliser=1.0, ref_logprobs=ref
    )
    loss.backward()
    assert stats.finalize()["kl_ref"] > 0
    assert (lp.grad[mask] > 0).all()  # gradient descent lowers logprobs towards the (lower) reference


# --- stability options (rl.* keys): each one's effect on the gradient, on synthetic data -------------------------


def grad_of(lp, rollout, adv, mask, rl, normaliser=1.0, **kw):
    lp = lp.clone().requires_grad_(True)
    loss, stats = policy_gradient_loss(lp, rollout, adv, mask, rl, normaliser=normaliser, **kw)
    loss.backward()
    return lp.grad, stats.finalize()


def test_uniform_groups_carry_no_signal():
    from composer.trainer.rl_objective import has_signal

    assert not has_signal(np.array([0.25, 0.25, 0.25])) and not has_signal(np.zeros(8))
    assert has_signal(np.array([0.0, 0.0, 1.0]))
    # what skipping saves: a uniform group's zero advantages still count in the token-mean normaliser,
    # so without the skip the informative group's gradient is diluted by the uniform group's share of tokens
    lp, rollout, _, mask = batch(b=2)
    adv = torch.tensor([1.0, 0.0])  # sequence 1 belongs to a uniform group
    diluted, _ = grad_of(lp, lp.detach(), adv, mask, RLSection(), normaliser=float(mask.sum()))
    skipped, _ = grad_of(lp[:1], lp[:1].detach(), adv[:1], mask[:1], RLSection(), normaliser=float(mask[:1].sum()))
    assert torch.allclose(skipped, diluted[:1] * float(mask.sum()) / float(mask[:1].sum()))


def test_learner_leaves_uniform_groups_out():
    from composer.rl.learner_main import learner_sequences
    from composer.rollout.agent.trajectory import Segment, Trajectory

    def trajectory(reward, version=3):
        seg = Segment(np.arange(4), np.array([0, 1, 1, 1], bool), np.zeros(4))
        return Trajectory(f"t{reward}-{version}", "g", "task", version, reward, [seg])

    groups = [[trajectory(1.0), trajectory(1.0)], [trajectory(0.0), trajectory(1.0, version=2)]]
    kept = learner_sequences(groups, RLSection(), step=3)
    assert [s.advantage for s in kept] == pytest.approx([-1, 1], abs=1e-5)  # only the second group trains
    assert [s.on_policy for s in kept] == [True, False]  # made by the weights of step 3, and one step older
    assert len(learner_sequences(groups, RLSection(skip_uniform_groups=False), step=3)) == 4
    # a step without any signal keeps its groups (zero advantages): the optimizer steps and checkpoints its state
    uniform = learner_sequences(groups[:1], RLSection(), step=3)
    assert len(uniform) == 2 and all(s.advantage == 0 for s in uniform)


def test_geometric_mean_ratio_is_length_normalised():
    lp, _, adv, mask = batch()
    mask[:] = True
    rollout = lp - 0.01  # every token's ratio is e^0.01
    grad, _ = grad_of(lp, rollout, adv, mask, RLSection(is_level="geometric", is_cap=100.0))
    assert torch.allclose(grad, -np.exp(0.01) * adv.unsqueeze(-1) * mask.float(), rtol=1e-5)  # not e^(0.01 T)
    seq_grad, _ = grad_of(lp, rollout, adv, mask, RLSection(is_level="sequence", is_cap=100.0))
    assert torch.allclose(seq_grad, -np.exp(0.01 * mask.shape[1]) * adv.unsqueeze(-1) * mask.float(), rtol=1e-5)


def test_token_mask_band_drops_tokens_outside_it():
    lp, _, adv, mask = batch(t=4)
    mask[:] = True
    shift = torch.tensor([0.0, 0.1, 1.0, -1.0])  # ratios 1, 1.105, e, 1/e per position
    rollout = lp - shift
    grad, m = grad_of(lp, rollout, adv, mask, RLSection(is_mask=(0.5, 2.0), is_cap=5.0))
    assert (grad[:, 2:] == 0).all()  # e and 1/e fall outside [0.5, 2]: no gradient at all (truncation would keep e capped)
    assert torch.allclose(grad[:, :2], -torch.exp(shift[:2]) * adv.unsqueeze(-1))
    assert m["is_mask_fraction"] == pytest.approx(0.5) and m["is_clip_fraction"] == 0


def test_sequence_mask_band_drops_whole_sequences():
    lp, _, adv, mask = batch(t=4)
    mask[:] = True
    rollout = lp.clone()
    rollout[1] -= 0.5  # sequence 1 drifted: its sequence ratio is e^2
    grad, m = grad_of(lp, rollout, adv, mask, RLSection(is_level="sequence", is_mask=(0.5, 2.0), is_cap=10.0))
    assert (grad[1] == 0).all() and (grad[0] != 0).all() and (grad[2] != 0).all()
    assert m["is_mask_fraction"] == pytest.approx(1 / 3)


def test_sequence_mean_weighs_episodes_not_tokens():
    from composer.trainer.rl_learner import LearnerSequence, sequence_normalisers

    def seq(episode, trained):
        mask = np.array([False] + [True] * trained)
        return LearnerSequence(np.zeros(trained + 1), mask, np.zeros(trained + 1), 1.0, None, episode=episode)

    # episode a: 2 tokens; episode b: 8 tokens in two segments (summarized)
    sequences = [seq("a", 2), seq("b", 6), seq("b", 2)]
    assert sequence_normalisers(sequences, "token_mean") == [10.0] * 3
    assert sequence_normalisers(sequences, "sequence_mean") == [4.0, 16.0, 16.0]  # tokens of the episode x 2 episodes
    # on-policy, unit advantage: each token's gradient is -1/normaliser; per episode they add to 1/2 each
    lp = torch.zeros(3, 6)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, :2], mask[1, :6], mask[2, :2] = True, True, True
    grad, _ = grad_of(lp, lp, torch.ones(3), mask, RLSection(), normaliser=torch.tensor(sequence_normalisers(sequences, "sequence_mean")))
    assert float(-grad[0].sum()) == pytest.approx(0.5) and float(-grad[1:].sum()) == pytest.approx(0.5)
    tok, _ = grad_of(lp, lp, torch.ones(3), mask, RLSection(), normaliser=10.0)
    assert float(-tok[0].sum()) == pytest.approx(0.2)  # token mean: the short episode gets 2 of 10 tokens' weight


def test_std_normalisation_rescales_each_group_to_unit_spread():
    rare = np.array([1.0, 0, 0, 0, 0, 0, 0, 0])  # one success in eight
    common = np.array([1.0, 1, 1, 1, 1, 1, 1, 0])
    for rewards in (rare, common):
        a = group_advantages(rewards, "group_mean_std")
        assert a.mean() == pytest.approx(0, abs=1e-9) and a.std() == pytest.approx(1, abs=1e-4)
    # without it, a rare success in a group moves the policy less than with it (0.875 vs 2.65)
    assert group_advantages(rare, "group_mean")[0] == pytest.approx(0.875)
    assert group_advantages(rare, "group_mean_std")[0] == pytest.approx(2.6457, abs=1e-3)


def test_entropy_and_on_policy_mismatch_metrics():
    lp, rollout, adv, mask = batch()
    on_policy = torch.tensor([True, False, True])
    rollout = rollout.clone()
    rollout[0] = lp[0]  # sequence 0: same weights, same numbers; sequence 2: an engine that is off by 0.3 nats
    rollout[2] = lp[2] - 0.3
    _, m = grad_of(lp, rollout, adv, mask, RLSection(), on_policy=on_policy)
    fresh = mask[[0, 2]].float()
    assert m["entropy"] == pytest.approx(float(-(lp * mask).sum() / mask.sum()), rel=1e-5)
    assert m["on_policy_logprob_abs_diff"] == pytest.approx(float(0.3 * fresh[1].sum() / fresh.sum()), rel=1e-4)
    expected_ratio = float((fresh[0].sum() + np.exp(0.3) * fresh[1].sum()) / fresh.sum())
    assert m["on_policy_prob_ratio_error"] == pytest.approx(expected_ratio - 1, rel=1e-4)


def test_alarms_fire_above_their_thresholds():
    from composer.rl.learner_main import alarm_message, health_alarms

    rl = RLSection()
    quiet = health_alarms({"on_policy_prob_ratio_error": 0.01, "on_policy_logprob_abs_diff": 0.02}, rl)
    assert quiet == {"alarm_ratio_error": 0.0, "alarm_logprob_diff": 0.0} and alarm_message(3, quiet, rl) is None
    loud = {"on_policy_prob_ratio_error": 0.2, "on_policy_logprob_abs_diff": 0.02}
    loud.update(health_alarms(loud, rl))
    assert loud["alarm_ratio_error"] == 1.0 and loud["alarm_logprob_diff"] == 0.0
    assert "ALARM step 3" in alarm_message(3, loud, rl) and "rl.alarm_ratio_error" in alarm_message(3, loud, rl)
    assert health_alarms({}, rl) == quiet  # a step without on-policy tokens raises nothing


def test_the_learner_scores_tokens_at_the_sampling_temperature(tmp_path):
    """At temperature T the learner's logprobs are log_softmax(logits / T) (the distribution the engine sampled
    from and reports), so on-policy tokens get ratio 1; the untempered ones would be off by far more than noise."""
    from composer.recipes.loader import load_recipe
    from composer.recipes.schema import ParallelismSection
    from composer.trainer.distributed import init_distributed, shutdown_distributed
    from composer.trainer.logprobs import token_logprobs
    from composer.trainer.model import build_model, forward_logits
    from tests.conftest import RECIPES

    moe = load_recipe(RECIPES / "smoke-rl.yaml").model
    dense = moe.model_copy(update=dict(family="llama", num_experts=0, moe_top_k=0, moe_ffn_hidden_size=0, ffn_hidden_size=64, num_layers=1))
    init_distributed(ParallelismSection())
    try:
        model = build_model(dense, ParallelismSection())
        tokens = torch.randint(1, dense.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            sampled_from = torch.log_softmax(forward_logits(model, tokens).float() / 0.7, dim=-1)[:, :-1]
        engine = sampled_from.gather(-1, tokens[:, 1:, None]).squeeze(-1)
        tempered = token_logprobs(model, tokens, temperature=0.7)
        assert torch.allclose(tempered, engine, atol=1e-5)
        mask, adv, on_policy = torch.ones_like(engine, dtype=torch.bool), torch.tensor([1.0, -1.0]), torch.tensor([True, True])
        loss, stats = policy_gradient_loss(tempered, engine, adv, mask, RLSection(), 1.0, on_policy=on_policy)
        loss.backward()
        assert stats.finalize()["on_policy_prob_ratio_error"] < 1e-4
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        untempered = token_logprobs(model, tokens, with_grad=False)
        _, stats = policy_gradient_loss(untempered, engine, adv, mask, RLSection(), 1.0, on_policy=on_policy)
        assert stats.finalize()["on_policy_logprob_abs_diff"] > 0.01
    finally:
        shutdown_distributed()
