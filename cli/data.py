"""`composer data`: tokenize a recipe's corpus into cached Megatron indexed datasets."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from recipes.errors import UserError
from recipes.loader import load_recipe

app = typer.Typer(help="Prepare training data.", no_args_is_help=True)
console = Console()

SetOption = typer.Option([], "--set", "-s", help="Override a key: --set data.num_workers=4 (value parsed as YAML). Repeatable.")


@app.command()
def prepare(recipe_file: Path = typer.Argument(..., metavar="RECIPE", help="Recipe file."), overrides: list[str] = SetOption) -> None:
    """Tokenize every data source into a Megatron .bin/.idx dataset, cached by a hash of inputs and tokenizer."""
    recipe = load_recipe(recipe_file, overrides)
    if recipe.data is None:
        raise UserError(f"{recipe_file}: the recipe has no data section; nothing to prepare")
    from trainer.data import prepare_data  # loads tokenizers (and Megatron when writing): keep `composer --help` fast

    prepared = prepare_data(recipe.data, model_checkpoint=recipe.model.checkpoint, model_vocab_size=recipe.model.vocab_size, console=console)
    table = Table(title=f"data ({escape(str(prepared.tokenizer.directory))}, vocab {prepared.tokenizer.vocab_size})")
    for column in ("source", "weight", "files", "documents", "tokens", "cache"):
        table.add_column(column, justify="left" if column in ("source", "cache") else "right")
    for s in prepared.sources:
        cache = "[green]hit[/]" if s.cached else "built"
        table.add_row(escape(s.name), f"{s.weight:g}", f"{s.num_files:,}", f"{s.num_documents:,}", f"{s.num_tokens:,}", cache)
    console.print(table)
    for s in prepared.sources:
        console.print(f"  {escape(s.name)}: {escape(str(s.prefix))}.bin/.idx", highlight=False, soft_wrap=True)
        if s.num_files_not_utf8:
            console.print(f"  [yellow]{s.num_files_not_utf8} file(s) of {escape(s.name)} were not valid UTF-8; bad bytes became U+FFFD[/]", highlight=False)
    if prepared.all_cached:
        console.print("[green]every source was already prepared; nothing to do[/]")
