"""`composer train rl`: beat, publish the starting policy, start the learner (torchrun), run rollouts here until
the learner's last step; with `--replay RUN`, the learner trains on RUN's recorded groups and no engine starts."""

from __future__ import annotations

import contextlib
import shutil
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from composer.cluster.launch import Job, Launcher, run_to_end
from composer.cluster.launchers import build_launcher
from composer.cluster.placement import local_devices, place_host, planned_devices
from composer.recipes.checks import refuse_resume_changes, refuse_unhonoured
from composer.recipes.errors import RunFailed, UserError
from composer.recipes.loader import load_recipe, recipe_to_yaml
from composer.recipes.schema import ARCHITECTURE_FIELDS, LAYOUT_KEYS, Recipe
from composer.rl import learner_main
from composer.rl.console import RLConsole
from composer.rl.evaluation import summary_line
from composer.rl.protocol import (
    POLL_SECONDS,
    Heartbeat,
    Policy,
    ReplayQueue,
    RLRunFiles,
    RolloutQueue,
    StalenessRule,
    sync_section,
)
from composer.rl.rollout_hosts import LocalHost, open_hosts, plan_fleet
from composer.rl.rollout_worker import RolloutWorker
from composer.rollout.agent.harness import check_tokenizer_code
from composer.rollout.engines.vllm_engine import check_local_serving_format, with_resolved_dtype
from composer.runtime.processes import output_to_log
from composer.runtime.run_dir import RunDir
from composer.sync.pusher import push_version
from composer.trainer.kernels import check_kernels_installed
from composer.trainer.weights import check_checkpoint_before_launch

UNHONOURED = {
    "parallelism.pp": "the RL learner's step does not run the pipeline schedule (trainer.pipeline) yet",
    "data": "RL trains on rollouts, not on a corpus",
    "train.eval_every": "RL evaluates on held-out tasks every rl.eval.every steps",
    "train.eval_batches": "RL evaluates every held-out task of rl.eval",
    "train.log_every": "the learner records every step",
}

ARCHITECTURE = [f"model.{key}" for key in ARCHITECTURE_FIELDS]
RESUME_FIXED = [
    "train.seed",
    "train.global_batch_size",
    "env.tasks",
    "env.reward",
    "env.guards",
    "env.canaries",
    "rl.group_size",
    "rl.prompts_per_step",
    "rollout.sampling.temperature",
    "optim.name",
    *(f"parallelism.{key}" for key in LAYOUT_KEYS),
    *ARCHITECTURE,
]
"""What the tasks of group n, the rewards already stored and the learner's checkpoints (model and optimizer state)
depend on (stored groups were sampled at the temperature the learner scores them at)."""
REPLAY_FIXED = ["rl.group_size", "rl.prompts_per_step", "rollout.sampling.temperature", *ARCHITECTURE]
"""What must match the recorded run for its groups to be trained again (the learner's settings may change; the
sampling temperature is the one its groups were sampled at)."""


def check_rl_recipe(recipe: Recipe) -> None:
    if recipe.rl is None:
        raise UserError("train rl: the recipe has no rl section (with rollout and env)")
    if not recipe.model.checkpoint:
        raise UserError("train rl: model.checkpoint must name the HF checkpoint the policy starts from")
    refuse_unhonoured(recipe, "train rl", UNHONOURED)
    check_kernels_installed(recipe.model.kernels)
    check_checkpoint_before_launch(recipe.model)
    plan_fleet(recipe)  # engines that cannot fit their hosts stop the run here, before anything starts
    if Path(recipe.model.checkpoint).is_dir():
        check_tokenizer_code(recipe.model.checkpoint, recipe.model.trust_remote_code)  # the agent loop's tokenizer


def check_replay(recipe: Recipe, source: Path) -> None:
    recorded = ReplayQueue(source)
    refuse_resume_changes(
        load_recipe(source / "recipe.yaml"), recipe, REPLAY_FIXED, str(source / "recipe.yaml"), "the recorded groups", flag="--replay"
    )
    if recipe.train.steps > len(recorded.steps):
        raise UserError(f"--replay {source}: train.steps={recipe.train.steps} but the run recorded {len(recorded.steps)} learner steps")


def learner_launch(recipe: Recipe) -> tuple[Launcher, str, list[str]]:
    """How the learner ranks start on the recipe's training hosts (cluster.launcher), kept off the engines' devices
    where a host runs both (cluster.placement)."""
    cluster = recipe.cluster
    binding = learner_placement_env(recipe)
    if binding:
        cluster = cluster.model_copy(update={"env": {**binding, **cluster.env}})
    return build_launcher(cluster), learner_main.MODULE, [str(RunDir.of(recipe).root)]


def learner_placement_env(recipe: Recipe) -> dict[str, str]:
    """The learner ranks' core binding on a CPU host that runs engines too (the same on every training host: the
    learner takes each host's first devices); checks that host's engines fit, before anything starts."""
    for host in recipe.rollout.hosts:
        if host in recipe.cluster.hosts:
            devices = planned_devices(recipe.rollout, host, local_devices() if host == LocalHost.name else None)
            if devices is None:
                raise UserError(
                    f"rollout host {host} runs learner ranks too: declare its devices (rollout.devices) so they can "
                    "be planned before the learner starts, or keep training hosts out of rollout.hosts"
                )
            return place_host(host, devices, recipe).learner_env()
    return {}


