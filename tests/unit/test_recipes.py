"""The recipe schema, `extends`, `--set` and the cross-field checks: what a user typing YAML relies on."""

import textwrap

import pytest
import yaml

from composer.recipes.checks import refuse_unhonoured
from composer.recipes.errors import UserError
from composer.recipes.loader import RecipeError, load_recipe, recipe_to_yaml
from tests.conftest import RECIPES

SHIPPED = sorted(RECIPES.glob("*.yaml"))

MINIMAL = textwrap.dedent(
    """
    run: {name: t}
    model:
      num_layers: 2
      hidden_size: 64
      num_attention_heads: 4
      num_kv_heads: 2
      head_dim: 32
      num_experts: 4
      moe_top_k: 2
      moe_ffn_hidden_size: 64
      vocab_size: 1000
      max_position_embeddings: 256
    cluster: {procs_per_host: 2}
    optim: {lr: 0.001}
    train: {steps: 10, micro_batch_size: 2, global_batch_size: 4}
    """
)


def problems_of(path, overrides=()):
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return {p.path: p.message for p in info.value.problems}


def test_there_are_smoke_and_real_scale_recipes():
    names = {p.stem for p in SHIPPED}
    assert {"smoke-midtrain", "smoke-rl", "qwen3-30b-a3b-midtrain", "kimi-k2-rl"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipes_validate(path):
    recipe = load_recipe(path)
    assert recipe.run.name == path.stem


def test_real_scale_shapes():
    qwen = load_recipe(RECIPES / "qwen3-30b-a3b-midtrain.yaml")
    assert (len(qwen.cluster.hosts), qwen.cluster.procs_per_host, qwen.model.num_experts, qwen.model.moe_top_k) == (2, 8, 128, 8)
    kimi = load_recipe(RECIPES / "kimi-k2-rl.yaml")
    assert (kimi.model.num_experts, kimi.model.moe_top_k, kimi.model.num_layers) == (384, 8, 61)
    assert kimi.cluster.world_size == 256 and kimi.rl.router_replay == "r3"


def test_minimal_recipe_fills_defaults(write_recipe):
    recipe = load_recipe(write_recipe(MINIMAL))
    assert recipe.parallelism.tp == 1 and recipe.optim.schedule == "cosine" and recipe.cluster.hosts == ["localhost"]


def test_unknown_key_names_path_and_suggests(write_recipe):
    path = write_recipe(MINIMAL.replace("optim: {lr: 0.001}", "optim: {lr: 0.001, warmup_step: 3}"))
    assert problems_of(path) == {"optim.warmup_step": "unknown key; did you mean 'warmup_steps'?"}


def test_unknown_top_level_section_suggests(write_recipe):
    path = write_recipe(MINIMAL + "trian: {steps: 3}\n")
    assert problems_of(path)["trian"] == "unknown key; did you mean 'train'?"


def test_unknown_key_inside_list_item(write_recipe):
    path = write_recipe(MINIMAL + "data:\n  seq_length: 128\n  sources:\n    - {name: a, paths: [x], wieght: 2}\n")
    assert problems_of(path) == {"data.sources[0].wieght": "unknown key; did you mean 'weight'?"}


def test_wrong_type_names_path(write_recipe):
    path = write_recipe(MINIMAL.replace("steps: 10", "steps: ten"))
    problems = problems_of(path)
    assert list(problems) == ["train.steps"] and "integer" in problems["train.steps"]


@pytest.mark.parametrize(
    "edit, path",
    [
        (("steps: 10", "steps: true"), "train.steps"),
        (("lr: 0.001", "lr: false"), "optim.lr"),
        (("lr: 0.001", "lr: 0.001, min_lr: true"), "optim.min_lr"),
        (("cluster: {procs_per_host: 2}", "cluster: {procs_per_host: 2}\nparallelism: {dp: true}"), "parallelism.dp"),
        (("train: {", "data: {sources: [{name: c, paths: [x]}], seq_length: 8, split: [true, 2, 0]}\ntrain: {"), "data.split"),
    ],
)
def test_booleans_are_not_numbers(write_recipe, edit, path):
    """pydantic alone takes `true` as 1 for a number; a recipe that says so has a slip in it."""
    problems = problems_of(write_recipe(MINIMAL.replace(*edit)))
    assert list(problems) == [path] and "not a boolean" in problems[path]


def test_booleans_stay_booleans_and_overrides_are_checked_too(write_recipe):
    path = write_recipe(MINIMAL)
    assert load_recipe(path, ["parallelism.distributed_optimizer=true"]).parallelism.distributed_optimizer is True
    assert "not a boolean" in problems_of(path, ["train.steps=true"])["train.steps"]


def test_out_of_range_and_bad_choice(write_recipe):
    path = write_recipe(MINIMAL.replace("lr: 0.001", "lr: -1, schedule: linear"))
    problems = problems_of(path)
    assert "greater than 0" in problems["optim.lr"]
    assert "'cosine', 'wsd' or 'constant'" in problems["optim.schedule"]


def test_missing_required_section(write_recipe):
    path = write_recipe(MINIMAL.replace("optim: {lr: 0.001}\n", ""))
    assert problems_of(path) == {"optim": "required, but missing"}


def test_all_problems_reported_at_once(write_recipe):
    path = write_recipe(MINIMAL.replace("steps: 10", "steps: 0").replace("lr: 0.001", "lr: 0.001, bogus: 1"))
    assert set(problems_of(path)) == {"train.steps", "optim.bogus"}


def test_duplicate_yaml_key_is_an_error(write_recipe):
    path = write_recipe(MINIMAL + "optim: {lr: 0.5}\n")
    with pytest.raises(UserError, match="duplicate key 'optim'"):
        load_recipe(path)


def test_invalid_yaml_points_at_line(write_recipe):
    path = write_recipe("run: {name: t\nmodel: [\n")
    with pytest.raises(UserError, match=r"recipe.yaml:\d+:\d+: invalid YAML"):
        load_recipe(path)


def test_a_recipe_that_is_not_text_is_one_clear_error(tmp_path):
    for name, data in (("latin1.yaml", "run: {name: caf\xe9}\n".encode("latin-1")), ("binary.yaml", bytes(range(256)))):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError, match=f"{name}: (not a text recipe|invalid YAML)"):
            load_recipe(tmp_path / name)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="no such recipe file"):
        load_recipe(tmp_path / "nope.yaml")


