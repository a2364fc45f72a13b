"""Worker for test_rl_learner: one rank of the RL learner (`rl.learner_main`) on a process group whose collectives
time out after argv[2] seconds (torch.distributed's own timeout; the learner joins a group that already exists).
Each rank says when it starts waiting for its step's groups (`rank-N.waiting`)."""

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from composer.recipes.loader import load_recipe
from composer.rl import learner_main
from composer.rl.protocol import RLRunFiles
from composer.runtime.run_dir import RunDir


def main() -> None:
    run, timeout = RunDir(Path(sys.argv[1])), float(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    take = learner_main.take

    def take_and_say_so(queue, step_groups, step):
        (run.root / f"rank-{dist.get_rank()}.waiting").touch()  # the producer's delay counts from here
        return take(queue, step_groups, step)

    learner_main.take = take_and_say_so
    learner_main.run_learner(load_recipe(run.recipe_path), RLRunFiles(run.root))


if __name__ == "__main__":
    main()
