"""Live vLLM engines (embedded and server) moved to a new policy in place from its sync delta: only the layers
whose tensors changed are reloaded, and the result is bit-exact with an engine started on the full checkpoint."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from composer.recipes.errors import UserError
from composer.recipes.schema import RolloutSection, SamplingSection
from composer.sync.pusher import push_version
from composer.sync.receiver import pull, update_in_place
from composer.sync.store import Store
from tests.helpers.sync_testing import sync_section
from tests.helpers.tiny_hf import hf_logprobs_and_routes, make_tiny_qwen3_moe, perturb_checkpoint

pytestmark = pytest.mark.engines

SEQS = [[5, 17, 99, 3, 250, 41, 7, 8], [300, 2, 2, 9, 64, 128, 77, 1, 400, 33]]
LONG_PROMPT = [(7 * i + 3) % 500 for i in range(160)]  # spans full KV blocks, so it is prefix-cached
ROLLOUT = RolloutSection(max_context=256, kv_cache_gib=0.0625, dtype="float32", sampling=SamplingSection(max_tokens=8))
# v1 changes a few values in three tensors, each feeding a different kind of fused vLLM layer.
EDITED = [
    "model.embed_tokens.weight",  # tied with lm_head
    "model.layers.0.self_attn.k_proj.weight",  # one third of a fused qkv
    "model.layers.1.mlp.experts.3.down_proj.weight",
]  # one expert of a fused, CPU-prepacked expert layer


def _edit(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for name in EDITED:
        flat = tensors[name].view(-1)
        positions = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 50)]
        flat[positions] += torch.randn(positions.numel(), generator=gen) * 0.5
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    v0 = make_tiny_qwen3_moe(root / "v0", tie=True)
    v1 = _edit(v0, root / "v1")
    v2 = perturb_checkpoint(v1, root / "v2", seed=2)
    section = sync_section(root / "store", anchor_every=100)
    for checkpoint in (v0, v1, v2):
        push_version(checkpoint, section, cache_dir=root / "cache")
    return Store.open(str(root / "store")), {"v00000001": v0, "v00000002": v1, "v00000003": v2}


def _move(engine, store, receiver: Path, held: str, target: str) -> dict:
    """What a rollout host does: patch its receiver in place, then the engine reloads what changed."""
    update_in_place(store, receiver, target)
    new, old = store.manifest(target), store.manifest(held)
    return engine.update_weights((receiver / "current").resolve(), new.differing_tensors(old), new.piece_hashes())


def test_in_place_updates_equal_a_fresh_engine_embedded_and_server(store, tmp_path):
    from composer.rollout.engines.vllm_engine import EmbeddedEngine, ServerEngine, VllmServer

    store, checkpoints = store
    receiver = tmp_path / "receiver"
    pull(store, receiver, "v00000001")
    engine = EmbeddedEngine(receiver / "current", ROLLOUT, seed=0, routed_experts=True)
    engine.generate([LONG_PROMPT], max_tokens=2, seeds=[0])  # fills the prefix cache under v0

    applied = _move(engine, store, receiver, "v00000001", "v00000002")
    assert set(EDITED) <= set(applied["tensors"])
    # whole layers, and nothing else: q, k, v of layer 0 and all 8 experts of layer 1 plus the embedding
    assert len(applied["tensors"]) == 1 + 3 + 8 * 3 and applied["layers"] == 3
    assert len(list((receiver / "versions").iterdir())) == 1  # no second copy on disk
    in_place = engine.prompt_logprobs(SEQS)
    expected, _ = hf_logprobs_and_routes(checkpoints["v00000002"], SEQS)
    assert max(np.max(np.abs(np.array(e) - np.array(g))) for e, g in zip(expected, in_place)) < 1e-4
    old, _ = hf_logprobs_and_routes(checkpoints["v00000001"], SEQS)
    assert max(np.max(np.abs(np.array(e) - np.array(g))) for e, g in zip(old, in_place)) > 1e-3
    [[cached]] = engine.generate([LONG_PROMPT], max_tokens=4, seeds=[0])  # the prefix cache was reset

    server_rollout = ROLLOUT.model_copy(update={"engine": "server"})
    with VllmServer(checkpoints["v00000002"], server_rollout, seed=0, routed_experts=True, log_path=tmp_path / "vllm.log") as server:
        fresh = ServerEngine(server.url, server_rollout, model=str(checkpoints["v00000002"]))
        assert engine.weights_digest() == fresh.weights_digest()  # every parameter and prepacked buffer, bitwise
        [[from_fresh]] = fresh.generate([LONG_PROMPT], max_tokens=4, seeds=[0])
        assert from_fresh.token_ids == cached.token_ids
        assert np.allclose(from_fresh.logprobs, cached.logprobs, atol=1e-5, rtol=0)

        # the server in place (over HTTP) against the embedded engine fully reloaded on the same version
        _move(fresh, store, receiver, "v00000002", "v00000003")
        engine.load_weights(checkpoints["v00000003"])
        assert fresh.weights_digest() == engine.weights_digest()
        [[a]] = fresh.generate([SEQS[0]], max_tokens=8, seeds=[1])
        [[b]] = engine.generate([SEQS[0]], max_tokens=8, seeds=[1])
        assert a.token_ids == b.token_ids and np.allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)

        # a receiver copy that does not match the manifest is refused, with the engine untouched
        before = engine.weights_digest()
        current = (receiver / "current").resolve()
        data = bytearray((current / "model.safetensors").read_bytes())
        data[-8] ^= 0x40  # the last tensor's last element
        (current / "model.safetensors").write_bytes(bytes(data))
        manifest = store.manifest("v00000003")
        with pytest.raises(UserError, match="do not match the version's manifest"):
            engine.update_weights(current, sorted(manifest.tensors), manifest.piece_hashes())
        assert engine.weights_digest() == before
