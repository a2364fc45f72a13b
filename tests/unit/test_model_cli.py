"""`composer model init` makes a checkpoint transformers loads offline; bad inputs end in one clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.recipes.schema import ParallelismSection
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.model import check_supported

REPO = Path(__file__).resolve().parents[2]


def composer(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", "from composer.cli.main import main; main()", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def initialised(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("init")
    result = composer("model", "init", "tiny", "--set", "model.num_layers=1", cwd=work)
    assert result.returncode == 0, result.stderr
    return work / "tiny"


def test_init_checkpoint_loads_in_transformers_offline(initialised, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(initialised)
    model = AutoModelForCausalLM.from_pretrained(initialised)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.num_hidden_layers == 1 and model.config.num_experts == 8
    assert len(tokenizer) == model.config.vocab_size == 4096
    assert tokenizer.eos_token_id == model.config.eos_token_id
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text and len(ids) < len(text) / 2, "BPE merges learnt from the stdlib"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 4096) and torch.isfinite(logits).all()
    norms = model.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norms, torch.ones_like(norms)), "norm weights are randomised for parity tests"


def test_init_refuses_existing_directory_and_leaves_nothing_behind(initialised):
    before = sorted(p.name for p in initialised.parent.iterdir())
    result = composer("model", "init", "tiny", cwd=initialised.parent)
    assert result.returncode == 2 and "already exists" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in initialised.parent.iterdir()) == before


def test_init_refuses_what_the_provider_does_not_build(tmp_path):
    result = composer("model", "init", "shared", "--set", "model.num_shared_experts=2", cwd=tmp_path)
    assert result.returncode == 2 and "num_shared_experts" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(UserError, match="no such checkpoint directory"):
        model_section_from_hf(tmp_path / "nowhere")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(UserError, match="model_type 'mamba' is not supported"):
        model_section_from_hf(tmp_path)


def test_unsupported_setting_of_a_known_family(initialised, tmp_path):
    config = json.loads((initialised / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0]}))
    with pytest.raises(UserError, match="mlp_only_layers"):
        model_section_from_hf(tmp_path)


def test_config_without_required_keys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(UserError, match="missing key.*num_hidden_layers"):
        model_section_from_hf(tmp_path)


@pytest.mark.parametrize(
    ("parallelism", "message"),
    [
        (ParallelismSection(ep=3), "parallelism.ep: 3 does not divide model.num_experts=8"),
        (ParallelismSection(tp=4, sequence_parallel=True), "parallelism.tp: 4 does not divide model.num_kv_heads=2"),
        (ParallelismSection(tp=2), "parallelism.sequence_parallel: must be true"),
        (ParallelismSection(pp=4), "parallelism.pp: 4 does not divide model.num_layers=2"),
    ],
)
def test_parallel_sizes_the_model_cannot_be_split_by(parallelism, message):
    model = load_recipe(REPO / "recipes/smoke-midtrain.yaml", []).model
    with pytest.raises(UserError, match=message):
        check_supported(model, parallelism)


def test_context_parallelism_is_refused_with_megatrons_local_attention():
    model = load_recipe(REPO / "recipes/smoke-midtrain.yaml", ["model.kernels.attention=local"]).model
    with pytest.raises(UserError, match="context parallelism runs in model.kernels.attention sdpa"):
        check_supported(model, ParallelismSection(cp=2))


def test_model_info_of_a_config_alone(tmp_path):
    """What a user checks a download with: no weights present, the published sizes (Kimi-K2: 1T total, 32B active)."""
    import torch

    from composer.trainer.model import hf_config_from_model_section

    model = load_recipe(REPO / "recipes/kimi-k2-rl.yaml", []).model
    config = hf_config_from_model_section(model, torch.bfloat16)
    # as in Kimi-K2's own config.json: YaRN RoPE scaling in the older rope_scaling key, block fp8 weights
    yarn = {
        "type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    published = {
        **config,
        "model_type": "kimi_k2",
        "rope_parameters": None,
        "rope_scaling": yarn,
        "rope_theta": 50000.0,
        "quantization_config": fp8,
    }
    (tmp_path / "config.json").write_text(json.dumps(published))
    result = composer("model", "info", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "training yes: composer's provider builds it" in out
    assert "family deepseek_v3 (model_type kimi_k2)" in out and "layers 61, hidden 7168, vocab 163840" in out
    assert "multi-head latent attention: 64 heads, kv_lora_rank 512, q_lora_rank 1536" in out
    assert "rope theta 50000, YaRN x32 from 4096 (beta 1/1, mscale 1/1)" in out
    assert "384 routed top-8 + 1 shared (60 MoE layers, first 1 dense)" in out
    assert "parameters 1026.41 B total, 32.86 B active per token" in out
    assert "weights 1911.8 GiB in bf16, 955.9 GiB in fp8 (without scales); stored: fp8 e4m3 blocks 128x128 (weight_scale_inv)" in out
    (tmp_path / "config.json").write_text(json.dumps({**published, "rope_scaling": {**yarn, "type": "longrope"}}))
    result = composer("model", "info", str(tmp_path), cwd=tmp_path)
    assert "training no: not built by composer's provider: rope_scaling.type 'longrope'" in " ".join(result.stdout.split())
    assert result.returncode == 2  # it cannot train it: non-zero, the reason on one line
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"composer cannot train {tmp_path}: not built by composer's provider: rope_scaling.type 'longrope'")


def test_parameter_counts_match_published_sizes_and_stored_weights(tmp_path):
    import math

    from safetensors import safe_open

    from composer.recipes.sizes import parameter_counts
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    qwen = load_recipe(REPO / "recipes/qwen3-30b-a3b-midtrain.yaml", []).model
    assert [round(n / 1e9, 1) for n in parameter_counts(qwen)] == [30.5, 3.4]  # Qwen3-30B-A3B: 30.5B, 3.3B active
    for recipe in ("smoke-midtrain", "smoke-deepseek-v3-midtrain"):
        m = load_recipe(REPO / f"recipes/{recipe}.yaml", ["model.vocab_size=512"]).model
        out = init_hf_checkpoint(m, tmp_path / recipe, tokenizer_bytes=2**18)
        with safe_open(out / "model.safetensors", "pt") as f:
            stored = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        assert parameter_counts(model_section_from_hf(out))[0] == stored, recipe


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 3}), r"missing key\(s\) for a deepseek_v3 model"),
        (json.dumps({"model_type": ["llama"]}), "model_type \\['llama'\\] is not supported"),
    ],
)
def test_config_json_of_the_wrong_shape(tmp_path, config, message):
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(UserError, match=message):
        model_section_from_hf(tmp_path)


def test_model_info_bad_input_is_one_line(initialised, tmp_path):
    config = json.loads((initialised / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "many"}))
    result = composer("model", "info", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "num_layers: Input should be a valid integer" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
