"""Does self-summarization help on tasks longer than the context, and does RL make the summaries better?

SmolLM2-135M-Instruct (`composer model import-smollm2`) is first fine-tuned with `composer train sft` on the
reference episodes of the training `recall` tasks (the `references` source: read every part in turn, write the codes,
run the tests, finish), so it knows the harness and the task. Held-out `recall` tasks (codes spread over workspace
files read one per turn, all needed for the answer; recipes/smollm2-recall.yaml) are then evaluated with `composer
eval` (greedy) under three context policies:

    summarize      the policy summarizes its context when it fills (rollout.compaction: summarize)
    drop_oldest    the oldest turns are dropped instead (rollout.compaction: drop_oldest)
    large_context  a context large enough that nothing is dropped (the upper bound)

then `composer train rl` runs with self-summarization from the SFT'd policy (the summaries trained by the episodes'
reward; `--summary-reward W` adds the shaped term, rl.summary_reward), and its policy is evaluated the same three ways.
Printed per stage and policy: greedy pass@1 and mean reward (the share of codes returned) with 95% bootstrap
intervals, compaction error, summary length in tokens, tokens per episode; paired differences (the same tasks) between
policies and before/after RL, with intervals; the wall time of each stage, per evaluated episode and per RL step, and
from them an estimate of the run at other sizes.

    python benchmarks/summarization.py [--work DIR] [--checkpoint HF_DIR] [--sft-tasks N] [--held-out N]
        [--sft-steps N] [--rl-steps N] [--parts P] [--filler-lines L] [--decoys D] [--summary-reward W] [--set k=v]
    python benchmarks/summarization.py --report --work DIR     # the figures of what DIR holds so far

Every stage resumes: run again with the same --work, evaluations keep what they graded, a finished SFT run is reused,
a stopped RL run continues with --resume.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sft_effect import composer, training_dtype  # noqa: E402  (run one stage, its output in the log)
from composer.rl.evaluation import bootstrap_interval  # noqa: E402

POLICIES = ("summarize", "drop_oldest", "large_context")
STAGES = ("before", "after")
RL_RUN = "recall-rl"


def policy_overrides(policy: str, large_context: int) -> list[str]:
    return {
        "summarize": [],
        # (rl.summary_reward, the RL run's shaped term, is refused in a recipe without summaries)
        "drop_oldest": ["rollout.compaction=drop_oldest", "rl.summary_reward=0"],
        "large_context": ["rollout.summarize_at=null", f"rollout.max_context={large_context}", "rl.summary_reward=0"],
    }[policy]


def write_recipes(work: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The recall recipe (evaluations and RL) and the SFT recipe: one task section, so both hold out the same tasks."""
    recall = {"parts": args.parts, "filler_lines": args.filler_lines, "decoys": args.decoys}
    env = {"tasks": [{"name": "recall", "limit": args.sft_tasks + args.held_out, "held_out": args.held_out, "recall": recall}]}
    rl_recipe = {
        "extends": str(REPO / "recipes" / "smollm2-recall.yaml"),
        "run": {"name": RL_RUN, "dir": str(work / "runs")},
        "model": {"dtype": training_dtype()},
        # one episode segment a micro-batch: smollm2-rl.yaml's 4 of 1536 tokens in fp32 outgrow 24 GiB beside the engine
        "train": {"steps": args.rl_steps, "seed": args.seed, "checkpoint_every": min(8, args.rl_steps), "micro_batch_size": 1},
        "rollout": {"kv_cache_gib": 1.0},  # a batch of large-context episodes without preemption
        "env": env,
        "rl": {
            "group_size": args.group_size,
            "prompts_per_step": args.prompts_per_step,
            "summary_reward": args.summary_reward,
            "eval": {"tasks": ["recall"], "every": 8, "samples": 0, "pass_k": []},
        },
    }
    model = yaml.safe_load((REPO / "recipes" / "smollm2-rl.yaml").read_text())["model"]
    sft_recipe = {
        "run": {"name": "sft", "dir": str(work / "runs")},
        "model": {**model, "checkpoint": str(args.checkpoint), "dtype": training_dtype()},
        "cluster": {"hosts": ["localhost"], "procs_per_host": 2},
        "parallelism": {"ep": 1},
        "sft": {
            "sources": [{"name": "recall-references", "kind": "references"}],
            "max_length": args.sft_max_length,
            "overlong": "cut",
            "held_out": 0.1,
            "chat_template": True,
            # the demonstrations show tool outputs as the recall recipe's episodes do
            "max_observation_tokens": yaml.safe_load((REPO / "recipes" / "smollm2-recall.yaml").read_text())["rollout"][
                "max_observation_tokens"
            ],
        },
        "env": env,
        "optim": {"lr": 5.0e-5, "min_lr": 5.0e-6, "schedule": "cosine", "warmup_steps": min(2, args.sft_steps - 1), "weight_decay": 0.0},
        "train": {
            "steps": args.sft_steps,
            "micro_batch_size": 1,
            "global_batch_size": args.sft_batch,
            "checkpoint_every": args.sft_steps,
            "eval_every": args.sft_steps,
            "eval_batches": 1,
            "seed": args.seed,
        },
    }
    paths = work / "recall.yaml", work / "sft.yaml"
    for path, recipe in zip(paths, (rl_recipe, sft_recipe)):
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return paths


