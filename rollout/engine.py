"""vLLM inference engines: generation with per-token logprobs and routed experts, in-place weight updates."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recipes.errors import UserError
from recipes.schema import RolloutSection


@dataclass
class Completion:
    """One sampled continuation of a prompt, in token space."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Log-probability of each sampled token under the engine's policy."""
    routed_experts: np.ndarray | None
    """[len(prompt_ids) + len(token_ids) - 1, layers, top_k] expert ids (the last sampled token is never forwarded)."""
    finish_reason: str


class EmbeddedEngine:
    """A vLLM engine in this process (no EngineCore/worker subprocesses)."""

    def __init__(self, model_dir: str | Path, rollout: RolloutSection, *, seed: int, routed_experts: bool):
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise UserError(f"rollout: {model_dir} is not an HF checkpoint (no config.json)")
        # In-process engine: initialises in seconds instead of ~40 s with worker processes.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.routed_experts = routed_experts
        self._llm = LLM(
            model=str(model_dir),
            dtype=rollout.dtype,
            max_model_len=rollout.max_context,
            kv_cache_memory_bytes=int(rollout.kv_cache_gib * 2**30),
            enforce_eager=True,
            seed=seed,
            skip_tokenizer_init=not (model_dir / "tokenizer.json").is_file(),
            enable_return_routed_experts=routed_experts,
            enable_prefix_caching=True,
            worker_extension_cls="rollout.vllm_worker.WeightUpdateExtension",
        )
        self._sampling = rollout.sampling

    def generate(self, prompts: list[list[int]], n: int = 1, seed: int | None = None, max_tokens: int | None = None) -> list[list[Completion]]:
        """`n` samples per prompt; each carries the sampled tokens' logprobs (and routed experts when enabled)."""
        from vllm import SamplingParams, TokensPrompt

        s = self._sampling
        params = SamplingParams(
            n=n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=max_tokens or s.max_tokens,
            logprobs=0,  # the sampled token's own logprob
            seed=seed,
        )
        outputs = self._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [[_completion(out.prompt_token_ids, c) for c in out.outputs] for out in outputs]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probability of every token after the first under the current weights (teacher forcing)."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self._llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        return [[lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], seq[1:])] for out, seq in zip(outputs, sequences)]

    def load_weights(self, weights_dir: str | Path) -> None:
        """Swap in new policy weights between requests, without restarting the engine."""
        self._llm.collective_rpc("load_weights_from_dir", args=(str(weights_dir),))
        # Prompt KV computed under the old weights must not be reused.
        self._llm.reset_prefix_cache()


def _completion(prompt_ids: list[int], output) -> Completion:
    logprobs = [entry[token].logprob for entry, token in zip(output.logprobs, output.token_ids)]
    return Completion(
        prompt_ids=list(prompt_ids),
        token_ids=list(output.token_ids),
        logprobs=logprobs,
        routed_experts=output.routed_experts,
        finish_reason=output.finish_reason or "length",
    )
