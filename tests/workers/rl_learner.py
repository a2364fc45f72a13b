"""Worker for test_rl_learner: one rank of the RL learner (`rl.learner_main`) on a process group whose collectives
time out after argv[2] seconds (torch.distributed's own timeout; the learner joins a group that already exists)."""

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from recipes.loader import load_recipe
from rl.learner_main import run_learner
from rl.protocol import RLRunFiles
from runtime.run_dir import RunDir


def main() -> None:
    run, timeout = RunDir(Path(sys.argv[1])), float(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    (run.root / f"rank-{dist.get_rank()}.joined").touch()  # the producer's delay counts from here
    run_learner(load_recipe(run.recipe_path), RLRunFiles(run.root))


if __name__ == "__main__":
    main()
