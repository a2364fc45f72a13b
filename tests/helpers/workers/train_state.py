"""Worker for test_train_state: train, checkpoint, resume; prints JSON results on the last line."""

import json
import sys
from pathlib import Path

import torch

from composer.recipes.loader import load_recipe
from composer.trainer.checkpointing import Checkpointer
from composer.trainer.distributed import init_distributed
from composer.trainer.model import build_model, forward_logits
from composer.trainer.optimizer import TrainOptimizer, wrap_data_parallel


def setup(recipe):
    model = build_model(recipe.model, recipe.parallelism)
    ddp = wrap_data_parallel(model, recipe.parallelism)
    opt = TrainOptimizer(ddp, recipe.optim, recipe.parallelism, recipe.train.steps, torch.float32)
    return model, ddp, opt


def train(ddp, opt, steps, first):
    losses = []
    for _step in range(first, first + steps):
        tokens = torch.randint(0, 4096, (2, 33), generator=torch.Generator().manual_seed(0))  # one batch: the loss must fall
        opt.zero_grad()
        logits = forward_logits(ddp, tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        metrics = opt.step()
        losses.append([loss.item(), metrics["lr"], metrics["grad_norm"]])
    return losses


def main() -> None:
    ckpt_dir = Path(sys.argv[1])
    recipe = load_recipe(
        Path(__file__).parents[3] / "recipes/smoke-midtrain.yaml",
        ["cluster.procs_per_host=1", "parallelism.ep=1", "parallelism.distributed_optimizer=true", *sys.argv[2:]],
    )
    layout = {k: getattr(recipe.parallelism, k) for k in ("tp", "pp", "ep", "etp", "cp")}
    init_distributed(recipe.parallelism, seed=0)
    model, ddp, opt = setup(recipe)
    checkpointer = Checkpointer(ckpt_dir, keep=2)
    first = train(ddp, opt, 3, 0)
    for step in (1, 2, 3):
        checkpointer.save(step, model, opt, {"layout": layout, "marker": step})
    uninterrupted = train(ddp, opt, 3, 3)
    init_distributed(recipe.parallelism, seed=0)
    model2, ddp2, opt2 = setup(recipe)
    state = checkpointer.load(checkpointer.latest(), model2, opt2, layout)
    resumed = train(ddp2, opt2, 3, 3)
    kept = sorted(p.name for p in ckpt_dir.iterdir())
    print(json.dumps({"first": first, "uninterrupted": uninterrupted, "resumed": resumed, "state": state, "kept": kept}))


if __name__ == "__main__":
    main()
