"""What the sandbox costs per graded completion, against running the same test program with no isolation.

Both sides grade the first N HumanEval canonical solutions one at a time, in the same process:
  baseline  `python -c <program + tests>` in a subprocess (what an unsandboxed grader would do);
  sandbox   `Sandbox.run` (a child forked by the fork server: namespaces, a root of its own, dedicated uid,
            limits, outputs as plain data, the verdict in this process, flags, clean-up).
Prints seconds per completion for each and their ratio. Run: python benchmarks/sandbox_overhead.py [N]
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.schema import SandboxSection  # noqa: E402
from rollout.sandbox import Sandbox  # noqa: E402
from rollout.tasks import HumanEvalSource  # noqa: E402


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


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