# --- cross-field checks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, path, fragment",
    [
        (["parallelism.tp=3"], "parallelism", "does not divide the cluster"),
        (["parallelism.dp=4"], "parallelism.dp", "world size must equal tp*pp*cp*dp"),
        (["cluster.procs_per_host=4", "parallelism.tp=4", "parallelism.sequence_parallel=true"], "parallelism.tp", "model.num_kv_heads=2"),
        (["model.num_experts=3", "model.moe_top_k=1"], "parallelism.ep", "model.num_experts=3"),
        (["parallelism.tp=2"], "parallelism.sequence_parallel", "must be true for an MoE model"),
        (["parallelism.ep=1", "parallelism.sequence_parallel=true"], "parallelism.sequence_parallel", "needs tp > 1"),
        (["train.global_batch_size=6"], "train.global_batch_size", "micro_batch_size x dp = 2 x 2 = 4"),
        (["model.num_kv_heads=3"], "model.num_kv_heads", "does not divide model.num_attention_heads=4"),
        (["model.moe_top_k=5"], "model.moe_top_k", "model.num_experts=4"),
        (["optim.warmup_steps=11"], "optim.warmup_steps", "train.steps=10"),
    ],
)
def test_cross_field_checks(write_recipe, overrides, path, fragment):
    base = write_recipe(MINIMAL + "parallelism: {ep: 2}\n")
    problems = problems_of(base, overrides)
    assert path in problems, problems
    assert fragment in problems[path]


def test_seq_length_beyond_positions(write_recipe):
    path = write_recipe(MINIMAL + "data: {seq_length: 512, sources: [{name: a, paths: [x]}]}\n")
    assert "exceeds model.max_position_embeddings=256" in problems_of(path)["data.seq_length"]


