"""What the sandbox costs per graded completion, against running the same test program with no isolation.

Both sides grade the first N HumanEval canonical solutions one at a time, in the same process:
  baseline  `python -c <program + tests>` in a subprocess (what an unsandboxed grader would do);
  sandbox   `Sandbox.run` (a child forked by the fork server: namespaces, a root of its own, dedicated uid,
            limits, outputs as plain data, the verdict in this process, flags, clean-up).
Prints seconds per completion for each and their ratio. Then a smoke RL step's grading: 64 smoke completions
graded one after another (as the agent loop did) and concurrently, one sandbox per core (as it does now).
Run: python benchmarks/sandbox_overhead.py [N]

`--before REV [N]`: a run's start and a repository grading's latency (p50 over N of each, the same trivial program
and the same small project graded by `run_tests_guarded` with an honest fix), measured for the tree at REV (extracted
with `git archive` and imported in a child process) and for this tree, one after the other on this machine; prints
both and the ratios (what the isolation added since REV costs).
Run: python benchmarks/sandbox_overhead.py --before 0a078ee 30
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer.recipes.env_schema import SandboxSection  # noqa: E402
from composer.rollout.sandbox.runs import Sandbox  # noqa: E402
from composer.rollout.tasks.functions import HumanEvalSource, smoke_task  # noqa: E402


def main(n: int) -> None:
    sandbox = Sandbox(SandboxSection())
    source = HumanEvalSource()
    tasks = [source.task(i, sandbox) for i in range(n)]

    started = time.perf_counter()
    for task in tasks:
        script = "\n".join([task.reference, task.tests.setup, "candidate = " + task.entry_point, *task.tests.cases])
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    baseline = (time.perf_counter() - started) / n

    started = time.perf_counter()
    for task in tasks:
        result = sandbox.run(task.reference, task.tests)
        if result.reward != 1.0:
            raise SystemExit(f"{task.id}: reference scored {result.reward} ({result.status})")
    sandboxed = (time.perf_counter() - started) / n

    print(f"isolation: {sandbox.isolation.dedicated_uid=} {sandbox.isolation.namespaces=}")
    print(f"baseline (plain subprocess): {baseline * 1000:.1f} ms per completion")
    print(f"sandbox:                     {sandboxed * 1000:.1f} ms per completion")
    print(f"ratio sandbox / baseline:    {sandboxed / baseline:.2f}x")

    step = [(smoke_task(i % 4).program(str(i % 10)), smoke_task(i % 4).tests) for i in range(64)]
    started = time.perf_counter()
    for program, tests in step:
        sandbox.run(program, tests)
    one_by_one = time.perf_counter() - started
    workers = os.cpu_count() or 1
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda job: sandbox.run(*job), step))
    concurrent = time.perf_counter() - started
    print(
        f"smoke step grading (64 completions): one by one {one_by_one:.2f} s, "
        f"concurrent ({workers} at once) {concurrent:.2f} s, {one_by_one / concurrent:.2f}x faster"
    )


TOY_TESTS = "from toy.core import double\n\n\ndef test_double():\n    assert double(2) == 4\n"


def latencies(n: int) -> dict[str, float]:
    """p50 seconds of a sandboxed run's start (a trivial program, end to end) and of a guarded repository grading."""
    from composer.rollout.sandbox.results import ScriptRun
    from composer.rollout.tasks.repository.workspace import run_tests_guarded

    work = Path(tempfile.mkdtemp(prefix="sandbox-latency-"))
    sandbox = Sandbox(SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048), root=work / "sandboxes")
    root = work / "toy"
    (root / "toy" / "tests").mkdir(parents=True)
    (root / "toy" / "__init__.py").write_text("")
    (root / "toy" / "core.py").write_text("def double(x):\n    return x + x + 1\n")
    (root / "toy" / "tests" / "__init__.py").write_text("")
    (root / "toy" / "tests" / "test_core.py").write_text(TOY_TESTS)
    for path in [work, root, *root.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    fix = {"toy/core.py": b"def double(x):\n    return x + x\n"}
    sandbox.run("print(1)\n", ScriptRun())  # the fork server's start is not a run's
    starts, grades = [], []
    for _ in range(n):
        started = time.perf_counter()
        result = sandbox.run("print(1)\n", ScriptRun())
        starts.append(time.perf_counter() - started)
        assert result.stdout_tail == "1\n", result
        started = time.perf_counter()
        report = run_tests_guarded(sandbox, root, fix, ("toy/tests/test_core.py",), (), 60, (), work / "views")
        grades.append(time.perf_counter() - started)
        assert report.complete and set(report.outcomes.values()) == {"passed"}, report.output
    import composer

    return {"start": statistics.median(starts), "grade": statistics.median(grades), "tree": os.path.dirname(composer.__file__)}


def before_after(rev: str, n: int) -> None:
    """The tree at `rev` as the package `composer` (a child process; the editable install's finder comes after
    sys.path), then this tree."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="composer-before-") as tmp:
        archive = subprocess.run(["git", "-C", str(repo), "archive", rev], check=True, capture_output=True).stdout
        tree = Path(tmp) / "tree"
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        for folder in ("cli", "rl", "rollout", "trainer", "sync", "data", "runtime", "cluster", "recipes"):
            (tree / "composer" / folder).symlink_to(tree / folder)
        # This script, run from the old tree (its own directory's parent goes first on sys.path).
        (tree / "benchmarks" / "sandbox_overhead.py").write_text(Path(__file__).read_text())
        child = subprocess.run(
            [sys.executable, str(tree / "benchmarks" / "sandbox_overhead.py"), "--latencies", str(n)],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(tree)},
            cwd=tmp,
        )
    before = json.loads(child.stdout.splitlines()[-1])
    assert before.pop("tree") == str(tree / "composer"), "the child did not import the old tree"
    after = latencies(n)
    after.pop("tree")
    print(f"p50 over {n}, this machine ({os.cpu_count()} CPUs), before = {rev}:")
    for name, what in (("start", "a sandboxed run (trivial program)"), ("grade", "a guarded repository grading")):
        print(
            f"  {what:34s} before {before[name] * 1000:7.1f} ms  after {after[name] * 1000:7.1f} ms  ratio {after[name] / before[name]:.2f}x"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--latencies"]:
        print(json.dumps(latencies(int(sys.argv[2]))))
    elif sys.argv[1:2] == ["--before"]:
        before_after(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 30)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
