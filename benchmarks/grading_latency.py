"""Grading time per repository task: this tree's grader against another tree's (e.g. the commit before it), in one run.

    git archive <commit> | tar -x -C /tmp/grader-old
    python benchmarks/grading_latency.py --baseline /tmp/grader-old [--tasks 6] [--repeats 5]

Builds (or reuses) a networkx task set, then grades an honest fix of each task (its original module written back
through the shell, as an agent would) with each tree's `RepoWorkspace.grade`, in one worker process per tree (each
imports its own tree's code, past the editable install's finder, and has its own sandbox), alternating between the two for every grade so both see the
same load. Prints the build's rejections by project and reason (a task whose original or change behaves otherwise
across the grading boundary, or whose calls cannot cross it, is rejected) and the share of tasks that cross, p50/p95
seconds per grade for each tree, their ratio, and, for this tree, how much of a grade is `keep_change` (taking the
task's change and checking it). Without --baseline only this tree is timed.
Needs root for the sandbox's own root and overlayfs views (as the CI runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = [
    "networkx/algorithms/shortest_paths/unweighted.py",
    "networkx/generators/ego.py",
    "networkx/algorithms/cycles.py",
    "networkx/algorithms/dag.py",
]


def settings(cache_dir: str, num_tasks: int):
    from composer.recipes.env_schema import RepoTaskSettings

    return RepoTaskSettings(projects=["networkx"], num_tasks=num_tasks, include=MODULES, cache_dir=cache_dir)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def worker(cache_dir: str, num_tasks: int) -> None:
    """Grade the tasks asked for on stdin (one index a line) with this process's tree; one JSON line each."""
    from composer.recipes.env_schema import SandboxSection
    from composer.rollout.sandbox.runs import Sandbox
    from composer.rollout.tasks.repository.task_set import load_tasks, open_workspace, repo_tests

    tasks = load_tasks(settings(cache_dir, num_tasks))
    sandbox = Sandbox(
        SandboxSection(cpu_seconds=120, wall_seconds=300, memory_mb=2048), root=Path(tempfile.mkdtemp(prefix="grading-bench-"))
    )
    keep = None
    try:
        from composer.rollout.tasks.repository.grading_policy import keep_change as keep
    except ImportError:
        pass
    print(json.dumps({"ready": len(tasks)}), flush=True)
    for line in sys.stdin:
        task = tasks[int(line)]
        tests = repo_tests(task, settings(cache_dir, num_tasks))
        original = (tests.grading_base / task["path"]).read_text()
        with open_workspace(tests, sandbox) as ws:
            ws.shell(f"cat > {task['path']} <<'COMPOSER_EOF'\n{original}COMPOSER_EOF", 60)
            started = time.perf_counter()
            result = ws.grade()
            seconds = time.perf_counter() - started
            kept = None
            if keep is not None:
                started = time.perf_counter()
                keep(ws.changed(), ws._task_files, tests.grading_base, tests.packages, tests.scope)
                kept = time.perf_counter() - started
        print(json.dumps({"seconds": seconds, "keep_change": kept, "reward": result.reward, "flags": list(result.flags)}), flush=True)


def use_tree(tree: Path) -> None:
    """Import `composer` from `tree`: the editable install's finder would map it to the installed checkout."""
    import types

    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    package = types.ModuleType("composer")
    package.__path__ = [str(tree)]
    sys.modules["composer"] = package


def start(tree: Path, cache_dir: str, num_tasks: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--worker", cache_dir, str(num_tasks)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ready = json.loads(process.stdout.readline())
    if ready["ready"] < num_tasks:
        raise SystemExit(f"{tree}: only {ready['ready']} tasks built")
    return process


def grade(process: subprocess.Popen, index: int) -> dict:
    process.stdin.write(f"{index}\n")
    process.stdin.flush()
    return json.loads(process.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout of the project (e.g. git worktree add /tmp/grader-old <commit>)")
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dir", default=str(REPO / ".cache/composer/repo-tasks"))
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--set-dir", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker or args.set_dir:
        use_tree(Path.cwd())
        if args.set_dir:
            from composer.rollout.tasks.repository.build import set_dir

            print(set_dir(settings(args.set_dir[0], int(args.set_dir[1]))))
        else:
            worker(args.worker[0], int(args.worker[1]))
        return
    sys.path.insert(0, str(REPO))
    from composer.recipes.env_schema import SandboxSection
    from composer.rollout.tasks.repository.build import build_repo_tasks

    cache_dir = str(Path(args.cache_dir).resolve())
    report = build_repo_tasks(settings(cache_dir, args.tasks), SandboxSection(), Path(tempfile.mkdtemp(prefix="grading-build-")), workers=2)
    print(f"{report.validated} networkx tasks ({dict(report.by_project_kind)}) of {report.tried} candidates tried")
    crossing = sum(n for reason, n in report.rejected.items() if "grading boundary" in reason)
    print(f"  through the grading boundary: {report.validated} of {report.validated + crossing} tasks that pass in pytest's process")
    for reason, count in report.rejected.most_common():
        print(f"  rejected: {reason}: {count}")
    print(f"{args.repeats} honest grades of each per tree, alternating")
    trees = {"this tree": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    if args.baseline:
        # The same tasks for both: the baseline's cache key may differ (its build engine's version).
        from composer.rollout.tasks.repository.build import set_dir

        theirs = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--set-dir", cache_dir, str(args.tasks)],
            cwd=trees["baseline"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if not Path(theirs).exists():
            shutil.copytree(set_dir(settings(cache_dir, args.tasks)), theirs, symlinks=True)
    workers = {name: start(tree, cache_dir, args.tasks) for name, tree in trees.items()}
    times: dict[str, list[float]] = {name: [] for name in trees}
    kept: list[float] = []
    for repeat in range(args.repeats):
        for index in range(args.tasks):
            order = list(workers) if (repeat + index) % 2 == 0 else list(reversed(workers))
            for name in order:
                result = grade(workers[name], index)
                if result["reward"] != 1.0 or result["flags"]:
                    raise SystemExit(f"{name}: task {index} graded {result}: an honest fix must earn 1.0 without flags")
                times[name].append(result["seconds"])
                if name == "this tree":
                    kept.append(result["keep_change"])
    for process in workers.values():
        process.stdin.close()
        process.wait()
    for name, values in times.items():
        print(
            f"{name:10s} grade p50 {percentile(values, 0.5):6.2f} s  p95 {percentile(values, 0.95):6.2f} s  ({len(values)} grades, {trees[name]})"
        )
    print(f"this tree's keep_change p50 {1e3 * percentile(kept, 0.5):.1f} ms  p95 {1e3 * percentile(kept, 0.95):.1f} ms")
    if "baseline" in times:
        for q in (0.5, 0.95):
            print(f"this tree / baseline p{round(100 * q)} {percentile(times['this tree'], q) / percentile(times['baseline'], q):.2f}x")


if __name__ == "__main__":
    main()
