"""Published DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 checkpoints in and out, on tiny twins in their published layouts
(tests/helpers/published_twins.py): config acceptance (kimi_k2, the kimi_k25 wrapper, YaRN, MTP layers), Megatron vs
transformers parity in fp32 past YaRN's original context, bit-exact import -> export of block fp8 and INT4 (MTP
layers and vision tower carried), the INT4 fixed point of a bf16 master, and bad checkpoints refused in one line
before any rank starts.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from composer.recipes.errors import UserError
from composer.trainer.hf_config import model_section_from_hf
from tests.conftest import run_composer
from tests.helpers.published_twins import DEEPSEEK_V3, make_twin, twin_config, write_reference
from tests.helpers.tiktoken_checkpoint import write_tiktoken_tokenizer

REPO = Path(__file__).resolve().parents[2]
KINDS = ("deepseek_v3", "kimi_k2", "kimi_k2_thinking", "kimi_k25")
"""The architectures' twins (parity tests); DeepSeek-V3.1 differs from V3 in its scales only (round trips)."""
STORED = (*KINDS, "deepseek_v3_1")
QUANTIZE = {"deepseek_v3": "fp8", "deepseek_v3_1": "fp8", "kimi_k2": "fp8", "kimi_k2_thinking": "int4", "kimi_k25": "int4"}


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("twins")
    out = {kind: make_twin(root / kind, kind) for kind in STORED}
    write_tiktoken_tokenizer(out["kimi_k25"])  # Kimi's tokenizer is tiktoken code it ships
    return out


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t for file in sorted(directory.glob("*.safetensors")) for name, t in load_file(file).items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- configs: accepted as published, checked before launch ---------------------------------------------------


def test_published_configs_are_read_as_deepseek_v3_with_yarn_and_mtp(twins):
    from composer.trainer.hf_checkpoint import CheckpointLayout

    for kind, twin in twins.items():
        m = model_section_from_hf(twin)
        language = twin_config(kind).get("text_config", twin_config(kind))
        assert m.family == "deepseek_v3", kind
        assert m.yarn.factor == language["rope_scaling"]["factor"] and m.yarn.original_max_position_embeddings == 32, kind
        assert (m.yarn.beta_fast, m.yarn.beta_slow) == (language["rope_scaling"]["beta_fast"], language["rope_scaling"]["beta_slow"]), kind
        assert (m.yarn.mscale, m.yarn.mscale_all_dim) == (1.0, 1.0), kind
        assert m.num_mtp_layers == (1 if kind.startswith("deepseek_v3") else 0), kind
        layout = CheckpointLayout.of(twin)
        assert layout.quantization.method == QUANTIZE[kind], kind
        assert layout.prefix == ("language_model." if kind == "kimi_k25" else ""), kind
    assert {n.split(".")[0] for n in CheckpointLayout.of(twins["kimi_k25"]).carried(m)} == {"vision_tower", "mm_projector"}


