"""Does self-summarization help on tasks longer than the context, and does RL make the summaries better?

Held-out `recall` tasks (recipes/smollm2-recall.yaml: codes spread over workspace files read one per turn, all needed
for the answer) in a fixed context budget, evaluated with `composer eval` under three context policies:

    summarize      the policy summarizes its context when it fills (rollout.compaction: summarize)
    drop_oldest    the oldest turns are dropped instead (rollout.compaction: drop_oldest)
    large_context  a context large enough that nothing is dropped (the upper bound)

before RL and after an RL run with self-summarization (`composer train rl`, its policy then evaluated the same way).
Run again with the same arguments and `--keep DIR`, a stopped benchmark continues where it was (evaluations keep
what they graded, the RL run resumes).
Prints per policy the greedy pass@1 and mean reward (the share of codes returned) with 95% bootstrap intervals, the
compaction error and summary length, and paired differences (same tasks) between policies and before/after RL.

    python benchmarks/summarization.py [--checkpoint HF_DIR] [--tasks N] [--steps N] [--parts P] [--keep DIR] [--set k=v]
    python benchmarks/summarization.py --report WORK_DIR     # the figures of a finished benchmark
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from composer.rl.evaluation import bootstrap_interval  # noqa: E402

RECIPE = REPO / "recipes" / "smollm2-recall.yaml"
POLICIES = {
    "summarize": [],
    "drop_oldest": ["rollout.compaction=drop_oldest"],
    "large_context": ["rollout.summarize_at=null", "rollout.max_context=4096"],
}
RUN_NAME = "recall-rl"


def composer(args: list[str], log: Path) -> None:
    with log.open("a") as out:
        done = subprocess.run([sys.executable, "-m", "composer.cli", *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"composer {' '.join(args[:2])} failed (exit {done.returncode}); see {log}:\n" + log.read_text()[-3000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="SmolLM2 HF checkpoint (default: composer model import-smollm2 into the work dir)")
    parser.add_argument("--tasks", type=int, default=16, help="held-out recall tasks evaluated")
    parser.add_argument("--steps", type=int, default=8, help="RL steps")
    parser.add_argument("--parts", type=int, default=4, help="files (codes) per task")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--keep", type=Path, help="work directory to keep (default: a temporary one)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra recipe override, k=v")
    parser.add_argument("--report", type=Path, metavar="WORK_DIR", help="only print the figures of a finished benchmark")
    args = parser.parse_args()
    if args.report:
        return report(args.report)
    with tempfile.TemporaryDirectory() as tmp:
        work = (args.keep or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        log = work / "benchmark.log"
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = work / "smollm2"
            if not checkpoint.exists():
                composer(["model", "import-smollm2", str(checkpoint)], log)
        checkpoint = checkpoint.resolve()
        common = [
            f"model.checkpoint={checkpoint}",
            f"run.dir={work / 'runs'}",
            f"run.name={RUN_NAME}",
            f"train.seed={args.seed}",
            f"train.steps={args.steps}",
            f"rl.eval.limit={args.tasks}",
            f"env.tasks.0.recall.parts={args.parts}",
            "rl.eval.samples=0",
            "rl.eval.pass_k=[]",
            *args.overrides,
        ]
        sets = [x for o in common for x in ("--set", o)]
        timings = {}
        started = time.monotonic()
        for policy, extra in POLICIES.items():
            composer(
                [
                    "eval",
                    str(RECIPE),
                    str(checkpoint),
                    "--out",
                    str(work / f"before-{policy}"),
                    *sets,
                    *(x for o in extra for x in ("--set", o)),
                ],
                log,
            )
        timings["evaluations before RL"] = time.monotonic() - started
        started = time.monotonic()
        run = work / "runs" / RUN_NAME
        if not (run / "policy.json").is_file() or json.loads((run / "policy.json").read_text())["version"] < args.steps:
            # evaluated below, as before RL; a rerun of a stopped benchmark resumes the run (and each evaluation)
            composer(
                ["train", "rl", str(RECIPE), *sets, "--set", "rl.eval=null", *(["--resume"] if (run / "metrics.jsonl").exists() else [])],
                log,
            )
        timings["RL run"] = time.monotonic() - started
        started = time.monotonic()
        for policy, extra in POLICIES.items():
            composer(
                [
                    "eval",
                    str(RECIPE),
                    str(work / "runs" / RUN_NAME),
                    "--out",
                    str(work / f"after-{policy}"),
                    *sets,
                    *(x for o in extra for x in ("--set", o)),
                ],
                log,
            )
        timings["evaluations after RL"] = time.monotonic() - started
        (work / "timings.json").write_text(json.dumps(timings))
        print("command: python benchmarks/summarization.py " + " ".join(sys.argv[1:]))
        report(work)


def graded(out: Path) -> dict[str, dict]:
    """The greedy episode of each task of one evaluation (its checkpoint.jsonl)."""
    episodes = [json.loads(line) for line in (out / "checkpoint.jsonl").read_text().splitlines() if line.strip()]
    return {e["task"]: e for e in episodes if e["mode"] == "greedy"}


def interval(values: np.ndarray, signed: bool = False) -> str:
    low, high = bootstrap_interval(values)
    return f"[{low:+.3f}, {high:+.3f}]" if signed else f"[{low:.3f}, {high:.3f}]"


def report(work: Path) -> None:
    results = {
        (when, policy): graded(work / f"{when}-{policy}")
        for when in ("before", "after")
        for policy in POLICIES
        if (work / f"{when}-{policy}" / "checkpoint.jsonl").is_file()
    }
    tasks = sorted(set.intersection(*(set(r) for r in results.values())))
    recipe = json.loads((work / "before-summarize" / "eval.json").read_text())
    rollout = recipe["rollout"]
    parts = recipe["env"]["tasks"][0]["recall"]["parts"]
    print(
        f"recall: {len(tasks)} held-out tasks of {parts} parts; context {rollout['max_context']} tokens, compaction at "
        f"{rollout['summarize_at']}, at most {rollout['max_turns']} turns of {rollout['sampling']['max_tokens']} tokens; greedy"
    )
    timings = json.loads((work / "timings.json").read_text()) if (work / "timings.json").is_file() else {}
    if timings:
        print("wall time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()))
    print(
        f"{'':>6} {'policy':<14} {'pass@1 [95% CI]':>22} {'reward [95% CI]':>22} {'compaction error':>17} {'summary tok':>11} "
        f"{'compactions/ep':>14}  ends"
    )
    for (when, policy), by_task in results.items():
        episodes = [by_task[t] for t in tasks]
        passed = np.array([float(e["passed"]) for e in episodes])
        reward = np.array([e["reward"] for e in episodes])
        errors = [x for e in episodes for x in e["compaction_errors"]]
        lengths = [n for e in episodes for n in e["summary_tokens"]]
        compactions = np.mean([len(e["compaction_errors"]) if e["compaction_errors"] else e["summaries"] for e in episodes])
        ends = {}
        for e in episodes:
            ends[e["end_reason"]] = ends.get(e["end_reason"], 0) + 1
        error = f"{np.mean(errors):.3f} (n={len(errors)})" if errors else "-"
        print(
            f"{when:>6} {policy:<14} {passed.mean():.3f} {interval(passed):>16} {reward.mean():.3f} {interval(reward):>16} "
            f"{error:>17} {np.mean(lengths) if lengths else 0:>11.1f} {compactions:>14.2f}  {ends}"
        )
    for when in ("before", "after"):
        for a, b in (("summarize", "drop_oldest"), ("summarize", "large_context")):
            if (when, a) in results and (when, b) in results:
                diff = np.array([results[(when, a)][t]["reward"] - results[(when, b)][t]["reward"] for t in tasks])
                print(f"{when} RL: reward {a} - {b}: {diff.mean():+.3f} {interval(diff, signed=True)} (paired, same tasks)")
    for policy in POLICIES:
        if ("before", policy) in results and ("after", policy) in results:
            diff = np.array([results[("after", policy)][t]["reward"] - results[("before", policy)][t]["reward"] for t in tasks])
            gained = sum(results[("after", policy)][t]["passed"] and not results[("before", policy)][t]["passed"] for t in tasks)
            lost = sum(results[("before", policy)][t]["passed"] and not results[("after", policy)][t]["passed"] for t in tasks)
            print(
                f"{policy}: reward after - before RL: {diff.mean():+.3f} {interval(diff, signed=True)}; tasks gained {gained}, lost {lost}"
            )
    metrics_path = work / "runs" / RUN_NAME / "metrics.jsonl"
    if metrics_path.is_file():
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]

        def column(key: str) -> str:
            return " ".join(f"{m[key]:.2f}" if key in m else "-" for m in metrics)

        print(f"RL ({len(metrics)} steps): train reward per step {column('reward_mean')}")
        print(f"  compaction error per step {column('compaction_error_mean')}; summary tokens {column('summary_tokens_mean')}")


if __name__ == "__main__":
    main()