def graded(out: Path) -> dict[str, dict]:
    """The greedy episode of each task `composer eval` graded so far in `out` (a killed evaluation keeps its batches)."""
    path = out / "checkpoint.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {r["task"]: r for r in map(json.loads, filter(str.strip, lines)) if r.get("mode") == "greedy"}


def interval(values: np.ndarray, signed: bool = False) -> str:
    low, high = bootstrap_interval(values)
    return f"[{low:+.3f}, {high:+.3f}]" if signed else f"[{low:.3f}, {high:.3f}]"


def mean_or_dash(values: list[float], form: str = ".3f") -> str:
    return f"{np.mean(values):{form}}" if values else "-"


def report(work: Path, seconds: dict[str, float]) -> None:
    results = {(stage, policy): r for stage in STAGES for policy in POLICIES if (r := graded(work / f"{stage}-{policy}"))}
    if not results:
        print("no evaluation graded yet")
        return
    tasks = sorted(set.intersection(*(set(r) for r in results.values())))
    recipe = yaml.safe_load((work / "recall.yaml").read_text()) if (work / "recall.yaml").is_file() else {}
    settings = recipe.get("env", {}).get("tasks", [{}])[0].get("recall", {})
    print(f"recall {settings}: {len(tasks)} held-out tasks graded by every evaluation so far; greedy")
    print(
        f"{'stage':>6} {'policy':<14} {'pass@1 [95% CI]':>22} {'reward [95% CI]':>22} {'compaction err':>15} "
        f"{'summary tok':>11} {'tokens/ep':>9}  ends"
    )
    for (stage, policy), by_task in results.items():
        episodes = [by_task[t] for t in tasks]
        passed = np.array([float(e["passed"]) for e in episodes])
        reward = np.array([e["reward"] for e in episodes])
        errors = [x for e in episodes for x in e["compaction_errors"]]
        lengths = [n for e in episodes for n in e["summary_tokens"]]
        tokens = [e["tokens"] for e in episodes if e.get("tokens")]
        ends: dict[str, int] = {}
        for e in episodes:
            ends[e["end_reason"]] = ends.get(e["end_reason"], 0) + 1
        error = f"{np.mean(errors):.3f} n={len(errors)}" if errors else "-"
        print(
            f"{stage:>6} {policy:<14} {passed.mean():.3f} {interval(passed):>16} {reward.mean():.3f} {interval(reward):>16} "
            f"{error:>15} {mean_or_dash(lengths, '.1f'):>11} {mean_or_dash(tokens, '.0f'):>9}  {ends}"
        )

    def paired(label: str, a: tuple[str, str], b: tuple[str, str]) -> None:
        if a not in results or b not in results or not tasks:
            return
        for key in ("passed", "reward"):
            d = np.array([float(results[a][t][key]) - float(results[b][t][key]) for t in tasks])
            print(
                f"{label}, {'pass@1' if key == 'passed' else key}: {d.mean():+.3f} {interval(d, signed=True)} (paired, {len(tasks)} tasks)"
            )

    for stage in STAGES:
        for other in ("drop_oldest", "large_context"):
            paired(f"{stage} RL: summarize - {other}", (stage, "summarize"), (stage, other))
    for policy in POLICIES:
        paired(f"{policy}: after - before RL", ("after", policy), ("before", policy))
    rl_metrics = work / "runs" / RL_RUN / "metrics.jsonl"
    steps = [json.loads(line) for line in rl_metrics.read_text().splitlines() if line.strip()] if rl_metrics.is_file() else []
    if steps:

        def column(key: str) -> str:
            return " ".join(f"{m[key]:.2f}" if key in m else "-" for m in steps)

        print(f"RL ({len(steps)} steps): train reward per step {column('reward_mean')}")
        print(f"  compaction error per step {column('compaction_error_mean')}; summary tokens {column('summary_tokens_mean')}")
    timing(work, seconds, results, len(steps))


