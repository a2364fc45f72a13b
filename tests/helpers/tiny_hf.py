"""Tiny random HF Qwen3-MoE checkpoints for engine tests.

Built so that parity checks can fail: 2 KV groups of 2 query heads, randomised norm weights,
and a router scaled up so top-k margins exceed numerical noise.
"""

from pathlib import Path

import torch

from composer.trainer.checkpoint_init import randomize_for_parity


def make_tiny_qwen3_moe(out: Path, *, seed: int = 0, tie: bool = True, vocab: int = 512) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        torch_dtype="float32",
    )
    model = Qwen3MoeForCausalLM(config).eval()
    randomize_for_parity(model, router_std=1.0, seed=seed)
    model.save_pretrained(out)
    return out


def perturb_checkpoint(src: Path, dst: Path, seed: int) -> Path:
    """A 'next policy': the same model with every weight nudged, saved as a new checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05 * param.std())
    model.save_pretrained(dst)
    return dst


def hf_logprobs_and_routes(model_dir: Path, sequences: list[list[int]]) -> tuple[list[list[float]], list[torch.Tensor]]:
    """Teacher-forced logprobs of tokens 1.. and per-layer top-k expert ids [L][tokens, k], per sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logprobs, routes = [], []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            out = model(ids, output_router_logits=True)
            lp = torch.log_softmax(out.logits[0].double(), -1)
            logprobs.append([lp[i, seq[i + 1]].item() for i in range(len(seq) - 1)])
            k = model.config.num_experts_per_tok
            routes.append(torch.stack([r.topk(k, dim=-1).indices.sort(-1).values for r in out.router_logits]))
    return logprobs, routes
