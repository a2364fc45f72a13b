"""Does RL from a pretrained start learn a real task family? Held-out pass@1 before and after, with intervals.

Runs `composer train rl` on a recipe with `rl.eval` (default: recipes/smollm2-rl.yaml, SmolLM2-135M-Instruct),
then reads the run's per-task held-out results of the starting policy (eval/v000000.json) and of the final one:
greedy pass@1 of each with a 95% bootstrap interval over the held-out tasks, and the paired difference
(same tasks, before vs after) with its interval. The run learned when the difference's interval lies above 0; the
script exits non-zero when it does not.
Also prints the reward of the first and last steps and the per-step sync ratio of the shipped policies.

    python benchmarks/rl_learning.py [--checkpoint HF_DIR] [--steps N] [--seed S] [--recipe R] [--keep DIR] [--set k=v]
    python benchmarks/rl_learning.py --report RUN_DIR    # the figures of a finished (or resumed) run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from composer.rl.evaluation import bootstrap_interval  # noqa: E402


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes/smollm2-rl.yaml")
    parser.add_argument("--checkpoint", type=Path, help="SmolLM2 HF checkpoint (default: composer model import-smollm2 into the work dir)")
    parser.add_argument("--steps", type=int, help="learner steps (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--keep", type=Path, help="work directory to keep (default: a temporary one)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra recipe override, k=v")
    parser.add_argument("--report", type=Path, metavar="RUN_DIR", help="only print the figures of a finished run")
    args = parser.parse_args()
    if args.report:
        return report(args.report, run_wall_seconds(args.report), args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = work / "smollm2"
            if not checkpoint.exists():
                subprocess.run([sys.executable, "-m", "composer.cli", "model", "import-smollm2", str(checkpoint)], cwd=REPO, check=True)
        sets = [
            "--set",
            f"model.checkpoint={checkpoint.resolve()}",
            "--set",
            f"run.dir={work / 'runs'}",
            "--set",
            f"train.seed={args.seed}",
            "--set",
            "run.name=rl-learning",
        ]
        if args.steps:
            sets += ["--set", f"train.steps={args.steps}"]
        for override in args.overrides:
            sets += ["--set", override]
        started = time.monotonic()
        with (work / "train.log").open("w") as log:
            done = subprocess.run(
                [sys.executable, "-m", "composer.cli", "train", "rl", str(args.recipe), *sets],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wall = time.monotonic() - started
        run = work / "runs" / "rl-learning"
        if done.returncode != 0:
            sys.exit(f"train rl failed (exit {done.returncode}); see {work / 'train.log'}:\n" + (work / "train.log").read_text()[-3000:])
        report(run, wall, args.seed)


def run_wall_seconds(run: Path) -> float:
    """From the start of the first evaluation to the end of the last (stops and resumes included)."""
    evals = read_jsonl(run / "eval_metrics.jsonl")
    return evals[-1]["time"] - (evals[0]["time"] - evals[0]["eval_seconds"])


def report(run: Path, wall: float, seed: int) -> None:
    import yaml

    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    steps = recipe["train"]["steps"]
    before = json.loads((run / "eval" / "v000000.json").read_text())
    after = json.loads((run / "eval" / f"v{steps:06d}.json").read_text())
    tasks = sorted(set(before) & set(after))
    b = np.array([float(before[t]["greedy"]) for t in tasks])
    a = np.array([float(after[t]["greedy"]) for t in tasks])
    samples = before[tasks[0]]["samples"] if tasks else 0
    families = ", ".join(f"{ts['name']} (held out {ts.get('held_out', 0)})" for ts in recipe["env"]["tasks"])
    print(f"task family: {families}; eval sets {recipe['rl']['eval']['tasks']}; {len(tasks)} held-out tasks")
    print(
        f"steps {steps}, wall {wall / 60:.1f} min, seed {seed}, lr {recipe['optim']['lr']}, "
        f"{recipe['rl']['prompts_per_step']} prompts x {recipe['rl']['group_size']} samples per step"
    )
    lo, hi = bootstrap_interval(b)
    print(f"held-out greedy pass@1 before: {b.mean():.3f}  95% CI [{lo:.3f}, {hi:.3f}]")
    lo, hi = bootstrap_interval(a)
    print(f"held-out greedy pass@1 after:  {a.mean():.3f}  95% CI [{lo:.3f}, {hi:.3f}]")
    lo, hi = bootstrap_interval(a - b)
    learned = lo > 0
    print(
        f"improvement (paired, same tasks): {a.mean() - b.mean():+.3f}  95% CI [{lo:+.3f}, {hi:+.3f}]  "
        f"-> {'LEARNED: the interval lies above 0' if learned else 'NOT shown: the interval includes 0 or lies below'}"
    )
    print(f"  tasks solved after but not before: {int((a > b).sum())}, before but not after: {int((b > a).sum())}")
    kinds = sorted({t.rsplit("/", 1)[0] for t in tasks})  # rgym/<generator>/<i> -> rgym/<generator>
    if 1 < len(kinds) < len(tasks):
        solved = {k: [(b[i], a[i]) for i, t in enumerate(tasks) if t.rsplit("/", 1)[0] == k] for k in kinds}
        print(
            "  solved before -> after: "
            + ", ".join(f"{k} {sum(x for x, _ in v):.0f}->{sum(y for _, y in v):.0f}/{len(v)}" for k, v in solved.items())
        )
    if samples:
        sb = np.array([before[t]["correct"] / samples for t in tasks])
        sa = np.array([after[t]["correct"] / samples for t in tasks])
        lo, hi = bootstrap_interval(sa - sb)
        print(
            f"held-out sampled pass@1 ({samples} samples/task): {sb.mean():.3f} -> {sa.mean():.3f}  "
            f"paired 95% CI of the change [{lo:+.3f}, {hi:+.3f}]"
        )
    for record in read_jsonl(run / "eval_metrics.jsonl"):
        shown = {k: round(v, 3) for k, v in record.items() if "pass@" in k and not k.endswith(("_low", "_high"))}
        print(f"  eval at step {record['step']}: {shown}  ({record['eval_seconds']:.0f} s)")
    metrics = read_jsonl(run / "metrics.jsonl")
    rewards = [m["reward_mean"] for m in metrics]
    print(f"train reward: first 5 steps {np.mean(rewards[:5]):.3f}, last 5 steps {np.mean(rewards[-5:]):.3f}")
    ratios = [m["sync_ratio"] for m in metrics if "sync_ratio" in m]
    changed = [m["sync_changed_fraction"] for m in metrics if "sync_changed_fraction" in m]
    print("sync_ratio per step: " + " ".join(f"{r:.1f}" for r in ratios))
    if ratios:
        print(
            f"sync_ratio median {statistics.median(ratios):.1f}x (steps 2+: {statistics.median(ratios[1:] or ratios):.1f}x), "
            f"changed elements median {statistics.median(changed):.2%}"
        )
    alarms = sum(m.get("alarm_ratio_error", 0) + m.get("alarm_logprob_diff", 0) for m in metrics)
    print(
        f"health: entropy {metrics[0].get('entropy', float('nan')):.3f} -> {metrics[-1].get('entropy', float('nan')):.3f}, "
        f"response tokens {metrics[0]['response_tokens_mean']:.0f} -> {metrics[-1]['response_tokens_mean']:.0f}, "
        f"alarms {alarms:.0f}, uniform groups {np.mean([m['uniform_group_fraction'] for m in metrics]):.2f}"
    )
    fresh = [m for m in metrics if "on_policy_prob_ratio_error" in m]
    if fresh:  # engine and learner on the same weights, at the sampling temperature
        errors, diffs = [m["on_policy_prob_ratio_error"] for m in fresh], [m["on_policy_logprob_abs_diff"] for m in fresh]
        print(
            f"on-policy ratio error {min(errors):.2g} .. {max(errors):.2g} (median {statistics.median(errors):.2g}), "
            f"|dlogprob| {min(diffs):.2g} .. {max(diffs):.2g}, over {len(fresh)} steps"
        )
    if not learned:
        sys.exit("MISSED its target: learning is not shown (the paired difference's 95% interval does not lie above 0)")


if __name__ == "__main__":
    main()
