"""The `composer` CLI as a user runs it: exit codes, messages, no tracebacks."""

import json

import yaml

from tests.conftest import RECIPES

SHIPPED = sorted(str(p) for p in RECIPES.glob("*.yaml"))


def test_version(composer):
    result = composer("--version")
    assert result.returncode == 0 and result.stdout.startswith("composer ")


def test_help_lists_command_groups(composer):
    result = composer("--help")
    assert result.returncode == 0 and "recipe" in result.stdout


def test_validate_all_shipped(composer):
    result = composer("recipe", "validate", *SHIPPED)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("✓") == len(SHIPPED)
    assert "smoke-sft.yaml (sft, world size 2)" in result.stdout and "smoke-rl.yaml (rl, world size 2)" in result.stdout


def test_validate_reports_every_file_and_exits_2(composer, write_recipe):
    bad = write_recipe(
        "run: {name: x}\nmodel: {num_layers: 2}\noptim: {lr: 1}\ntrain: {steps: 1, global_batch_size: 1}\nextra_section: 1\n"
    )
    result = composer("recipe", "validate", SHIPPED[0], str(bad))
    assert result.returncode == 2
    assert "✓" in result.stdout and "✗" in result.stdout
    assert "model.hidden_size: required, but missing" in result.stdout
    assert "extra_section: unknown key" in result.stdout
    assert "1 of 2 recipe(s) invalid" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_validate_with_impossible_parallel_sizes(composer):
    result = composer("recipe", "validate", str(RECIPES / "smoke-midtrain.yaml"), "--set", "parallelism.tp=2")
    assert result.returncode == 2
    assert "parallelism.sequence_parallel: must be true for an MoE model with tp=2" in result.stdout
    assert "Traceback" not in result.stderr


def test_show_resolves_extends_and_overrides(composer):
    result = composer("recipe", "show", str(RECIPES / "smoke-midtrain.yaml"), "--set", "train.steps=30")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["train"]["steps"] == 30
    assert resolved["model"]["num_experts"] == 8  # from base/tiny-moe.yaml
    assert "extends" not in resolved


def test_show_bad_set_is_one_clear_line(composer):
    result = composer("recipe", "show", str(RECIPES / "smoke-midtrain.yaml"), "--set", "train.steps")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --set 'train.steps': expected KEY.PATH=VALUE, e.g. --set train.steps=10"


def test_missing_file_no_traceback(composer, tmp_path):
    result = composer("recipe", "show", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "no such recipe file" in result.stderr and "Traceback" not in result.stderr


def test_debug_shows_traceback(composer, tmp_path):
    result = composer("--debug", "recipe", "show", str(tmp_path / "nope.yaml"))
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_schema_is_json_schema_with_docs(composer):
    result = composer("recipe", "schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert {"run", "model", "parallelism", "data", "rollout", "env", "rl", "sync", "cluster", "optim", "train"} <= set(schema["properties"])
    assert "additionalProperties" in json.dumps(schema)
    assert "Tensor-parallel size." in result.stdout


MALFORMED = {
    "unknown key": (["--set", "train.chekpoint_every=5"], "train.chekpoint_every: unknown key; did you mean 'checkpoint_every'?"),
    "wrong type": (["--set", "model.num_layers=two"], "model.num_layers: Input should be a valid integer"),
    "impossible parallel sizes": (["--set", "parallelism.ep=3"], "parallelism.ep: 3 does not divide model.num_experts=8"),
    "bad --set": (["--set", "model.num_layers.x=1"], "--set 'model.num_layers.x=1': model.num_layers holds a value"),
}


def _run_malformed(composer, args):
    result = composer("recipe", "show", str(RECIPES / "smoke-midtrain.yaml"), *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr
    return result.stderr


def test_malformed_recipes_name_the_path_without_traceback(composer):
    for name, (args, message) in MALFORMED.items():
        assert message in _run_malformed(composer, args), name


def test_bad_and_cyclic_extends_without_traceback(composer, write_recipe):
    missing = write_recipe("extends: nowhere.yaml\n", "missing.yaml")
    write_recipe("extends: b.yaml\n", "a.yaml")
    cyclic = write_recipe("extends: a.yaml\n", "b.yaml")
    for path, message in ((missing, "extends: 'nowhere.yaml' not found"), (cyclic, "cyclic extends: b.yaml -> a.yaml -> b.yaml")):
        result = composer("recipe", "validate", str(path))
        assert result.returncode == 2 and message in result.stdout and "Traceback" not in result.stdout + result.stderr


def test_a_recipe_that_is_not_utf8_ends_in_one_line(composer, tmp_path):
    path = tmp_path / "utf16.yaml"
    path.write_bytes("run: {name: t}\n".encode("utf-16"))
    for command in (["recipe", "validate"], ["train", "rl"], ["train", "midtrain"]):
        result = composer(*command, str(path))
        assert result.returncode == 2, command
        assert "Traceback" not in result.stdout + result.stderr and "not a text recipe" in result.stdout + result.stderr
