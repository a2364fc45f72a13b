"""`composer train rl`: start the learner (torchrun), run rollouts here, until the learner's last step."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from cluster.launch import Job, Launcher, build_launcher
from recipes.checks import refuse_resume_changes, refuse_unhonoured
from recipes.errors import UserError
from recipes.loader import load_recipe, recipe_to_yaml
from recipes.runs import RunDir
from recipes.schema import Recipe
from rl.layout import Policy, RLRunFiles, sync_section
from rl.rollout_worker import RolloutWorker
from sync.pusher import push_version
from trainer.checkpointing import LAYOUT_KEYS
from trainer.model import ARCHITECTURE_FIELDS

UNHONOURED = {
    "data": "RL trains on rollouts, not on a corpus",
    "train.eval_every": "RL reports rewards every step instead of a held-out evaluation",
    "train.eval_batches": "RL reports rewards every step instead of a held-out evaluation",
    "train.log_every": "the learner records every step",
}


RESUME_FIXED = [
    "train.seed", "train.global_batch_size", "env.tasks", "env.reward", "rl.group_size", "rl.prompts_per_step",
    *(f"parallelism.{key}" for key in LAYOUT_KEYS), *(f"model.{key}" for key in ARCHITECTURE_FIELDS),
]
"""What the tasks of group n, the rewards already stored and the learner's checkpoints depend on."""


def check_rl_recipe(recipe: Recipe) -> None:
    if recipe.rl is None:
        raise UserError("train rl: the recipe has no rl section (with rollout and env)")
    if not recipe.model.checkpoint:
        raise UserError("train rl: model.checkpoint must name the HF checkpoint the policy starts from")
    refuse_unhonoured(recipe, "train rl", UNHONOURED)


def learner_launch(recipe: Recipe) -> tuple[Launcher, str, list[str]]:
    """How the learner ranks start on the recipe's training hosts (cluster.launcher)."""
    return build_launcher(recipe.cluster), "rl.learner_main", [str(RunDir.of(recipe).root)]


def start_learner(recipe: Recipe, files: RLRunFiles) -> Job:
    """The learner ranks, in the background (the rollouts run meanwhile); their output goes to the run's logs."""
    launcher, module, args = learner_launch(recipe)
    return launcher.start(module, args, RunDir(files.root))


def stop(learner: Job) -> None:
    learner.terminate()  # torchrun forwards it to the ranks, on every host


def learner_done(learner: Job, files: RLRunFiles) -> bool:
    files.beat()  # the learner gives up waiting for rollouts if the driver goes quiet
    return learner.poll() is not None


def run_rl(recipe: Recipe, resume: bool, console: Console) -> Path:
    check_rl_recipe(recipe)
    learner_launch(recipe)[0].check_startable()
    run = RunDir.of(recipe)
    if resume and run.recipe_path.is_file():
        refuse_resume_changes(load_recipe(run.recipe_path), recipe, RESUME_FIXED, str(run.recipe_path),
                              "the run's trajectories and checkpoints")
    run.prepare(recipe_to_yaml(recipe), resume)
    files = RLRunFiles(run.root)
    if files.policy() is None:
        console.print(f"publishing the initial policy from {recipe.model.checkpoint}")
        info = push_version(recipe.model.checkpoint, sync_section(recipe, files), recipe.cluster.ssh, cache_dir=files.root / "sync-cache")
        files.publish_policy(Policy(0, info.id))
    learner = start_learner(recipe, files)
    try:
        worker = RolloutWorker(recipe, files, on_group=lambda gid, s: console.print(
            f"[dim]{gid}[/] engine {s['engine']} ({s['host']})  policy v{s['policy_version']}  reward {s['reward_mean']:.3f}  {s['generated_tokens_per_s']:.0f} tok/s"))
        try:
            worker.run(should_stop=lambda: learner_done(learner, files))
        finally:
            worker.close()
        learner.wait()
    finally:
        stop(learner)
    if learner.poll() != 0:
        raise UserError(learner.failure())
    return run.root
