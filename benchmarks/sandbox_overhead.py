"""What the sandbox costs per graded completion, against running the same test program with no isolation.

Both sides grade the first N HumanEval canonical solutions one at a time, in the same process:
  baseline  `python -c <program + tests>` in a subprocess (what an unsandboxed grader would do);
  sandbox   `Sandbox.run` (a child forked by the fork server: namespaces, a root of its own, dedicated uid,
            limits, outputs as plain data, the verdict in this process, flags, clean-up).
Prints seconds per completion for each and their ratio. Then a smoke RL step's grading: 64 smoke completions
graded one after another (as the agent loop did) and concurrently, one sandbox per core (as it does now).
Run: python benchmarks/sandbox_overhead.py [N]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer.recipes.schema import SandboxSection  # noqa: E402
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


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