def test_observations_and_a_reply_must_leave_room_for_the_prompt(write_recipe):
    rl = "env: {tasks: [{name: smoke}]}\nrl: {group_size: 4}\nrollout: {max_context: 200, sampling: {max_tokens: 64}, max_observation_tokens: %d}\n"
    assert (
        "leave no room for a prompt in rollout.max_context=200"
        in problems_of(write_recipe(MINIMAL + rl % 136))["rollout.max_observation_tokens"]
    )
    assert load_recipe(write_recipe(MINIMAL + rl % 100)).rollout.max_observation_tokens == 100


def test_rl_sections_come_together(write_recipe):
    path = write_recipe(MINIMAL + "rl: {group_size: 4}\n")
    assert "missing: rollout, env" in problems_of(path)["rollout"]


def test_router_replay_needs_moe(write_recipe):
    dense = MINIMAL.replace("num_experts: 4", "ffn_hidden_size: 128").replace("  moe_top_k: 2\n  moe_ffn_hidden_size: 64\n", "")
    rl = "rollout: {max_context: 200, sampling: {max_tokens: 64}}\nenv: {tasks: [{name: smoke}]}\nrl: {router_replay: r3}\n"
    assert "needs an MoE model" in problems_of(write_recipe(dense + rl))["rl.router_replay"]


def test_rollout_settings_that_need_each_other(write_recipe):
    rl = "env: {tasks: [{name: smoke}]}\nrl: {router_replay: r3}\n"
    problems = problems_of(
        write_recipe(MINIMAL + rl + "rollout: {max_context: 200, sampling: {max_tokens: 64}, harness: tools, engines_per_host: 2}\n")
    )
    assert "max_turns > 1" in problems["rollout.harness"]
    repo = "env: {tasks: [{name: repo}]}\nrl: {router_replay: r3}\nrollout: {max_context: 200, sampling: {max_tokens: 64}}\n"
    assert "set rollout.harness: tools" in problems_of(write_recipe(MINIMAL + repo))["rollout.harness"]
    assert "rollout.engine: server" in problems["rollout.engines_per_host"]
    rl = "env: {tasks: [{name: smoke}]}\nrl: {group_size: 4}\nrollout: {max_context: 200, sampling: {max_tokens: 64}}\n"
    for truncated in ("rollout.sampling.top_p=0.9", "rollout.sampling.top_k=20"):  # the learner scores the full distribution
        assert "set top_p: 1 and top_k: -1" in problems_of(write_recipe(MINIMAL + rl), [truncated])["rollout.sampling"]
    assert load_recipe(write_recipe(MINIMAL + rl), ["rollout.sampling.temperature=0.7"]).rollout.sampling.top_p == 1


def test_hosts_times_procs_is_the_world_size(write_recipe):
    recipe = load_recipe(write_recipe(MINIMAL), ["cluster.hosts=[a, b, c]", "cluster.procs_per_host=4", "train.global_batch_size=24"])
    assert recipe.cluster.world_size == 12
    problems = problems_of(write_recipe(MINIMAL), ["cluster.hosts=[a, b, c]", "parallelism.tp=4", "parallelism.sequence_parallel=true"])
    assert "3 host(s) x procs_per_host=2 = world size 6" in problems["parallelism"]


# --- extends -------------------------------------------------------------------------------------


def test_extends_merges_sections_and_child_wins(tmp_path, write_recipe):
    write_recipe(MINIMAL, "base.yaml")
    child = write_recipe("extends: base.yaml\nrun: {name: child}\ntrain: {steps: 20}\n", "child.yaml")
    recipe = load_recipe(child)
    assert recipe.run.name == "child" and recipe.train.steps == 20 and recipe.train.global_batch_size == 4


def test_extends_relative_to_the_file(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "base.yaml").write_text(MINIMAL)
    (tmp_path / "a" / "b" / "child.yaml").write_text("extends: ../base.yaml\n")
    assert load_recipe(tmp_path / "a" / "b" / "child.yaml").model.num_experts == 4