def timing(work: Path, seconds: dict[str, float], results: dict, rl_steps: int) -> None:
    for stage, wall in seconds.items():
        print(f"{stage}: {wall:.0f} s")
    per_episode = [seconds[k] / len(r) for (stage, policy), r in results.items() if (k := f"eval {stage}-{policy}") in seconds]
    if per_episode:
        print(f"evaluation: {np.mean(per_episode):.1f} s per held-out episode (mean over evaluations, engine start included)")
    if rl_steps and "rl" in seconds:
        print(f"RL: {seconds['rl'] / rl_steps:.0f} s per step (engine and learner start included)")
    sft_metrics = work / "runs" / "sft" / "metrics.jsonl"
    sft_steps = sum('"loss"' in line for line in sft_metrics.read_text().splitlines()) if sft_metrics.is_file() else 0
    if sft_steps and "sft" in seconds:
        print(f"SFT: {seconds['sft'] / sft_steps:.0f} s per step (preparation and export included)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "summarization", help="work directory (kept; every stage resumes)")
    parser.add_argument("--checkpoint", type=Path, help="SmolLM2 HF checkpoint (default: composer model import-smollm2 into WORK)")
    parser.add_argument("--sft-tasks", type=int, default=224, help="training recall tasks (SFT demonstrations and RL prompts)")
    parser.add_argument("--held-out", type=int, default=32, help="held-out recall tasks (evaluated, never demonstrated or trained on)")
    parser.add_argument("--sft-steps", type=int, default=24, help="SFT steps")
    parser.add_argument("--sft-batch", type=int, default=8, help="SFT global batch (conversations per step; even: 2 ranks)")
    parser.add_argument(
        "--sft-max-length", type=int, default=2048, help="SFT sequence length (sft.pack: whole conversations packed into it)"
    )
    parser.add_argument("--rl-steps", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--summary-reward", type=float, default=0.0, help="rl.summary_reward (the shaped summary term; 0: off)")
    parser.add_argument("--parts", type=int, default=4, help="files (codes) per task")
    parser.add_argument("--filler-lines", type=int, default=3, help="log lines per file")
    parser.add_argument("--decoys", type=int, default=0, help="revoked codes per file")
    parser.add_argument("--large-context", type=int, default=4096, help="the large_context policy's max_context")
    parser.add_argument("--batch", type=int, default=8, help="held-out tasks per evaluation batch")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override for RL and evaluations, k=v")
    parser.add_argument("--report", action="store_true", help="only print the figures of what WORK holds")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    timings = work / "seconds.json"
    seconds = json.loads(timings.read_text()) if timings.is_file() else {}
    if args.report:
        return report(work, seconds)
    log = work / "benchmark.log"
    args.checkpoint = (args.checkpoint or work / "smollm2").resolve()
    if not args.checkpoint.exists():
        composer(log, "model", "import-smollm2", str(args.checkpoint))
    recall, sft = write_recipes(work, args)
    sets = [x for o in args.overrides for x in ("--set", o)]

    def stage(name: str, *command: str) -> None:
        seconds[name] = seconds.get(name, 0.0) + composer(log, *command)
        timings.write_text(json.dumps(seconds, indent=1) + "\n")
        print(f"{name}: done ({seconds[name]:.0f} s)", flush=True)

    export = work / "runs" / "sft" / "export"
    if not (export / "config.json").is_file():
        stage("sft", "train", "sft", str(sft), *(["--resume"] if (work / "runs" / "sft" / "sft-examples").is_dir() else []))
    run = work / "runs" / RL_RUN
    for when, checkpoint in (("before", export), ("after", run)):
        if when == "after":
            policy = json.loads((run / "policy.json").read_text())["version"] if (run / "policy.json").is_file() else 0
            if policy < args.rl_steps:
                resume = ["--resume"] if (run / "metrics.jsonl").is_file() else []
                stage("rl", "train", "rl", str(recall), "--set", f"model.checkpoint={export}", "--set", "rl.eval=null", *sets, *resume)
        for policy in POLICIES:
            extra = [x for o in policy_overrides(policy, args.large_context) for x in ("--set", o)]
            out = work / f"{when}-{policy}"
            if len(graded(out)) < args.held_out:
                stage(
                    f"eval {when}-{policy}",
                    "eval",
                    str(recall),
                    str(checkpoint),
                    "--out",
                    str(out),
                    "--batch",
                    str(args.batch),
                    *sets,
                    *extra,
                )
    print("command: python benchmarks/summarization.py " + " ".join(sys.argv[1:]))
    report(work, seconds)


if __name__ == "__main__":
    main()
