"""The RL objective's maths: advantages, truncated IS weights, segment additivity, health metrics."""

import numpy as np
import pytest
import torch

from recipes.schema import RLSection
from trainer.rl_objective import group_advantages, policy_gradient_loss


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
    parts = [policy_gradient_loss(lp[:, s], rollout[:, s], adv, mask[:, s], RLSection(), normaliser=7.0)[0] for s in (slice(0, 5), slice(5, 12))]
    assert torch.allclose(whole, sum(parts))


def test_kl_penalty_pulls_towards_reference():
    lp, _, adv, mask = batch()
    lp = lp.clone().requires_grad_(True)
    ref = lp.detach() - 0.5
    loss, stats = policy_gradient_loss(lp, lp.detach(), torch.zeros_like(adv), mask, RLSection(kl_coeff=1.0), normaliser=1.0, ref_logprobs=ref)
    loss.backward()
    assert stats.finalize()["kl_ref"] > 0
    assert (lp.grad[mask] > 0).all()  # gradient descent lowers logprobs towards the (lower) reference