def test_a_projects_relative_path_is_the_recipe_files_and_other_paths_the_working_directorys(tmp_path):
    from composer.recipes.loader import apply_overrides, resolve_extends

    def repo_set(path: str) -> dict:
        return {"env": {"tasks": [{"name": "repo", "repo": {"cache_dir": "cache", "projects": [{"name": "p", "path": path}]}}]}}

    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "base.yaml").write_text(yaml.safe_dump({**repo_set("../mylib"), "model": {"checkpoint": "runs/a"}}))
    (tmp_path / "child.yaml").write_text(yaml.safe_dump({"extends": "shared/base.yaml"}))
    data = resolve_extends(tmp_path / "child.yaml")
    repo = data["env"]["tasks"][0]["repo"]
    assert repo["projects"][0]["path"] == str(tmp_path.resolve() / "shared" / "../mylib")  # the file that names it
    assert repo["cache_dir"] == "cache" and data["model"]["checkpoint"] == "runs/a"  # the working directory's
    (tmp_path / "own.yaml").write_text(yaml.safe_dump({"extends": "shared/base.yaml", **repo_set("mylib")}))
    assert resolve_extends(tmp_path / "own.yaml")["env"]["tasks"][0]["repo"]["projects"][0]["path"] == str(tmp_path.resolve() / "mylib")
    overridden = apply_overrides(data, ["env.tasks.0.repo.projects.0.path=elsewhere"])  # --set: the working directory's
    assert overridden["env"]["tasks"][0]["repo"]["projects"][0]["path"] == "elsewhere"
    (tmp_path / "home.yaml").write_text(yaml.safe_dump(repo_set("~/src/mylib")))
    assert resolve_extends(tmp_path / "home.yaml")["env"]["tasks"][0]["repo"]["projects"][0]["path"] == "~/src/mylib"


def test_bad_extends_path(write_recipe):
    path = write_recipe("extends: missing-base.yaml\n")
    with pytest.raises(UserError, match="extends: 'missing-base.yaml' not found"):
        load_recipe(path)


def test_cyclic_extends(write_recipe):
    write_recipe("extends: b.yaml\n", "a.yaml")
    b = write_recipe("extends: a.yaml\n", "b.yaml")
    with pytest.raises(UserError, match=r"cyclic extends: b.yaml -> a.yaml -> b.yaml"):
        load_recipe(b)


# --- --set ---------------------------------------------------------------------------------------


def test_set_is_typed(write_recipe):
    recipe = load_recipe(write_recipe(MINIMAL), ["train.steps=7", "optim.lr=1e-4", "model.tie_word_embeddings=true"])
    assert recipe.train.steps == 7 and recipe.optim.lr == 1e-4 and recipe.model.tie_word_embeddings is True


def test_set_into_list_item(write_recipe):
    path = write_recipe(MINIMAL + "data: {seq_length: 128, sources: [{name: a, paths: [x]}]}\n")
    assert load_recipe(path, ["data.sources.0.weight=2.5"]).data.sources[0].weight == 2.5


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.steps", "expected KEY.PATH=VALUE"),
        ("=3", "expected KEY.PATH=VALUE"),
        ("train..steps=3", "expected KEY.PATH=VALUE"),
        ("train.steps.x=3", "train.steps holds a value"),
        ("optim.lr=[1", "not valid YAML"),
    ],
)
def test_bad_set(write_recipe, override, fragment):
    with pytest.raises(UserError, match=fragment.replace(".", r"\.").replace("[", r"\[")):
        load_recipe(write_recipe(MINIMAL), [override])


def test_set_unknown_key_is_caught_by_the_schema(write_recipe):
    assert problems_of(write_recipe(MINIMAL), ["train.stpes=3"]) == {"train.stpes": "unknown key; did you mean 'steps'?"}


def test_set_wrong_type(write_recipe):
    assert "integer" in problems_of(write_recipe(MINIMAL), ["train.steps=abc"])["train.steps"]


