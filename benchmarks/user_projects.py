"""The corpus of real user projects (tests/helpers/user_corpus.py: six sdists from the package registry, one per
build backend) built into repository tasks of every kind: per project, candidates and validated per kind,
rejections by reason, the build's time (its environment's install included) and the share of candidates validated.

    python benchmarks/user_projects.py [--tasks 16] [--projects packaging,toolz] [--workers 2] [--keep DIR]

Each project is given a git history (`make_repository`), built once for two seeded regressions its tests catch
(bug tasks at the sdist's commit), the regressions committed with their fixes (`add_fixes`: the history tasks),
then built at the last fix with kinds bug, feature, multi and history, candidates taken in order until `--tasks`
validate (every candidate by default). The installs read only `.cache/user-corpus` (scripts/setup.sh fetches it);
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import cpu_model  # noqa: E402
from composer.recipes.errors import UserError  # noqa: E402
from composer.rollout.tasks.repository.build import BuildReport  # noqa: E402
from tests.helpers.user_corpus import CORPUS, KINDS, CorpusProject, build_project, missing, offline_index  # noqa: E402


def row(project: CorpusProject, report: BuildReport, seconds: float) -> str:
    per_kind = " ".join(
        f"{kind} {report.by_project_kind[(project.name, kind)]}/{report.tried_by_project_kind[(project.name, kind)]}" for kind in KINDS
    )
    share = report.validated / report.tried if report.tried else 0.0
    return f"| {project.name} {project.version} | {project.backend} | {per_kind} | {report.validated}/{report.tried} | {share:.0%} | {seconds:.0f} s |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--projects", default=",".join(p.name for p in CORPUS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=100_000, help="per project: stop once this many validate (default: try all)")
    parser.add_argument("--keep", type=Path, help="build here and keep it (default: a temporary directory, removed)")
    args = parser.parse_args()
    if reason := missing():
        sys.exit(reason)
    os.environ.update(offline_index())
    chosen = [p for p in CORPUS if p.name in args.projects.split(",")]
    base = args.keep or Path(tempfile.mkdtemp(prefix="user-projects-"))
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; workers {args.workers}")
    print("| project | backend | validated/candidates per kind | validated | share | build time |")
    print("|---|---|---|---|---|---|")
    rejections, passing = [], 0
    try:
        for project in chosen:
            try:
                built = build_project(project, base, args.workers, args.tasks)
            except UserError as e:
                print(f"| {project.name} {project.version} | {project.backend} | refused: {e} | | | |", flush=True)
                continue
            report, seconds = built.report, built.seconds
            print(row(project, report, seconds), flush=True)
            passing += report.tried > 0 and report.validated >= 0.8 * report.tried
            rejections += [f"{project.name}: {reason}: {count}" for reason, count in report.rejected.most_common()]
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    print("\nrejections by reason:")
    print("\n".join(f"  {line}" for line in rejections) or "  none")
    print(f"\n{passing} of {len(chosen)} projects validate at least 80% of their candidates; load {os.getloadavg()[0]:.1f}")
    if passing < len(chosen) - 1:  # the target (issue 40): at least 80% on five of six, all but one project
        sys.exit(f"MISSED its target: {passing} of {len(chosen)} projects at 80%, at least {len(chosen) - 1} wanted")


if __name__ == "__main__":
    main()
