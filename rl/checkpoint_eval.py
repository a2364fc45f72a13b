"""`composer eval`: a checkpoint on task sets of a recipe, outside any RL run, optionally against another one.

A checkpoint is an HF directory, a run directory (a mid-training run's export, an RL run's newest policy) or a
version of a sync store (`STORE@vNNNNNNNN`). It is evaluated through what RL uses (rl.evaluation): the recipe's
engines (`rollout.engine`), agent loop, harness, sandbox fleet and graders, on the same tasks an RL run of the recipe
evaluates (a trained set's held-out split, a set not trained on whole; here also a trained set that holds nothing
out, on its tasks in use). Everything goes into one output directory:

    eval.json          what the results depend on (checkpoints, tasks, sampling, harness); a rerun must match it
    checkpoint.jsonl   graded episodes of the checkpoint, appended per batch: a killed eval resumes from them
    compare.jsonl      the same for --compare
    results.json       per set: greedy pass@1 with its 95% interval, pass@k, per kind, flags, infra failures,
                       self-summarization; per task; with --compare the paired differences and tasks gained/lost
    report.html        the same, one self-contained page
    logs/eval.log      what vLLM and the libraries printed
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from composer.cluster.placement import HostPlacement, local_devices, place_host
from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe, recipe_to_yaml
from composer.recipes.schema import Recipe, RLEvalSection
from composer.rl.evaluation import (
    EVAL_BATCH_TASKS,
    EvalSet,
    GradedEpisode,
    GradedLog,
    bootstrap_interval,
    held_out_sets,
    per_task_results,
    run_episodes,
    set_episodes,
    set_record,
    task_kind,
)
from composer.rl.protocol import RLRunFiles, sync_section
from composer.rollout.agent.environment import CodingEnvironment
from composer.rollout.agent.harness import Tokenizer
from composer.rollout.agent.loop import EpisodeRunner
from composer.rollout.engines.vllm_engine import build_engines, with_resolved_dtype
from composer.runtime.processes import output_to_log
from composer.runtime.progress import StepClock
from composer.runtime.run_dir import RunDir, atomic_write_text
from composer.sync.receiver import pull
from composer.sync.store import Store

STORE_VERSION = re.compile(r"^(?P<store>.+)@(?P<version>v\d{8})$")
ROLES = ("checkpoint", "compare")


@dataclass(frozen=True)
class CheckpointRef:
    """Where a checkpoint's weights are: an HF directory, or a version of a sync store (pulled before use)."""

    spec: str
    """As the user wrote it."""
    directory: Path | None = None
    store: str | None = None
    version: str | None = None

    def identity(self) -> dict:
        """What the evaluation's results depend on (an HF directory: its files' sizes and times, so a rewritten
        checkpoint is not taken for the one evaluated)."""
        if self.directory is None:
            return {"store": self.store, "version": self.version}
        files = sorted(p for p in self.directory.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
        return {"directory": str(self.directory), "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}}

    @property
    def label(self) -> str:
        if self.directory is not None:
            return self.directory.name
        return f"{Path(self.store.rstrip('/')).name}-{self.version}"

    def weights(self, recipe: Recipe, receiver: Path) -> Path:
        """An HF directory holding the checkpoint (a store version is pulled into `receiver`)."""
        if self.directory is not None:
            return self.directory
        with _open_store(self.store, recipe) as store:
            pull(store, receiver, self.version)
        return (receiver / "current").resolve()


def _open_store(location: str, recipe: Recipe) -> Store:
    return Store.open(location, recipe.cluster.ssh, endpoint=recipe.sync.endpoint if recipe.sync else None)


def resolve_checkpoint(spec: str, recipe: Recipe) -> CheckpointRef:
    """The checkpoint `spec` names, checked to exist (one clear error otherwise)."""
    if match := STORE_VERSION.match(spec):
        return _store_version(spec, match["store"], match["version"], recipe)
    path = Path(spec)
    if not path.exists():
        raise UserError(f"checkpoint {spec}: no such file or directory (an HF checkpoint directory, a run directory or STORE@vNNNNNNNN)")
    if (path / "config.json").is_file():
        return CheckpointRef(spec, directory=path.resolve())
    if (path / "recipe.yaml").is_file():
        if (path / "export" / "config.json").is_file():
            return CheckpointRef(spec, directory=(path / "export").resolve())
        files = RLRunFiles(path.resolve())
        policy = files.policy()
        if policy is None:
            raise UserError(f"checkpoint {spec}: a run directory with neither an export nor a published policy yet")
        run_recipe = load_recipe(path / "recipe.yaml")
        return _store_version(spec, sync_section(run_recipe, files).store, policy.store_version, recipe)
    raise UserError(f"checkpoint {spec}: not an HF checkpoint (no config.json), a run directory (no recipe.yaml) or STORE@vNNNNNNNN")


def _store_version(spec: str, location: str, version: str, recipe: Recipe) -> CheckpointRef:
    try:
        store = _open_store(location, recipe)
    except UserError as e:
        raise UserError(f"checkpoint {spec}: {e}") from None
    with store:
        if version not in store.versions():
            newest = store.head()
            raise UserError(
                f"checkpoint {spec}: store {location} has no version {version} ({f'its newest is {newest}' if newest else 'it holds none'})"
            )
    return CheckpointRef(spec, store=location, version=version)


# --- what an evaluation depends on -------------------------------------------------------------


ROLLOUT_RESULT_KEYS = (
    "sampling",
    "max_context",
    "max_turns",
    "max_observation_tokens",
    "harness",
    "summarize_at",
    "max_summaries",
    "compaction",
    "dtype",
    "chat_template",
)
"""The rollout settings episodes depend on (not where or on how many engines they run)."""


def eval_config(recipe: Recipe, task_sets: list[str]) -> RLEvalSection:
    """The recipe's `rl.eval` (or its defaults) on `task_sets` (default: rl.eval's, else every set of env.tasks),
    each of which the recipe must have."""
    known = list(dict.fromkeys([t.name for t in recipe.env.tasks] + (recipe.rl.eval.tasks if recipe.rl and recipe.rl.eval else [])))
    base = recipe.rl.eval if recipe.rl and recipe.rl.eval else None
    names = task_sets or (base.tasks if base else [t.name for t in recipe.env.tasks])
    for name in names:
        if name not in known:
            raise UserError(f"--tasks {name}: the recipe has no task set {name!r} (its sets: {', '.join(known)})")
    return (base or RLEvalSection(tasks=names)).model_copy(update={"tasks": names})


def settings(recipe: Recipe, config: RLEvalSection, refs: dict[str, CheckpointRef], batch_tasks: int) -> dict:
    rollout = recipe.rollout.model_dump(mode="json")
    env = recipe.env.model_dump(mode="json", include={"tasks", "reward", "guards"})
    return {
        **{role: {"spec": ref.spec, **ref.identity()} for role, ref in refs.items()},
        "eval": config.model_dump(mode="json", include={"tasks", "limit", "samples", "pass_k"}),
        "rollout": {key: rollout[key] for key in ROLLOUT_RESULT_KEYS if key in rollout},
        "env": env,
        "seed": recipe.train.seed,
        "batch_tasks": batch_tasks,
    }


def _check_same_settings(out: Path, wanted: dict) -> None:
    """A rerun continues an evaluation only with what its results depend on unchanged (one that graded nothing yet
    is simply started again)."""
    path = out / "eval.json"
    graded = any((out / f"{role}.jsonl").is_file() and (out / f"{role}.jsonl").stat().st_size for role in ROLES)
    if not path.is_file() or not graded:
        atomic_write_text(path, json.dumps(wanted, indent=1) + "\n")
        return
    held = json.loads(path.read_text())
    for key in sorted(set(held) | set(wanted)):
        if held.get(key) != wanted.get(key):
            raise UserError(f"{out} holds an evaluation with other {key} settings ({path}); pass another --out to start a new one")


def _tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="np") as f:
            shapes |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    return shapes


def eval_placement(recipe: Recipe) -> HostPlacement:
    """This machine's devices for the engines (no learner runs beside an evaluation); refused when they do not fit."""
    alone = recipe.rollout.model_copy(update={"share_learner_devices": True})
    return place_host("localhost", local_devices(), recipe.model_copy(update={"rollout": alone}))


def _same_architecture(a: Path, b: Path) -> None:
    """--compare reloads the engine with the other checkpoint's weights: both must hold the same tensors."""
    shapes = [_tensor_shapes(p) for p in (a, b)]
    different = sorted(k for k in set(shapes[0]) | set(shapes[1]) if shapes[0].get(k) != shapes[1].get(k))
    if different:
        raise UserError(
            f"--compare: the checkpoints' tensors differ ({', '.join(different[:3])}{', ...' if len(different) > 3 else ''}); "
            "evaluate each on its own with composer eval"
        )


# --- progress ----------------------------------------------------------------------------------


class EvalProgress:
    """A bar with the episodes done and the time left on a terminal; elsewhere a plain line now and then."""

    def __init__(self, console: Console):
        self.console = console
        self._bar: Progress | None = None
        self._task = None
        self._clock: StepClock | None = None
        self.label = ""

    def note(self, text: str) -> None:
        self.console.print(f"eval: {text}", highlight=False)

    def start(self, label: str, done: int, total: int) -> None:
        self.stop()
        self._clock = StepClock(total, done)
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("episodes"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task(label, total=total, completed=done)
            self._bar.start()
        self.label = label

    def advance(self, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
        elif self._clock.plain_due(done):
            self.console.print(f"eval {self.label}: {done}/{total} episodes  eta {self._clock.eta_text(done)}", highlight=False)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


# --- the evaluation ----------------------------------------------------------------------------


@dataclass
class EvalOutcome:
    out: Path
    results: dict
    seconds: float


def default_out(recipe: Recipe, refs: dict[str, CheckpointRef]) -> Path:
    name = "-vs-".join(ref.label for ref in refs.values())
    return Path(recipe.run.dir) / "eval" / re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def check_eval_recipe(recipe: Recipe) -> None:
    if recipe.rollout is None or recipe.env is None:
        raise UserError("eval: the recipe has no rollout and env sections (an RL recipe's): they say how episodes run")
    if recipe.rollout.hosts != ["localhost"]:
        raise UserError(
            f"eval: rollout.hosts {recipe.rollout.hosts}: composer eval runs its engines on this host "
            "(the sandbox fleet may span hosts); set rollout.hosts: [localhost]"
        )


def evaluate(
    recipe: Recipe, checkpoint: str, compare: str | None, task_sets: list[str], out: Path | None, batch_tasks: int = EVAL_BATCH_TASKS
) -> EvalOutcome:
    """Evaluate `checkpoint` (and `compare`) on the recipe's task sets; results in the output directory."""
    check_eval_recipe(recipe)
    recipe = recipe.model_copy(update={"rollout": with_resolved_dtype(recipe.rollout)})  # results say which dtype ran
    config = eval_config(recipe, task_sets)
    refs = {"checkpoint": resolve_checkpoint(checkpoint, recipe)}
    if compare is not None:
        refs["compare"] = resolve_checkpoint(compare, recipe)
    out = (out or default_out(recipe, refs)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    RunDir(out).hold()
    _check_same_settings(out, settings(recipe, config, refs, batch_tasks))
    atomic_write_text(out / "eval-recipe.yaml", recipe_to_yaml(recipe))
    started = time.monotonic()
    with output_to_log(out / "logs" / "eval.log") as terminal:
        view = EvalProgress(Console(file=terminal, soft_wrap=True))
        try:
            results = _evaluate(recipe, config, refs, out, batch_tasks, view)
        finally:
            view.stop()
    atomic_write_text(out / "results.json", json.dumps(results, indent=1) + "\n")
    from composer.runtime.report import write_eval_report  # matplotlib: not imported before the inputs are checked

    write_eval_report(out / "report.html", results)
    return EvalOutcome(out, results, time.monotonic() - started)


def _evaluate(
    recipe: Recipe, config: RLEvalSection, refs: dict[str, CheckpointRef], out: Path, batch_tasks: int, view: EvalProgress
) -> dict:
    env = CodingEnvironment(recipe.env, seed=recipe.train.seed, sandbox_root=out / "sandbox", ssh=recipe.cluster.ssh)
    logs = {role: GradedLog(out / f"{role}.jsonl") for role in refs}
    try:
        sets = held_out_sets(config, env.pool.task_sets, env, recipe.train.seed, allow_training_tasks=True)
        total = sum(len(s.tasks) for s in sets) * (1 + config.samples)
        todo = {role: total - len(logs[role].episodes) for role in refs}
        if any(todo.values()):
            _run_checkpoints(recipe, config, refs, env, sets, logs, out, batch_tasks, view, total)
        else:
            view.note(f"every episode already graded in {out}")
        return results_of(refs, config, sets, logs)
    finally:
        for log in logs.values():
            log.close()
        env.close()


def _run_checkpoints(
    recipe: Recipe,
    config: RLEvalSection,
    refs: dict[str, CheckpointRef],
    env: CodingEnvironment,
    sets: list[EvalSet],
    logs: dict[str, GradedLog],
    out: Path,
    batch_tasks: int,
    view: EvalProgress,
    total: int,
) -> None:
    weights = {}
    for role, ref in refs.items():
        view.note(f"{role} {ref.spec}" + ("" if ref.directory else f": pulling {ref.version} from {ref.store}"))
        weights[role] = ref.weights(recipe, out / "weights" / role)
    if "compare" in weights:
        _same_architecture(weights["checkpoint"], weights["compare"])
    engines, servers = [], []
    try:
        for role in refs:
            log = logs[role]
            if len(log.episodes) == total:
                continue
            if not engines:
                view.note(f"starting {recipe.rollout.engine} engine(s) with {weights[role]}")
                engines, servers = build_engines(
                    recipe.rollout,
                    str(weights[role]),
                    eval_placement(recipe),
                    seed=recipe.train.seed,
                    routed_experts=False,
                    log_dir=out / "logs",
                )
            else:
                for engine in engines:
                    engine.load_weights(weights[role])
            # A tokenizer each: HF fast tokenizers are not safe to share between threads.
            runners = [
                EpisodeRunner(engine, Tokenizer(str(weights[role]), recipe.model.trust_remote_code), env, recipe.rollout)
                for engine in engines
            ]
            if log.episodes:
                view.note(f"{role}: {len(log.episodes)} of {total} episodes already graded; running the rest")
            view.start(role, len(log.episodes), total)
            run_episodes(runners, sets, config.samples, log, 0, role, batch_tasks, on_batch=view.advance)
            view.stop()
    finally:
        for server in servers:
            server.stop()


# --- results -----------------------------------------------------------------------------------


def _interval(values: list[float]) -> list[float]:
    return list(bootstrap_interval(np.array(values, dtype=float)))


def set_summary(s: EvalSet, greedy: list[GradedEpisode], sampled: list[list[GradedEpisode]], pass_k: list[int]) -> dict:
    """One set's figures for one checkpoint: the RL run's `eval_*` record and the tables `composer eval` shows."""
    episodes = greedy + [e for group in sampled for e in group]
    kinds: dict[str, list[GradedEpisode]] = {}
    for g in greedy:
        kinds.setdefault(task_kind(g.task), []).append(g)
    counted = [g for g in greedy if not g.infra_failure]
    summary = {
        "tasks": len(s.tasks),
        "skipped": s.skipped,
        "record": set_record(s.name, greedy, sampled, pass_k) if greedy else {},
        "kinds": {k: _kind_summary(v) for k, v in sorted(kinds.items())},
        "episodes": len(episodes),
        "infra_failures": sum(e.infra_failure for e in episodes),
        "greedy_pass@1_without_infra_failures": float(np.mean([g.passed for g in counted])) if counted else None,
        "flagged_episodes": sum(bool(e.flags) for e in episodes),
        "flags": dict(sorted(Counter(f for e in episodes for f in e.flags).items())),
        "end_reasons": dict(sorted(Counter(g.end_reason for g in greedy).items())),
    }
    compactions = [x for g in greedy for x in g.compaction_errors]
    lengths = [n for g in greedy for n in g.summary_tokens]
    summary["summaries_per_episode"] = float(np.mean([g.summaries for g in greedy])) if greedy else 0.0
    if greedy and any(g.tokens for g in greedy):  # logs graded before episodes recorded their tokens have none
        summary["tokens_per_episode"] = float(np.mean([g.tokens for g in greedy]))
    if lengths:
        summary["summary_tokens_mean"] = float(np.mean(lengths))
    if compactions:
        summary["compactions"] = len(compactions)
        summary["compaction_error"] = float(np.mean(compactions))
        summary["compaction_error_interval"] = _interval(compactions)
    return summary


def _kind_summary(greedy: list[GradedEpisode]) -> dict:
    """Greedy pass@1 of one kind of task, and (tools harness) whether the policy speaks the harness's format: the share
    of its tool calls that parse (None when it wrote none), the share of episodes in which it ran the tests and the
    share in which it called finish."""
    solved = [g.passed for g in greedy]
    calls = sum(g.tool_calls for g in greedy)
    return {
        "tasks": len(greedy),
        "greedy_pass@1": float(np.mean(solved)),
        "interval": _interval(solved),
        "tool_calls": calls,
        "tool_calls_parsed": (calls - sum(g.malformed_calls for g in greedy)) / calls if calls else None,
        "tests_run": float(np.mean([g.tests_run > 0 for g in greedy])),
        "finish_called": float(np.mean([g.end_reason == "finished" for g in greedy])),
    }


def difference(a: dict[str, dict], b: dict[str, dict]) -> dict:
    """`a` - `b` per task (the same tasks): greedy and sampled pass@1 with paired bootstrap intervals, tasks gained
    (passed by a, not b) and lost."""
    tasks = sorted(set(a) & set(b))
    greedy = np.array([float(a[t]["greedy"]) - float(b[t]["greedy"]) for t in tasks])
    result = {
        "tasks": len(tasks),
        "greedy_pass@1": float(greedy.mean()) if tasks else 0.0,
        "greedy_pass@1_interval": _interval(greedy.tolist()),
        "gained": [t for t in tasks if a[t]["greedy"] and not b[t]["greedy"]],
        "lost": [t for t in tasks if b[t]["greedy"] and not a[t]["greedy"]],
    }
    if tasks and a[tasks[0]]["samples"]:
        sampled = np.array([a[t]["correct"] / a[t]["samples"] - b[t]["correct"] / b[t]["samples"] for t in tasks])
        result["sampled_pass@1"] = float(sampled.mean())
        result["sampled_pass@1_interval"] = _interval(sampled.tolist())
    return result


def results_of(refs: dict[str, CheckpointRef], config: RLEvalSection, sets: list[EvalSet], logs: dict[str, GradedLog]) -> dict:
    results: dict = {
        "checkpoints": {role: ref.spec for role, ref in refs.items()},
        "samples": config.samples,
        "pass_k": config.pass_k,
        "sets": {},
        "tasks": {role: {} for role in refs},
    }
    for s in sets:
        entry = {}
        for role in refs:
            greedy, sampled = set_episodes(s, logs[role], config.samples)
            entry[role] = set_summary(s, greedy, sampled, config.pass_k)
            results["tasks"][role].update(per_task_results(greedy, sampled, config.samples))
        if "compare" in refs:
            ids = {t.id for t in s.tasks}
            entry["difference"] = difference(
                {t: r for t, r in results["tasks"]["checkpoint"].items() if t in ids},
                {t: r for t, r in results["tasks"]["compare"].items() if t in ids},
            )
        results["sets"][s.name] = entry
    return results
