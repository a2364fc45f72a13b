"""`composer data`: prepare a recipe's corpus into cached Megatron indexed datasets, and what each step did."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.runtime.progress import print_whole_table

app = typer.Typer(help="Prepare training data.", no_args_is_help=True)
console = Console()

SetOption = typer.Option([], "--set", "-s", help="Override a key: --set data.num_workers=4 (value parsed as YAML). Repeatable.")
RecipeArgument = typer.Argument(..., metavar="RECIPE", help="Recipe file with a data section.")


def _data_recipe(recipe_file: Path, overrides: list[str]):
    recipe = load_recipe(recipe_file, overrides)
    if recipe.data is None:
        raise UserError(f"{recipe_file}: the recipe has no data section; nothing to prepare")
    return recipe


@app.command()
def prepare(
    recipe_file: Path = RecipeArgument,
    submit: bool = typer.Option(
        False, "--submit", help="cluster.launcher slurm: run the pipeline as SLURM job arrays (one per stage) and print their ids."
    ),
    overrides: list[str] = SetOption,
) -> None:
    """Deduplicate, filter, shape and tokenize every source into a Megatron .bin/.idx dataset, cached by a hash of
    inputs, settings and tokenizer; resumable after a kill; prints what each step did."""
    recipe = _data_recipe(recipe_file, overrides)
    # loads tokenizers, datatrove (and Megatron when writing): keep `composer --help` fast
    from composer.data.prepare import prepare_data, submit_data

    args = dict(model_checkpoint=recipe.model.checkpoint, model_vocab_size=recipe.model.vocab_size)
    if submit:
        if recipe.cluster.launcher != "slurm":
            raise UserError(f"--submit needs cluster.launcher: slurm (the recipe says {recipe.cluster.launcher})")
        jobs = submit_data(recipe.data, recipe.cluster, **args)
        for source, stage, job in jobs:
            console.print(f"submitted {escape(source)} {stage}: SLURM job {job}", highlight=False)
        console.print(
            "every source was already prepared; nothing to do" if not jobs else "run `composer data stats` once the last job has finished",
            highlight=False,
        )
        return
    prepared = prepare_data(recipe.data, console=console, **args)
    show(prepared, recipe)
    if prepared.all_cached:
        console.print("[green]every source was already prepared; nothing to do[/]")


@app.command()
def stats(recipe_file: Path = RecipeArgument, overrides: list[str] = SetOption) -> None:
    """What `data prepare` did to each source: documents, tokens, what each step removed, near-duplicate clusters,
    languages, the FIM share, tokens per source after the mixture."""
    recipe = _data_recipe(recipe_file, overrides)
    from composer.data.prepare import prepared_sources

    show(prepared_sources(recipe.data, model_checkpoint=recipe.model.checkpoint, model_vocab_size=recipe.model.vocab_size), recipe)


def show(prepared, recipe) -> None:
    total_weight = sum(s.weight for s in prepared.sources)
    trained = recipe.train.steps * recipe.train.global_batch_size * recipe.data.seq_length
    table = Table(title=f"data ({escape(str(prepared.tokenizer.directory))}, vocab {prepared.tokenizer.vocab_size})")
    for column in ("source", "weight", "inputs", "documents", "tokens", "mixture tokens", "epochs", "cache"):
        table.add_column(column, justify="left" if column in ("source", "cache") else "right", overflow="fold", no_wrap=column != "source")
    for s in prepared.sources:
        drawn = trained * s.weight / total_weight
        table.add_row(
            escape(s.name),
            f"{s.weight:g}",
            f"{s.summary['inputs']:,}",
            f"{s.num_documents:,}",
            f"{s.num_tokens:,}",
            f"{drawn:,.0f}",
            f"{drawn / s.num_tokens:.2f}",
            "[green]hit[/]" if s.cached else "built",
        )
    print_whole_table(console, table)
    for s in prepared.sources:
        _show_source(s)


def _show_source(s) -> None:
    summary = s.summary
    console.print(f"[bold]{escape(s.name)}[/]: {escape(str(s.prefix))}.bin/.idx", highlight=False, soft_wrap=True)
    console.print(f"  read {summary['read_documents']:,} documents from {summary['inputs']:,} inputs", highlight=False)
    if summary["left_out"]:
        console.print("  left out: " + ", ".join(f"{escape(k)} {v:,}" for k, v in sorted(summary["left_out"].items())), highlight=False)
    if summary["not_utf8"]:
        console.print(f"  [yellow]{summary['not_utf8']} file(s) were not valid UTF-8; bad bytes became U+FFFD[/]", highlight=False)
    if summary["redactions"]:
        console.print(
            "  redacted: "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(summary["redactions"].items()))
            + f" (report: {escape(str(s.prefix.parent / 'redactions.jsonl'))})",
            highlight=False,
            soft_wrap=True,
        )
    table = Table(box=None, padding=(0, 2), show_header=True)
    for column in ("step", "documents removed", "tokens removed", "why"):
        table.add_column(column, justify="right" if "removed" in column else "left", overflow="fold", no_wrap=column != "why")
    for step in ("licence", "quality", "exact duplicates", "near duplicates"):
        removed = summary["removed"].get(step, {"documents": 0, "tokens": 0, "reasons": {}})
        why = ", ".join(f"{escape(k)} {v:,}" for k, v in sorted(removed["reasons"].items()) if k != step)
        table.add_row(step, f"{removed['documents']:,}", f"{removed['tokens']:,}", why)
    print_whole_table(console, table)
    near = summary["near_dedup"]
    if near:
        odds = ", ".join(f"J={k}: {v:.2f}" for k, v in near["catch_probability"].items())
        console.print(
            f"  near duplicates: {near['clusters']:,} clusters; MinHash {near['bands']} bands x {near['rows']} rows "
            f"(threshold {near['threshold']}; chance a pair is caught: {odds})",
            highlight=False,
        )
    languages = sorted(summary["languages"].items(), key=lambda kv: -kv[1]["tokens"])
    console.print(
        "  languages (files, tokens): "
        + ", ".join(f"{escape(k)} {v['files']:,} {v['tokens']:,}" for k, v in languages[:8])
        + (f", {len(languages) - 8} more" if len(languages) > 8 else ""),
        highlight=False,
        soft_wrap=True,
    )
    fim = summary["fim"]
    if fim["psm"] + fim["spm"]:
        share = (fim["psm"] + fim["spm"]) / max(1, fim["files"])
        console.print(
            f"  FIM: {fim['psm'] + fim['spm']:,} of {fim['files']:,} files ({share:.0%}; PSM {fim['psm']:,}, SPM {fim['spm']:,})",
            highlight=False,
        )
    if summary["repository_documents"]:
        console.print(
            f"  repository documents: {summary['repository_documents']:,} ({summary['repository_files']:,} files)", highlight=False
        )