def recipe_for(twin: Path, tmp_path: Path, **model) -> Path:
    """A midtrain recipe whose model section is the twin's (plus `model` overrides)."""
    import yaml

    section = model_section_from_hf(twin).model_dump(mode="json", exclude_defaults=True)
    recipe = {
        "run": {"name": "twin", "dir": str(tmp_path / "runs")},
        "model": {**section, **model},
        "optim": {"lr": 1e-3},
        "train": {"steps": 1, "global_batch_size": 1},
        "data": {"sources": [{"name": "stdlib", "paths": ["{stdlib}/json/*.py"]}], "seq_length": 64},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_validate_and_dry_run_read_the_checkpoint_and_name_the_key_that_differs(twins, tmp_path):
    ok = recipe_for(twins["kimi_k2"], tmp_path)
    result = run_composer("recipe", "validate", str(ok))
    assert result.returncode == 0, result.stderr
    # a recipe written for Kimi-K2 without its YaRN section describes another model
    stale = recipe_for(twins["kimi_k2"], tmp_path, yarn=None)
    for command in (["recipe", "validate", str(stale)], ["train", "midtrain", str(stale), "--dry-run"]):
        result = run_composer(*command)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (command, result.stderr)
        assert "does not match config.json: model.yarn: recipe None, checkpoint {'factor': 32.0" in " ".join(
            result.stdout.split() + result.stderr.split()
        ), command


@pytest.mark.parametrize(
    "problem", ["unknown quantization", "truncated shard", "scales of the wrong shape", "kimi_k25 without text_config"]
)
def test_a_bad_checkpoint_is_one_message_before_any_rank_starts(twins, tmp_path, problem):
    kind = "kimi_k25" if problem in ("kimi_k25 without text_config",) else "kimi_k2"
    recipe = recipe_for(twins[kind], tmp_path)
    broken = shutil.copytree(twins[kind], tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    index = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]
    if problem == "unknown quantization":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4}
        expected = "quantization_config.quant_method 'awq' is not supported; supported: fp8"
    elif problem == "truncated shard":
        shard = broken / index["model.layers.1.mlp.experts.3.down_proj.weight"]
        shard.write_bytes(shard.read_bytes()[:-1000])
        expected = f"{shard}: truncated ("
    elif problem == "scales of the wrong shape":
        from safetensors.torch import load_file, save_file

        name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
        shard = broken / index[name]
        tensors = load_file(shard)
        tensors[name] = tensors[name][:4]  # 576 rows are 5 blocks of 128, the last one partial
        save_file(tensors, str(shard), metadata={"format": "pt"})
        expected = f"{name}: scales of shape [4, 2] (F32); a [576, 192] weight in 128x128 blocks has [5, 2]"
    else:
        del config["text_config"]
        expected = "model_type kimi_k25 wraps a language model, but text_config is missing"
    (broken / "config.json").write_text(json.dumps(config))
    result = run_composer("recipe", "validate", str(recipe), "--set", f"model.checkpoint={broken}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert expected in " ".join(result.stdout.split()), result.stdout


def rewrite_tensor(checkpoint: Path, name: str, tensor: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    shard = checkpoint / json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensor
    save_file(tensors, str(shard), metadata={"format": "pt"})


EXPERT = "model.layers.1.mlp.experts.3"
SHAPES = {  # problem: (twin, expected message)
    "embedding [4096, 64]": (
        "kimi_k2",
        "model.embed_tokens.weight is stored [4096, 64], but config.json's vocab_size 1024, hidden_size 192 make(s) it [1024, 192]",
    ),
    "fp8 expert 96 rows tall": (
        "deepseek_v3",
        f"{EXPERT}.gate_proj.weight is stored [96, 192], but config.json's moe_intermediate_size 64 make(s) it [64, 192]",
    ),
    "moe_intermediate_size 96 over 64-wide weights": (
        "kimi_k2",
        "model.layers.1.mlp.experts.0.down_proj.weight is stored [192, 64], but config.json's moe_intermediate_size 96 make(s) it "
        "[192, 96] (and 95 more tensor(s) like it)",
    ),
    "INT4 weight_shape that contradicts its codes": (
        "kimi_k2_thinking",
        f"{EXPERT}.down_proj.weight_shape = [192, 96] contradicts its codes [192, 8] and scales [192, 2] (8 codes per int32, groups of 32)",
    ),
}


LAUNCHES = [
    pytest.param(["recipe", "validate"], id="validate"),
    pytest.param(["train", "midtrain", "--dry-run"], id="dry-run", marks=pytest.mark.slow),
    pytest.param(["train", "midtrain"], id="train", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("command", LAUNCHES)
@pytest.mark.parametrize("problem", SHAPES)
def test_a_stored_shape_the_model_does_not_have_is_refused_before_launch(twins, tmp_path, problem, command):
    """From the headers (and an INT4 weight's 2-element weight_shape): a tensor whose shape is not the one the
    checkpoint's config.json gives the model the recipe builds is refused by validate, --dry-run and train, in one
    message naming the tensor and the config key, exit 2, before any rank starts."""
    kind, expected = SHAPES[problem]
    broken = shutil.copytree(twins[kind], tmp_path / "broken")
    if problem == "embedding [4096, 64]":
        rewrite_tensor(broken, "model.embed_tokens.weight", torch.zeros(4096, 64, dtype=torch.bfloat16))
    elif problem == "fp8 expert 96 rows tall":  # its one 128 x 128 block row of scales still covers it
        rewrite_tensor(broken, f"{EXPERT}.gate_proj.weight", torch.zeros(96, 192, dtype=torch.float8_e4m3fn))
    elif problem == "moe_intermediate_size 96 over 64-wide weights":
        config = json.loads((broken / "config.json").read_text())
        config["moe_intermediate_size"] = 96
        (broken / "config.json").write_text(json.dumps(config))
    else:
        rewrite_tensor(broken, f"{EXPERT}.down_proj.weight_shape", torch.tensor([192, 96], dtype=torch.int32))
    result = run_composer(*command, str(recipe_for(broken, tmp_path)))
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and "Traceback" not in out, out[-2000:]
    assert expected in out, out[-2000:]
    assert not (tmp_path / "runs/twin").exists()


def test_model_info_says_what_composer_trains_and_what_vllm_serves(twins, tmp_path):
    result = run_composer("model", "info", str(twins["kimi_k25"]))
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "family deepseek_v3 (model_type kimi_k25)" in out
    assert "rope theta 50000, YaRN x64 from 32 (beta 1/1, mscale 1/1)" in out
    assert "stored: INT4 compressed-tensors pack-quantized, symmetric, group 32" in out
    assert "kimi_k25 wrapper: the language model is trained, everything else (vision tower, projector) carried bit-exactly" in out
    assert "training yes: composer's provider builds it" in out
    if not torch.cpu._is_amx_tile_supported():
        assert "vLLM on this CPU: no: its CPU INT4 MoE kernels need AMX tiles" in out
    result = run_composer("model", "info", str(twins["deepseek_v3"]))
    out = " ".join(result.stdout.split())
    assert "stored: fp8 e4m3 blocks 128x128 (weight_scale_inv)" in out and "1 multi-token-prediction layer(s)" in out
    # the size line counts the MTP layer as stored: every tensor of model.layers.3, scales left out
    from composer.recipes.sizes import mtp_parameters, parameter_counts
    from composer.trainer.hf_checkpoint import CheckpointLayout

    layout, m = CheckpointLayout.of(twins["deepseek_v3"]), model_section_from_hf(twins["deepseek_v3"])
    stored_mtp = sum(math.prod(layout.tensors[n].shape) for n in layout.mtp_names(m) if not n.endswith("_scale_inv"))
    assert mtp_parameters(m) == stored_mtp
    assert (
        f"stored with 1 multi-token-prediction layer(s): {(parameter_counts(m)[0] + stored_mtp) / 1e6:.2f} M ({stored_mtp / 1e6:.2f} M more)"
        in out
    )
    full = tmp_path / "deepseek-v3"
    full.mkdir()
    (full / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    out = " ".join(run_composer("model", "info", str(full)).stdout.split())
    assert "671.03 B total, 37.55 B active per token; stored with 1 multi-token-prediction layer(s): 684.49 B (13.46 B more)" in out
    result = run_composer("model", "info", str(twins["deepseek_v3_1"]))
    out = " ".join(result.stdout.split())
    assert result.returncode == 0, result.stderr
    assert "stored: fp8 e4m3 blocks 128x128 (weight_scale_inv, ue8m0: powers of two)" in out and "training yes" in out


def test_ue8m0_scales_are_powers_of_two_that_fit_and_a_published_one_is_kept():
    """DeepSeek-V3.1's scale_fmt ue8m0: a fresh scale is amax / 448 rounded up to a power of two (no value clamped),
    and the dequantized weight re-quantizes to the same bytes."""
    from composer.trainer.quantization import fp8_dequantize, fp8_quantize, is_power_of_two

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 300).unsqueeze(1)
    weight, scale = fp8_quantize(w, (128, 128), power_of_two=True)
    plain = fp8_quantize(w, (128, 128))[1]
    assert bool(is_power_of_two(scale).all()) and not bool(is_power_of_two(plain).all())
    assert bool((scale >= plain).all()) and bool((scale < 2 * plain).all())
    again = fp8_quantize(fp8_dequantize(weight, scale, (128, 128)), (128, 128), scale, power_of_two=True)
    assert same_bits(again[0], weight) and same_bits(again[1], scale)


# --- Megatron: parity, round trips, fixed point ----------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron():
    from composer.recipes.schema import ParallelismSection
    from composer.trainer.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    init_distributed(ParallelismSection())
    yield
    shutdown_distributed()


def load(twin: Path, dtype: str = "float32", **update):
    from composer.recipes.schema import ParallelismSection
    from composer.trainer.model import build_model
    from composer.trainer.weights import load_hf_into

    m = model_section_from_hf(twin, dtype=dtype).model_copy(update=update)
    model = build_model(m, ParallelismSection()).eval()
    load_hf_into(model, m, twin)
    return m, model


@pytest.mark.engines
@pytest.mark.parametrize("kind", KINDS)
def test_megatron_matches_transformers_past_the_original_context(twins, megatron, tmp_path, kind):
    """fp32 logits of 2 x 64 tokens agree to 1e-5, also past original_max_position_embeddings (32) where YaRN
    interpolates; without YaRN they would not."""
    from transformers import AutoModelForCausalLM

    from composer.trainer.model import forward_logits

    reference = write_reference(twins[kind], tmp_path / "reference")
    m, model = load(twins[kind])
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    tokens = torch.randint(2, m.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = forward_logits(model, tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    plain = json.loads((reference / "config.json").read_text())
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": plain["rope_parameters"]["rope_theta"]}
    (reference / "config.json").write_text(json.dumps(plain))
    with torch.no_grad():
        unscaled = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()(tokens).logits
    assert (unscaled[:, 32:] - theirs[:, 32:]).abs().max().item() > 1e-2


@pytest.mark.engines
def test_vllm_on_cpu_serves_the_dense_conversions_as_megatron_computes_them(twins, megatron, tmp_path):
    """vLLM on CPU runs neither block-fp8 linears nor INT4 MoE without AMX, and the K2.5 twin's vision tower is not
    MoonViT's; what it serves here are the dense (fp32) conversions of the kimi_k2 and deepseek_v3 twins (YaRN,
    DeepSeek-V3's carried MTP layer ignored): prompt logprobs equal Megatron's past the original context."""
    from composer.recipes.schema import RolloutSection, SamplingSection
    from composer.rollout.engines.vllm_engine import EmbeddedEngine
    from composer.trainer.model import forward_logits
    from composer.trainer.weights import convert_hf

    tokens = torch.randint(2, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
    for kind in ("kimi_k2", "deepseek_v3"):
        dense = convert_hf(model_section_from_hf(twins[kind]), tmp_path / kind, dtype=torch.float32)
        m, model = load(dense)
        with torch.no_grad():
            ours = torch.log_softmax(forward_logits(model, tokens).double(), -1)
        rollout = RolloutSection(max_context=128, kv_cache_gib=0.0625, dtype="float32", sampling=SamplingSection(max_tokens=4))
        engine = EmbeddedEngine(dense, rollout, seed=0, routed_experts=False)
        try:
            served = engine.prompt_logprobs([row.tolist() for row in tokens])
        finally:
            del engine
        for b in range(len(tokens)):
            expected = ours[b, torch.arange(tokens.shape[1] - 1), tokens[b, 1:]]
            assert (torch.tensor(served[b], dtype=torch.float64) - expected).abs().max().item() <= 1e-5, kind


@pytest.mark.engines
@pytest.mark.parametrize("kind", STORED)
def test_import_export_round_trip_is_bit_exact(twins, megatron, tmp_path, kind):
    """Exported in the checkpoint's own quantized layout, every stored tensor (MTP layers, vision tower and
    projector included) and config.json come back bit for bit, shard by shard."""
    from composer.trainer.weights import export_hf

    m, model = load(twins[kind])
    export_hf(model, m, tmp_path / "export", quantize=QUANTIZE[kind], max_shard_bytes=2**20)
    original, exported = stored_tensors(twins[kind]), stored_tensors(tmp_path / "export")
    assert set(exported) == set(original)
    assert [n for n in original if not same_bits(original[n], exported[n])] == []
    assert json.loads((tmp_path / "export/config.json").read_text()) == json.loads((twins[kind] / "config.json").read_text())
    assert len(list((tmp_path / "export").glob("*.safetensors"))) > 1
    for other in ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json"):  # the tokenizer travels with every policy
        assert not (twins[kind] / other).exists() or (tmp_path / "export" / other).read_bytes() == (twins[kind] / other).read_bytes()


@pytest.mark.engines
def test_a_bf16_master_from_int4_requantizes_to_the_published_bytes(twins, megatron, tmp_path):
    """Kimi-K2.5's INT4 experts dequantized into a bf16 Megatron model re-quantize, before any step, to exactly
    the published codes and scales; a weight moved past its group's range gets a fresh scale in that group only."""
    from composer.trainer.weights import export_hf

    m, model = load(twins["kimi_k25"], dtype="bfloat16")
    export_hf(model, m, tmp_path / "fixed", quantize="int4")
    original, exported = stored_tensors(twins["kimi_k25"]), stored_tensors(tmp_path / "fixed")
    assert [n for n in original if not same_bits(original[n], exported[n])] == []

    expert = model.decoder.layers[1].mlp.experts.local_experts[2].linear_fc2.weight  # HF experts.2.down_proj
    with torch.no_grad():
        expert[5, 40] = expert[5, 32:64].abs().max() * 3  # row 5, group 1 (columns 32..63)
    export_hf(model, m, tmp_path / "moved", quantize="int4")
    moved = stored_tensors(tmp_path / "moved")
    name = "language_model.model.layers.1.mlp.experts.2.down_proj.weight_scale"
    changed = (moved[name] != original[name]).nonzero().tolist()
    assert changed == [[5, 1]]
    assert [
        n
        for n in original
        if n != name and not n.startswith("language_model.model.layers.1.mlp.experts.2.down_proj") and not same_bits(original[n], moved[n])
    ] == []


@pytest.mark.engines
def test_a_bf16_master_from_ue8m0_requantizes_to_the_published_bytes(twins, megatron, tmp_path):
    """DeepSeek-V3.1's fp8 weights in a bf16 Megatron model export to the published bytes; a weight moved past its
    block's range gets a fresh scale, a power of two, in that block only."""
    from composer.trainer.quantization import is_power_of_two
    from composer.trainer.weights import export_hf

    twin = twins["deepseek_v3_1"]
    m, model = load(twin, dtype="bfloat16")
    original = stored_tensors(twin)
    down = model.decoder.layers[1].mlp.experts.local_experts[2].linear_fc2.weight  # HF experts.2.down_proj [192, 64]
    with torch.no_grad():
        down[150, 10] = down.abs().max() * 3  # row block 1
    export_hf(model, m, tmp_path / "moved", quantize="fp8")
    moved = stored_tensors(tmp_path / "moved")
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    assert (moved[name] != original[name]).nonzero().tolist() == [[1, 0]]
    assert bool(is_power_of_two(moved[name]).all()) and moved[name][1, 0] > original[name][1, 0]
    assert [
        n for n in original if not n.startswith("model.layers.1.mlp.experts.2.down_proj") and not same_bits(original[n], moved[n])
    ] == []
    assert json.loads((tmp_path / "moved/config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"


@pytest.mark.engines
def test_mtp_layers_dropped_and_dense_exports(twins, megatron, tmp_path):
    """model.mtp: drop leaves the MTP layer out (and says so in config.json); a dense export of a quantized
    checkpoint holds its dequantized values and no quantization_config."""
    from composer.trainer.weights import export_hf

    m, model = load(twins["deepseek_v3"], mtp="drop")
    export_hf(model, m, tmp_path / "dense", dtype=torch.float32)
    dense, config = stored_tensors(tmp_path / "dense"), json.loads((tmp_path / "dense/config.json").read_text())
    assert not any(n.startswith("model.layers.3.") or n.endswith("_scale_inv") for n in dense)
    assert config["num_nextn_predict_layers"] == 0 and "quantization_config" not in config and config["torch_dtype"] == "float32"
    reference = stored_tensors(write_reference(twins["deepseek_v3"], tmp_path / "reference"))
    assert set(dense) == set(reference) and all(torch.equal(dense[n], reference[n].to(dense[n].dtype)) for n in dense)
    assert model_section_from_hf(tmp_path / "dense").num_mtp_layers == 0


def test_an_fp8_checkpoint_converted_to_int4_holds_no_fp8(twins, tmp_path):
    """DeepSeek-V3 (block fp8, an MTP layer) as an INT4 policy: routed experts in INT4, MTP layer's included, everything
    else bf16 (not the fp8 codes), no weight_scale_inv; composer reads it back as INT4."""
    from composer.trainer.hf_checkpoint import CheckpointLayout
    from composer.trainer.weights import check_checkpoint, convert_hf

    out = convert_hf(model_section_from_hf(twins["deepseek_v3"]), tmp_path / "int4", quantize="int4")
    converted = stored_tensors(out)
    assert {t.dtype for t in converted.values()} == {torch.bfloat16, torch.float32, torch.int32}
    assert not any(n.endswith("_scale_inv") for n in converted)
    assert "model.layers.3.mlp.experts.0.down_proj.weight_packed" in converted
    assert converted["model.layers.3.eh_proj.weight"].dtype == torch.bfloat16
    assert CheckpointLayout.of(out).quantization.method == "int4"
    check_checkpoint(model_section_from_hf(out), out)


@pytest.mark.engines
def test_a_dense_export_of_a_quantized_checkpoint_is_dense_throughout(twins, megatron, tmp_path):
    """Mid-training's export (the model's dtype, no quantize) of DeepSeek-V3 with its MTP layer carried: no fp8
    weight, no scale and no quantization_config anywhere; the MTP layer holds its dequantized values, and composer
    reads the export back as the dense checkpoint it is."""
    from composer.trainer.hf_checkpoint import CheckpointLayout
    from composer.trainer.quantization import fp8_dequantize
    from composer.trainer.weights import check_checkpoint, export_hf

    m, model = load(twins["deepseek_v3"], dtype="bfloat16")
    export_hf(model, m, tmp_path / "dense")
    dense, config = stored_tensors(tmp_path / "dense"), json.loads((tmp_path / "dense/config.json").read_text())
    assert "quantization_config" not in config and config["num_nextn_predict_layers"] == 1
    assert not any("scale" in n for n in dense)
    # bf16 throughout but the expert biases (fp32 in Megatron and as published)
    assert {n for n, t in dense.items() if t.dtype != torch.bfloat16} == {n for n in dense if n.endswith("e_score_correction_bias")}
    original = stored_tensors(twins["deepseek_v3"])
    mtp = [n for n in original if n.startswith("model.layers.3.") and not n.endswith("_scale_inv")]
    assert mtp and all(n in dense for n in mtp)
    eh = "model.layers.3.eh_proj"
    assert original[f"{eh}.weight"].dtype == torch.float8_e4m3fn
    dequantized = fp8_dequantize(original[f"{eh}.weight"], original[f"{eh}.weight_scale_inv"], (128, 128))
    assert torch.equal(dense[f"{eh}.weight"], dequantized.to(torch.bfloat16))
    assert CheckpointLayout.of(tmp_path / "dense").quantization is None
    check_checkpoint(model_section_from_hf(tmp_path / "dense", dtype="bfloat16"), tmp_path / "dense")


@pytest.mark.engines
def test_quantized_twins_load_under_tensor_and_expert_parallelism(twins, tmp_path):
    """tp=2 (sequence parallel) and ep=2: the INT4 and fp8 twins load with the logits of tp=1 and export, gathered
    from both ranks, the published bytes (tests/helpers/workers/published_worker.py)."""
    from tests.conftest import run_ranks

    result = run_ranks(
        2, "tests.helpers.workers.published_worker", str(tmp_path), str(twins["kimi_k25"]), str(twins["deepseek_v3"]), timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    results = torch.load(tmp_path / "results.pt")
    for kind in ("kimi_k25", "deepseek_v3"):
        reference = results[kind].pop("tp1")
        for split, logits in results[kind].items():
            assert (logits - reference).abs().max().item() <= 1e-5, (kind, split)
        original = stored_tensors(twins[kind])
        for export in sorted(tmp_path.glob(f"export-{kind}-*")):
            exported = stored_tensors(export)
            assert set(exported) == set(original) and all(same_bits(original[n], exported[n]) for n in original), export.name


# --- the tokenizer: Kimi's tiktoken code, offline ----------------------------------------------------------------


def test_a_tiktoken_tokenizer_shipped_as_code_loads_offline_only_when_trusted(twins, monkeypatch):
    """The agent loop's tokenizer of a Kimi-style checkpoint: refused (naming the key) until model.trust_remote_code,
    then its own tiktoken code runs offline: text round-trips, role tokens are single ids past the ranks, and the
    chat template (with tool declarations) renders."""
    from composer.rollout.agent.harness import Tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        UserError, match="tokenization_kimi.TikTokenTokenizer, named by tokenizer_config.json.*set model.trust_remote_code: true"
    ):
        Tokenizer(str(twins["kimi_k25"]))
    tok = Tokenizer(str(twins["kimi_k25"]), trust_remote_code=True)
    text = "def wrap(text, width=70):\n    return text.split()  # ünïcode"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text)
    prompt = tok.render(
        [{"role": "user", "content": "fix the bug"}],
        tools=[{"type": "function", "function": {"name": "finish"}}],
        add_generation_prompt=True,
    )
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>[{") and prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    ids = tok.encode(prompt)
    assert ids[0] == 300 + 5 and ids.count(300 + 6) == 3  # <|im_system|>, three <|im_middle|>
    assert tok.decode(ids) == 'tool_declare[{"type": "function", "function": {"name": "finish"}}]userfix the bugassistant'


def test_an_rl_recipe_on_such_a_checkpoint_is_refused_before_launch_until_trusted(twins, tmp_path):
    import yaml

    recipe = yaml.safe_load(recipe_for(twins["kimi_k25"], tmp_path).read_text())
    del recipe["data"]
    recipe.update(
        rollout={"max_context": 256, "sampling": {"max_tokens": 16}},
        env={"tasks": [{"name": "smoke"}]},
        rl={"group_size": 2, "prompts_per_step": 1},
        sync={"store": str(tmp_path / "store")},
    )
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(recipe))
    for command in (["recipe", "validate"], ["train", "rl", "--dry-run"]):
        result = run_composer(*command[:2], str(tmp_path / "rl.yaml"), *command[2:])
        assert result.returncode == 2 and "set model.trust_remote_code: true to run it" in " ".join(
            (result.stdout + result.stderr).split()
        ), command
    result = run_composer("recipe", "validate", str(tmp_path / "rl.yaml"), "--set", "model.trust_remote_code=true")
    assert result.returncode == 0, result.stdout


# --- the serving formats out: RL policies in fp8 / INT4 ----------------------------------------------------------


@pytest.mark.engines
def test_the_starting_policy_is_converted_as_the_learner_exports(twins, megatron, tmp_path):
    """The RL starting policy in the engines' format (no model built) has the bytes of the learner's export of the
    same weights: bf16 from block fp8; INT4 from INT4 (the published bytes); fp8 from INT4 (fresh block scales)."""
    from composer.trainer.weights import convert_hf, export_hf

    for kind, dtype, quantize in (("kimi_k2", torch.bfloat16, None), ("kimi_k25", None, "int4"), ("kimi_k25", None, "fp8")):
        m, model = load(twins[kind])
        converted = convert_hf(m, tmp_path / f"{kind}-{quantize}-converted", dtype=dtype, quantize=quantize)
        export_hf(model, m, tmp_path / f"{kind}-{quantize}-exported", dtype=dtype, quantize=quantize)
        a, b = stored_tensors(converted), stored_tensors(tmp_path / f"{kind}-{quantize}-exported")
        assert set(a) == set(b) and all(same_bits(a[n], b[n]) for n in a), (kind, quantize)
        assert json.loads((converted / "config.json").read_text()) == json.loads(
            (tmp_path / f"{kind}-{quantize}-exported/config.json").read_text()
        )
    original = stored_tensors(twins["kimi_k25"])
    assert all(same_bits(original[n], a[n]) for n in original if n.startswith(("vision_tower.", "mm_projector.")))
    fp8 = stored_tensors(tmp_path / "kimi_k25-fp8-converted")
    scaled = {n.removesuffix("_scale_inv") for n in fp8 if n.endswith("weight_scale_inv")}
    assert scaled and all(fp8[n].dtype == torch.float8_e4m3fn for n in scaled) and not any(n.endswith("weight_packed") for n in fp8)
    config = json.loads((tmp_path / "kimi_k25-fp8-converted/config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8" and "quantization_config" not in config["text_config"]
    assert model_section_from_hf(tmp_path / "kimi_k25-fp8-converted") == model_section_from_hf(twins["kimi_k25"]).model_copy(
        update={"checkpoint": str(tmp_path / "kimi_k25-fp8-converted")}
    )


@pytest.mark.skipif(torch.cpu._is_amx_tile_supported(), reason="this CPU runs vLLM's fp8 and INT4 kernels")
def test_quantized_engines_this_cpu_cannot_run_are_refused_before_launch(twins, tmp_path):
    import yaml

    recipe = yaml.safe_load(recipe_for(twins["kimi_k25"], tmp_path).read_text())
    del recipe["data"]
    recipe["model"]["trust_remote_code"] = True
    recipe.update(
        rollout={"max_context": 256, "sampling": {"max_tokens": 16}, "dtype": "int4"},
        env={"tasks": [{"name": "smoke"}]},
        rl={"group_size": 2, "prompts_per_step": 1},
        sync={"store": str(tmp_path / "store")},
    )
    (tmp_path / "rl.yaml").write_text(yaml.safe_dump(recipe))
    result = run_composer("train", "rl", str(tmp_path / "rl.yaml"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "rollout.dtype int4: vLLM on this CPU runs INT4 MoE only with AMX tiles" in " ".join(result.stderr.split())
    assert not (tmp_path / "runs").exists()
