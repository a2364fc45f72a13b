"""Create/destroy latency of repository-task workspaces: overlayfs views vs plain copies, in the same run.

    python benchmarks/workspace_latency.py [--project sympy] [--repeats 30]

Builds nothing: it takes the project's bases from the repo-task cache (made on first use) and a task layer holding
one changed module, then times RepoWorkspace creation and close, alternating overlay and copy, and prints p50/p95
and the copy/overlay ratios. Needs root for overlayfs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.isolation import installed_copies
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.task_set import project_bases
from composer.rollout.tasks.repository.workspace import RepoTests, RepoWorkspace
from composer.rollout.tasks.workspace import overlay_supported


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", default="sympy", choices=["networkx", "sympy"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cache-dir", default=".cache/composer/repo-tasks")
    args = parser.parse_args()

    bases = project_bases(Path(args.cache_dir).resolve(), args.project)
    work = Path(tempfile.mkdtemp(prefix="workspace-bench-"))
    layer = work / "layer"
    module = next(p for p in sorted((bases / "episode" / args.project).rglob("*.py")) if p.stat().st_size > 1000)
    relative = module.relative_to(bases / "episode")
    (layer / relative).parent.mkdir(parents=True)
    (layer / relative).write_text(module.read_text() + "\n# changed\n")
    tests = RepoTests(
        packages=(args.project,),
        test_files=(),
        fail_to_pass=(),
        pass_to_pass=(),
        pytest_args=(),
        layer=layer,
        episode_base=bases / "episode",
        grading_base=bases / "grading",
        hidden=installed_copies(args.project),
        timeout_s=60.0,
    )
    sandbox = Sandbox(SandboxSection(), root=work / "sandbox")
    area = work / "views"
    area.mkdir()
    if not overlay_supported(area):
        raise SystemExit("overlayfs is not available here (needs root): nothing to compare")
    files = sum(1 for _ in (bases / "episode").rglob("*"))
    print(f"{args.project}: {files} files in the base; {args.repeats} workspaces of each kind, alternating")
    timings = {True: ([], []), False: ([], [])}
    for _ in range(args.repeats):
        for overlay in (True, False):
            started = time.perf_counter()
            ws = RepoWorkspace(tests, sandbox, area, overlay=overlay)
            created = time.perf_counter()
            assert (ws.root / relative).read_text().endswith("# changed\n")
            closing = time.perf_counter()
            ws.close()
            closed = time.perf_counter()
            timings[overlay][0].append(created - started)
            timings[overlay][1].append(closed - closing)
    for label, index in (("create", 0), ("destroy", 1)):
        over, copy = timings[True][index], timings[False][index]
        print(
            f"{label:8s} overlay p50 {1e3 * percentile(over, 0.5):8.2f} ms  p95 {1e3 * percentile(over, 0.95):8.2f} ms | "
            f"copy p50 {1e3 * percentile(copy, 0.5):8.2f} ms  p95 {1e3 * percentile(copy, 0.95):8.2f} ms | "
            f"copy/overlay p50 {percentile(copy, 0.5) / percentile(over, 0.5):7.1f}x  mean {statistics.mean(copy) / statistics.mean(over):7.1f}x"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