def test_resolved_recipe_round_trips(write_recipe, tmp_path):
    recipe = load_recipe(write_recipe(MINIMAL), ["train.steps=5"])
    resolved = write_recipe(recipe_to_yaml(recipe), "resolved.yaml")
    assert load_recipe(resolved) == recipe
    assert "extends" not in yaml.safe_load(resolved.read_text())


def test_refuse_unhonoured_keys(write_recipe):
    recipe = load_recipe(write_recipe(MINIMAL), ["parallelism.ep=2"])
    refuse_unhonoured(recipe, "train midtrain", {"parallelism.pp": "no pipeline schedule yet"})
    bad = load_recipe(write_recipe(MINIMAL), ["model.num_shared_experts=1"])
    with pytest.raises(
        UserError, match=r"model.num_shared_experts: train midtrain does not support 1 here \(no shared experts\); leave it at 0"
    ):
        refuse_unhonoured(bad, "train midtrain", {"model.num_shared_experts": "no shared experts"})


def test_held_out_and_num_tasks_are_checked_against_the_set_size_known_at_validate_time():
    from composer.recipes.checks import _task_count_problems
    from composer.recipes.env_schema import RepoTaskSettings, TaskSet

    problems = _task_count_problems([TaskSet(name="repo", repo=RepoTaskSettings(num_tasks=100), held_out=100000)])
    assert [p.path for p in problems] == ["env.tasks.0.held_out"] and "100" in str(problems[0])
    assert [p.path for p in _task_count_problems([TaskSet(name="smoke", limit=50, held_out=50)])] == ["env.tasks.0.held_out"]
    assert [p.path for p in _task_count_problems([TaskSet(name="repo", repo=RepoTaskSettings(num_tasks=100), limit=200)])] == [
        "env.tasks.0.limit"
    ]
    assert (
        _task_count_problems(
            [
                TaskSet(name="smoke", limit=50, held_out=10),
                TaskSet(name="humaneval", held_out=20),
                TaskSet(name="repo", repo=RepoTaskSettings(num_tasks=100), held_out=10),
            ]
        )
        == []
    )


def test_the_shaped_summary_reward_needs_self_summarization(write_recipe):
    rl = "env: {tasks: [{name: smoke}]}\nrl: {group_size: 4, summary_reward: 0.5}\nrollout: {max_context: 200, max_turns: 4, sampling: {max_tokens: 64}}\n"
    path = write_recipe(MINIMAL + rl)
    assert "set rollout.summarize_at" in problems_of(path)["rl.summary_reward"]
    assert "rl.summary_reward: 0" in problems_of(path, ["rollout.summarize_at=0.5", "rollout.compaction=drop_oldest"])["rl.summary_reward"]
    assert load_recipe(path, ["rollout.summarize_at=0.5", "rollout.compaction=drop_oldest", "rl.summary_reward=0"]).rl.summary_reward == 0
    assert load_recipe(path, ["rollout.summarize_at=0.5"]).rl.summary_reward == 0.5


def test_sandbox_servers_started_by_slurm_are_a_strict_section_of_their_own():
    rl = RECIPES / "smoke-rl.yaml"
    recipe = load_recipe(rl, ["env.sandbox.hosts=[]", "env.sandbox.slurm.servers=2", "env.sandbox.slurm.cpus_per_server=4"])
    assert recipe.env.sandbox.hosts == [] and recipe.env.sandbox.slurm.servers == 2 and recipe.env.sandbox.slurm.nodes is None
    assert problems_of(rl, ["env.sandbox.hosts=[]"]) == {
        "env.sandbox": "hosts: empty, and no slurm servers: nothing would run the sandboxes"
    }
    assert (
        "slurm-1 is the name of a sandbox server"
        in problems_of(rl, ["env.sandbox.hosts=[slurm-1]", "env.sandbox.slurm.servers=2"])["env.sandbox"]
    )
    assert problems_of(rl, ["env.sandbox.slurm.nodes=2"])["env.sandbox.slurm.servers"] == "required, but missing"
    assert problems_of(rl, ["env.sandbox.slurm.servers=1", "env.sandbox.slurm.node=2"]) == {
        "env.sandbox.slurm.node": "unknown key; did you mean 'nodes'?"
    }
