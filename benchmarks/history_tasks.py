"""History tasks of a project's git log: candidates, validated, and rejected by reason, every candidate tried.

    python benchmarks/history_tasks.py --path ~/src/networkx --package networkx --test-path networkx \
        --python python3.12 --commits 40 --cache /tmp/history-cache

Builds `kinds: [history]` of the project (a git checkout read at its HEAD; the environment `pip install pytest`, the
project imported from its checkout) with `num_tasks` past any count, so every candidate among the last `--commits`
first-parent commits is decided, and prints one JSON line: tried, validated, rejected by reason, seconds. Run it with
another tree's interpreter and code (e.g. a worktree of main with its own .venv) for a before/after on the same
commits; give each run a cache of its own. Needs root for the sandbox (as the CI runs).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="the project's git checkout")
    parser.add_argument("--package", required=True, help="its package, relative to the checkout (src/name, name)")
    parser.add_argument("--test-path", default="tests", help="where its test files are")
    parser.add_argument("--python", default=None, help="the project environment's interpreter (default: this one)")
    parser.add_argument("--name", default="project")
    parser.add_argument("--commits", type=int, default=40, help="the last N first-parent commits")
    parser.add_argument("--cache", required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    from composer.recipes.env_schema import RepoTaskSettings, SandboxSection
    from composer.rollout.tasks.repository.build import build_repo_tasks

    project = {"name": args.name, "path": args.path, "commit": "HEAD", "package": args.package, "test_paths": [args.test_path]}
    project["install"] = "pip install pytest"
    if args.python:
        project["python"] = args.python
    settings = RepoTaskSettings(
        projects=[project], kinds=["history"], num_tasks=100_000, history_commits=args.commits, cache_dir=args.cache, max_test_seconds=20
    )
    started = time.monotonic()
    sandbox = SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048)
    report = build_repo_tasks(settings, sandbox, Path(args.cache) / "sandboxes", workers=args.workers)
    seconds = round(time.monotonic() - started)
    print(
        json.dumps(
            {"tried": report.tried, "validated": report.validated, "rejected": dict(report.rejected.most_common()), "seconds": seconds}
        )
    )


if __name__ == "__main__":  # the build's workers start from a fork server, which imports this module again
    main()
