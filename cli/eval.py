"""`composer eval RECIPE CHECKPOINT [--compare CHECKPOINT]`: a checkpoint on the recipe's task sets, outside RL."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from composer.recipes.loader import load_recipe

console = Console(soft_wrap=True)


def eval_command(
    recipe_file: Path = typer.Argument(
        ..., metavar="RECIPE", help="Recipe with rollout and env sections (an RL recipe): engines, harness, tasks, sandbox."
    ),
    checkpoint: str = typer.Argument(..., help="HF checkpoint directory, run directory (its export or newest policy) or STORE@vNNNNNNNN."),
    compare: str | None = typer.Option(
        None,
        "--compare",
        metavar="CHECKPOINT",
        help="Also evaluate this checkpoint on the same tasks; paired differences and tasks gained/lost.",
    ),
    tasks: list[str] = typer.Option(
        [], "--tasks", "-t", help="Task set to evaluate (repeatable; default: rl.eval.tasks, else every set of env.tasks)."
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Output directory (default: <run.dir>/eval/<checkpoint>); a rerun continues it."
    ),
    batch: int = typer.Option(32, "--batch", min=1, help="Tasks per batch of greedy episodes (a batch is kept as soon as it is graded)."),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a key: --set rl.eval.samples=8 (value parsed as YAML). Repeatable."
    ),
) -> None:
    """Evaluate a checkpoint on the recipe's task sets through RL's engines, agent loop, harness, sandbox and graders:
    greedy pass@1 with its 95% interval, sampled pass@k, per kind, flags and infra failures; resumable."""
    from composer.rl.checkpoint_eval import evaluate

    recipe = load_recipe(recipe_file, overrides)
    outcome = evaluate(recipe, checkpoint, compare, tasks, out, batch)
    results = outcome.results
    roles = list(results["checkpoints"])
    table = Table(title="composer eval")
    for column in ("set", "tasks", *(f"{role} greedy pass@1 [95% CI]" for role in roles)):
        table.add_column(column, justify="left" if column == "set" else "right")
    if "compare" in roles:
        table.add_column("difference [paired 95% CI]", justify="right")
        table.add_column("gained / lost", justify="right")
    for name, entry in results["sets"].items():
        cells = [escape(name), str(entry["checkpoint"]["tasks"])]
        for role in roles:
            r = entry[role]["record"]
            cells.append(
                f"{r[f'eval_{name}_greedy_pass@1']:.3f} [{r[f'eval_{name}_greedy_pass@1_low']:.3f}, {r[f'eval_{name}_greedy_pass@1_high']:.3f}]"
                if r
                else "-"
            )
        if "difference" in entry:
            d = entry["difference"]
            low, high = d["greedy_pass@1_interval"]
            cells += [f"{d['greedy_pass@1']:+.3f} [{low:+.3f}, {high:+.3f}]", f"{len(d['gained'])} / {len(d['lost'])}"]
        table.add_row(*cells)
    console.print(table)
    for name, entry in results["sets"].items():
        for role in roles:
            s = entry[role]
            extra = [
                f"{k} {s['record'][f'eval_{name}_{k}']:.3f}"
                for k in (f"pass@{k}" for k in results["pass_k"])
                if f"eval_{name}_{k}" in s["record"]
            ]
            extra.append(f"infra failures {s['infra_failures']}, flagged episodes {s['flagged_episodes']}")
            if "compaction_error" in s:  # summaries, or (drop_oldest) compactions without one
                extra.append(f"compaction error {s['compaction_error']:.3f} over {s['compactions']} compactions")
            if "summary_tokens_mean" in s:
                extra.append(f"summaries of {s['summary_tokens_mean']:.0f} tokens")
            if "tokens_per_episode" in s:
                extra.append(f"{s['tokens_per_episode']:.0f} tokens per episode")
            console.print(f"{escape(name)} {role}: " + "; ".join(extra), highlight=False)
            if len(s["kinds"]) > 1:
                console.print(
                    "  per kind: " + ", ".join(f"{escape(k)} {v['greedy_pass@1']:.2f} of {v['tasks']}" for k, v in s["kinds"].items()),
                    highlight=False,
                )
            for kind, v in s["kinds"].items():
                if v.get("tool_calls"):
                    console.print(
                        f"  {escape(kind)}: tool calls parsed {v['tool_calls_parsed']:.2f} of {v['tool_calls']}, "
                        f"tests run in {v['tests_run']:.2f} and finish called in {v['finish_called']:.2f} of {v['tasks']} episodes, "
                        f"greedy pass@1 {v['greedy_pass@1']:.2f}",
                        highlight=False,
                    )
    console.print(f"[green]✓[/] {escape(str(outcome.out))}: results.json, report.html ({outcome.seconds:.0f} s)", highlight=False)