def start_learner(recipe: Recipe, files: RLRunFiles) -> Job:
    """The learner ranks, in the background (the rollouts run meanwhile); their output goes to the run's logs."""
    launcher, module, args = learner_launch(recipe)
    return launcher.start(module, args, RunDir(files.root))


@contextlib.contextmanager
def crash_explained(log: Path) -> Iterator[None]:
    """A crash of the driver (a bug, an engine that died) keeps its traceback in `log` and ends in a short message."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        traceback.print_exc()  # into the log: stderr is redirected there
        raise RunFailed(f"the driver failed: {type(e).__name__}: {e}\ntraceback in {log}") from e


def run_rollouts(recipe: Recipe, files: RLRunFiles, learner: Job, view: RLConsole) -> None:
    """Engines on every rollout host make groups until the learner is done."""
    with contextlib.ExitStack() as stack:
        hosts = open_hosts(recipe, files)
        for host in hosts:
            stack.callback(host.close)
        # The policy's tokenizer, here, for the agent loop (engines on other hosts read their own copy).
        tokenizer_dir = LocalHost(recipe, files).pull(files.policy().store_version)
        queue = RolloutQueue(files, StalenessRule.of(recipe.rl))
        view.note(f"starting {recipe.rollout.engine} engines")
        worker = RolloutWorker(
            recipe.rollout,
            recipe.env,
            recipe.rl.group_size,
            recipe.train.seed,
            routed_experts=recipe.model.is_moe and recipe.rl.router_replay == "r3",
            hosts=hosts,
            tokenizer_dir=tokenizer_dir,
            queue=queue,
            files=files,
            on_group=view.group,
            evaluation=recipe.rl.eval,
            steps=recipe.train.steps,
            on_eval=lambda version, record: view.evaluation(summary_line(version, record)),
            ssh=recipe.cluster.ssh,
            trust_remote_code=recipe.model.trust_remote_code,
        )
        stack.callback(worker.close)
        view.note(f"rolling out on {len(worker.slots)} engine(s)")

        def learner_done() -> bool:
            view.poll()
            return learner.poll() is not None

        worker.run(should_stop=learner_done)
        if learner.wait() == 0:
            worker.final_evaluation()


def run_rl(recipe: Recipe, resume: bool, replay: Path | None = None, verbose: bool = False) -> Path:
    """The run. The terminal shows its live view (group lines too when `verbose`); what the libraries and the
    embedded engine print goes to logs/driver.log."""
    check_rl_recipe(recipe)
    # The learner ships its policies in the engines' dtype: decided here, once, and kept in the run's recipe.
    recipe = recipe.model_copy(update={"rollout": with_resolved_dtype(recipe.rollout)})
    learner_launch(recipe)[0].check_startable()
    run = RunDir.of(recipe)
    files = RLRunFiles(run.root)
    if resume and run.recipe_path.is_file():
        refuse_resume_changes(
            load_recipe(run.recipe_path), recipe, RESUME_FIXED, str(run.recipe_path), "the run's trajectories and checkpoints"
        )
        recorded = files.replay_source()
        if replay is not None and recorded != replay.resolve():
            raise UserError(f"--resume --replay {replay}: the run replays {recorded or 'nothing (it has rollouts)'}")
        replay = recorded
    if replay is not None:
        replay = replay.resolve()
        check_replay(recipe, replay)
    else:
        check_local_serving_format(recipe.rollout)
    run.prepare(recipe_to_yaml(recipe), resume)
    if replay is not None:
        files.record_replay_source(replay)
    log = run.logs / "driver.log"
    with run.failures_recorded(), output_to_log(log) as terminal, Heartbeat(files.heartbeat):
        view = RLConsole(Console(file=terminal, soft_wrap=True), recipe.run.name, recipe.train.steps, run.metrics_path, verbose)
        with view, crash_explained(log):
            drive(recipe, files, run, view, replay)
    return run.root


def starting_policy(recipe: Recipe, files: RLRunFiles) -> Path:
    """model.checkpoint when it is stored in the engines' format (a dense one for dense engines, which cast it),
    else the checkpoint rewritten in that format, as the learner will export every later policy."""
    import torch

    from composer.trainer.hf_checkpoint import CheckpointLayout
    from composer.trainer.weights import convert_hf

    stored = CheckpointLayout.of(recipe.model.checkpoint).quantization
    rollout = recipe.rollout
    if (stored.method if stored else None) == rollout.quantize:
        return Path(recipe.model.checkpoint)
    out = files.export / "policy-000000"
    shutil.rmtree(out, ignore_errors=True)
    return convert_hf(recipe.model, out, quantize=rollout.quantize, dtype=None if rollout.quantize else getattr(torch, rollout.dtype))


def drive(recipe: Recipe, files: RLRunFiles, run: RunDir, view: RLConsole, replay: Path | None) -> None:
    if files.policy() is None:
        view.note(f"publishing the initial policy from {recipe.model.checkpoint}")
        info = push_version(
            starting_policy(recipe, files), sync_section(recipe, files), recipe.cluster.ssh, cache_dir=files.root / "sync-cache"
        )
        files.publish_policy(Policy(0, info.id))
    view.note("starting the learner")
    learner = start_learner(recipe, files)
    try:
        if replay is None:
            run_rollouts(recipe, files, learner, view)
        else:
            view.note(f"replaying {replay}")
        while learner.poll() is None:
            view.poll()
            time.sleep(POLL_SECONDS)
    finally:
        learner.terminate()  # torchrun forwards it to the ranks, on every host
    run_to_end(learner)
