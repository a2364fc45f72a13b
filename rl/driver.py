"""`composer train rl`: beat, publish the starting policy, start the learner (torchrun), run rollouts here until
the learner's last step; with `--replay RUN`, the learner trains on RUN's recorded groups and no engine starts."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from recipes.checks import refuse_resume_changes, refuse_unhonoured
from recipes.errors import UserError
from recipes.loader import load_recipe, recipe_to_yaml
from recipes.runs import RunDir
from recipes.schema import ARCHITECTURE_FIELDS, LAYOUT_KEYS, Recipe
from rl import learner_main
from rl.evaluation import summary_line
from rl.protocol import Heartbeat, Policy, ReplayQueue, RLRunFiles, RolloutQueue, StalenessRule, sync_section
from rl.rollout_hosts import LocalHost, open_hosts
from rl.rollout_worker import RolloutWorker
from sync.pusher import push_version
from trainer.launch import clear_rank_errors, first_rank_error, rank_environment, torchrun_command

UNHONOURED = {
    "cluster.hosts": "the learner runs on this host",
    "data": "RL trains on rollouts, not on a corpus",
    "train.eval_every": "RL evaluates on held-out tasks every rl.eval.every steps",
    "train.eval_batches": "RL evaluates every held-out task of rl.eval",
    "train.log_every": "the learner records every step",
}

ARCHITECTURE = [f"model.{key}" for key in ARCHITECTURE_FIELDS]
RESUME_FIXED = [
    "train.seed", "train.global_batch_size", "env.tasks", "env.reward", "rl.group_size", "rl.prompts_per_step",
    *(f"parallelism.{key}" for key in LAYOUT_KEYS), *ARCHITECTURE,
]
"""What the tasks of group n, the rewards already stored and the learner's checkpoints depend on."""
REPLAY_FIXED = ["rl.group_size", "rl.prompts_per_step", *ARCHITECTURE]
"""What must match the recorded run for its groups to be trained again (the learner's settings may change)."""


def check_rl_recipe(recipe: Recipe) -> None:
    if recipe.rl is None:
        raise UserError("train rl: the recipe has no rl section (with rollout and env)")
    if not recipe.model.checkpoint:
        raise UserError("train rl: model.checkpoint must name the HF checkpoint the policy starts from")
    refuse_unhonoured(recipe, "train rl", UNHONOURED)


def check_replay(recipe: Recipe, source: Path) -> None:
    recorded = ReplayQueue(source)
    refuse_resume_changes(load_recipe(source / "recipe.yaml"), recipe, REPLAY_FIXED, str(source / "recipe.yaml"),
                          "the recorded groups", flag="--replay")
    if recipe.train.steps > len(recorded.steps):
        raise UserError(f"--replay {source}: train.steps={recipe.train.steps} but the run recorded {len(recorded.steps)} learner steps")


def start_learner(recipe: Recipe, files: RLRunFiles, log: Path) -> subprocess.Popen:
    """The learner ranks, in the background (the rollouts run meanwhile), in this process group."""
    cmd = torchrun_command(recipe.cluster.procs_per_host, learner_main.MODULE, [str(files.root)])
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=rank_environment())


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()  # torchrun forwards it to the ranks
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_rollouts(recipe: Recipe, files: RLRunFiles, learner: subprocess.Popen, console: Console) -> None:
    """Engines on every rollout host make groups until the learner is done."""
    with contextlib.ExitStack() as stack:
        hosts = open_hosts(recipe, files)
        for host in hosts:
            stack.callback(host.close)
        # The policy's tokenizer, here, for the agent loop (engines on other hosts read their own copy).
        tokenizer_dir = LocalHost(recipe, files).pull(files.policy().store_version)
        queue = RolloutQueue(files, StalenessRule.of(recipe.rl))
        worker = RolloutWorker(
            recipe.rollout, recipe.env, recipe.rl.group_size, recipe.train.seed,
            routed_experts=recipe.model.is_moe and recipe.rl.router_replay == "r3",
            hosts=hosts, tokenizer_dir=tokenizer_dir, queue=queue, files=files,
            on_group=lambda gid, s: console.print(
                f"[dim]{gid}[/] engine {s['engine']} ({s['host']})  policy v{s['policy_version']}  reward {s['reward_mean']:.3f}  {s['generated_tokens_per_s']:.0f} tok/s"),
            evaluation=recipe.rl.eval, steps=recipe.train.steps,
            on_eval=lambda version, record: console.print(f"[bold]{escape(summary_line(version, record))}[/]", highlight=False))
        stack.callback(worker.close)
        worker.run(should_stop=lambda: learner.poll() is not None)
        if learner.wait() == 0:
            worker.final_evaluation()


def run_rl(recipe: Recipe, resume: bool, console: Console, replay: Path | None = None) -> Path:
    check_rl_recipe(recipe)
    run = RunDir.of(recipe)
    files = RLRunFiles(run.root)
    if resume and run.recipe_path.is_file():
        refuse_resume_changes(load_recipe(run.recipe_path), recipe, RESUME_FIXED, str(run.recipe_path),
                              "the run's trajectories and checkpoints")
        recorded = files.replay_source()
        if replay is not None and recorded != replay.resolve():
            raise UserError(f"--resume --replay {replay}: the run replays {recorded or 'nothing (it has rollouts)'}")
        replay = recorded
    if replay is not None:
        replay = replay.resolve()
        check_replay(recipe, replay)
    run.prepare(recipe_to_yaml(recipe), resume)
    if replay is not None:
        files.record_replay_source(replay)
    with Heartbeat(files.heartbeat):
        if files.policy() is None:
            console.print(f"publishing the initial policy from {recipe.model.checkpoint}")
            info = push_version(recipe.model.checkpoint, sync_section(recipe, files), recipe.cluster.ssh, cache_dir=files.root / "sync-cache")
            files.publish_policy(Policy(0, info.id))
        clear_rank_errors(run)
        learner = start_learner(recipe, files, run.logs / "torchrun.log")
        try:
            if replay is None:
                run_rollouts(recipe, files, learner, console)
            learner.wait()
        finally:
            stop(learner)
    if learner.returncode != 0:
        raise UserError(first_rank_error(run) or f"the learner exited with code {learner.returncode}; logs in {run.logs}/")
    return run.root
