"""What the ssh launcher costs over the local one: the same short smoke mid-training (world size 2), in one run.

    python benchmarks/launch_overhead.py [--steps 4] [--repeats 3]      (as root: it makes network namespaces)

Variants, interleaved `--repeats` times after one warm-up run (tokenized corpus cached): `local` (torchrun here,
2 processes), `ssh 1x2` (one host in a network namespace over SSH, 2 processes) and `ssh 2x1` (two such hosts, one
process each, gloo between them). Prints the median wall time of `composer train midtrain` per variant and its
difference to `local`: the launcher's overhead (SSH connections, the shared run.dir probe, the c10d rendezvous).
The same variants also start an empty job (ranks of `python -m site`), which isolates the launch from training.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import netns_hosts  # noqa: E402  (the namespaced hosts of the tests)


def composer(*args: str) -> float:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "composer.cli", *args], cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    if result.returncode != 0:
        raise SystemExit(f"composer {' '.join(args[:3])} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    why = netns_hosts.available()
    if why:
        raise SystemExit(f"cannot make test hosts here: {why}")
    work = Path(tempfile.mkdtemp(prefix="launch-overhead-"))
    composer("model", "init", str(work / "init"))
    (work / "hosts").mkdir()
    hosts = netns_hosts.Hosts(work / "hosts", 2)
    try:
        ssh = [
            "cluster.ssh.user=root",
            f"cluster.ssh.key_file={hosts.client_key}",
            f"cluster.ssh.known_hosts={hosts.known_hosts}",
            "cluster.launcher=ssh",
            f"cluster.env={{GLOO_SOCKET_IFNAME: {netns_hosts.INTERFACE}}}",
        ]
        variants = {
            "local": ["cluster.procs_per_host=2"],
            "ssh 1x2": ["cluster.procs_per_host=2", f"cluster.hosts=[{hosts.names[0]}]", *ssh],
            "ssh 2x1": ["cluster.procs_per_host=1", f"cluster.hosts={hosts.names}", "parallelism.ep=1", *ssh],
        }
        base = [
            f"model.checkpoint={work / 'init'}",
            f"data.cache_dir={work / 'cache'}",
            f"train.steps={args.steps}",
            f"train.eval_every={args.steps}",
            "train.eval_batches=1",
            f"train.checkpoint_every={args.steps}",
            "optim.warmup_steps=1",
            "data.split=[90,10,0]",
            'data.sources.0.paths=["{stdlib}/email/**/*.py"]',
        ]

        def run(name: str, extra: list[str]) -> float:
            sets = [*base, f"run.dir={work / 'runs'}", f"run.name={name.replace(' ', '-')}-{time.monotonic_ns()}", *extra]
            return composer("train", "midtrain", str(REPO / "recipes" / "smoke-midtrain.yaml"), *(a for s in sets for a in ("--set", s)))

        run("warm-up", variants["local"])
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        bare: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, extra in variants.items():
                seconds[name].append(run(name, extra))
                bare[name].append(empty_job(work, [*base, *extra]))
    finally:
        hosts.close()
    report(f"smoke midtrain, {args.steps} steps, world size 2", seconds, args.repeats)
    report("an empty job (torchrun + ranks that only start and exit: the launch itself), world size 2", bare, args.repeats)


def empty_job(work: Path, sets: list[str]) -> float:
    """The launcher alone: start ranks of a module that does nothing (`-m site`) on the variant's hosts, wait."""
    from composer.cluster.launch import run_to_end
    from composer.cluster.launchers import build_launcher
    from composer.recipes.loader import load_recipe
    from composer.runtime.run_dir import RunDir

    recipe = load_recipe(REPO / "recipes" / "smoke-midtrain.yaml", sets)
    run = RunDir(work / "empty" / str(time.monotonic_ns()))
    run.logs.mkdir(parents=True)
    started = time.perf_counter()
    run_to_end(build_launcher(recipe.cluster).start("site", [], run))
    return time.perf_counter() - started


def report(title: str, seconds: dict[str, list[float]], repeats: int) -> None:
    local = statistics.median(seconds["local"])
    print(f"{title}, median of {repeats} (all runs in s):")
    for name, values in seconds.items():
        print(
            f"  {name:8s} {statistics.median(values):6.2f} s   vs local {statistics.median(values) - local:+6.2f} s   "
            f"({', '.join(f'{v:.2f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
