"""SFT demonstrations: rendering in the harness's format, the assistant-only loss mask, sources, refusals, split."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest
import zstandard

from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.rl.sft_data import ConversationRenderer, prepare_sft_examples
from composer.rl.trajectories import TrajectoryStore
from composer.rollout.agent.harness import parse_tool_calls
from composer.rollout.agent.trajectory import Segment, Trajectory
from composer.rollout.tasks.functions import smoke_task
from composer.rollout.tasks.pool import held_out_split
from composer.runtime.sft_examples import SftExamples
from composer.trainer.sft import ConversationSamples
from tests.conftest import RECIPES
from tests.helpers.sft_demos import demonstration, tiny_tokenizer, write_demonstrations


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def sft_recipe(tmp_path: Path, tokenizer: Path, sources: list[dict], **sft) -> object:
    text = {
        "extends": str(RECIPES / "base" / "tiny-moe.yaml"),
        "run": {"name": "sft", "dir": str(tmp_path / "runs")},
        "model": {"checkpoint": str(tokenizer)},
        "sft": {"sources": sources, "max_length": 1024, "held_out": 0.25, **sft},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(text))
    return load_recipe(path)


def test_the_loss_covers_the_assistants_replies_and_their_end_only(tokenizer):
    renderer = ConversationRenderer(str(tokenizer), chat_template=False)
    tokens, mask = renderer.render(demonstration(7)["messages"], "demo")
    trained = renderer.tok.decode([t for t, m in zip(tokens, mask) if m])
    calls = parse_tool_calls(trained)
    assert [c.name for c in calls] == ["write_file", "run_tests", "finish"]
    assert calls[0].arguments == {"path": "solution.py", "content": "def answer():\n    return 7\n"}
    untrained = renderer.tok.decode([t for t, m in zip(tokens, mask) if not m])
    assert "Write solution.py" in untrained and "1 passed" in untrained and "Tools (call" in untrained  # task, tool output, harness guide
    assert "You are helpful." not in renderer.tok.decode(tokens)  # the harness's system message replaces the source's
    eos = renderer.end_of_reply[0]
    assert [t for t, m in zip(tokens, mask) if m].count(eos) == 3  # each reply is taught to end
    # the Hugging Face form (arguments an object, tool messages named) renders to the same tokens
    assert renderer.render(demonstration(7, openai=False)["messages"], "demo") == (tokens, mask)


def test_directories_of_compressed_files_are_read_and_split_by_seed(tmp_path, tokenizer):
    demos = tmp_path / "demos"
    write_demonstrations(demos / "plain.jsonl", 4)
    (demos / "b.jsonl.gz").write_bytes(gzip.compress(write_demonstrations(tmp_path / "x.jsonl", 4, start=4).read_bytes()))
    (demos / "c.jsonl.zst").write_bytes(zstandard.compress(write_demonstrations(tmp_path / "y.jsonl", 4, start=8).read_bytes()))
    (demos / "notes.txt").write_text("not a source")
    recipe = sft_recipe(tmp_path, tokenizer, [{"name": "demos", "paths": [str(demos)]}])
    examples = prepare_sft_examples(recipe)
    assert (len(examples.train), len(examples.valid)) == (9, 3)
    assert examples.summary["sources"]["demos"]["conversations"] == 12
    again = prepare_sft_examples(recipe)
    assert np.array_equal(again.valid.tokens, examples.valid.tokens)
    held = {bytes(examples.valid[i][0]) for i in range(3)}
    assert not held & {bytes(examples.train[i][0]) for i in range(9)}
    examples.write(tmp_path / "run")
    read = SftExamples.read(tmp_path / "run")
    assert np.array_equal(read.train.loss_mask, examples.train.loss_mask) and read.summary == examples.summary


def _bad(tmp_path: Path, record: object | str) -> Path:
    path = write_demonstrations(tmp_path / "demos.jsonl", 3)
    line = record if isinstance(record, str) else json.dumps(record)
    path.write_text(path.read_text() + line + "\n")
    return path


def _no_assistant():
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}


def _arguments(arguments: str, name: str = "read_file"):
    d = demonstration(1)
    d["messages"][2]["tool_calls"][0]["function"] = {"name": name, "arguments": arguments}
    return d


BAD_LINES = {
    "not JSON": ('{"messages": [', "demos.jsonl:4: not JSON"),
    "no assistant turn": (_no_assistant(), "demos.jsonl:4: the conversation has no assistant turn"),
    "arguments not JSON": (_arguments('{"path": '), "demos.jsonl:4: the arguments of tool call 'read_file' are not JSON"),
    "a tool the harness lacks": (
        _arguments('{"q": 1}', name="browse"),
        "demos.jsonl:4: the harness would refuse a tool call: tool call 1: unknown tool 'browse'",
    ),
    "arguments the tool refuses": (_arguments('{"file": "a"}'), "unknown argument file (accepted: path, start_line, end_line)"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_a_bad_line_is_refused_naming_file_and_line(tmp_path, tokenizer, case):
    record, message = BAD_LINES[case]
    path = _bad(tmp_path, record)
    with pytest.raises(UserError, match=None) as caught:
        prepare_sft_examples(sft_recipe(tmp_path, tokenizer, [{"name": "demos", "paths": [str(path)]}]))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_conversation_longer_than_max_length_is_cut_or_refused_and_counted(tmp_path, tokenizer):
    path = write_demonstrations(tmp_path / "demos.jsonl", 8)
    renderer = ConversationRenderer(str(tokenizer), chat_template=False)
    lengths = [len(renderer.render(demonstration(k)["messages"], "")[0]) for k in range(8)]
    prompt = len(renderer.format.prompt(demonstration(0)["messages"][1]["content"]))
    limit = max(lengths) - 5
    source = [{"name": "demos", "paths": [str(path)]}]
    cut = prepare_sft_examples(sft_recipe(tmp_path, tokenizer, source, max_length=limit))
    over = sum(n > limit for n in lengths)
    assert cut.summary["sources"]["demos"]["cut"] == over > 0 and cut.summary["sources"]["demos"]["dropped"] == 0
    assert max(np.diff(cut.train.offsets).max(), np.diff(cut.valid.offsets).max()) == limit
    with pytest.raises(UserError, match=r"demos.jsonl:\d+: \d+ tokens exceed sft.max_length=\d+ \(sft.overlong: refuse"):
        prepare_sft_examples(sft_recipe(tmp_path, tokenizer, source, max_length=limit, overlong="refuse"))
    with pytest.raises(UserError, match="no conversation to train on \\(8 dropped"):  # no assistant token left within the limit
        prepare_sft_examples(sft_recipe(tmp_path, tokenizer, source, max_length=prompt))


def test_rewarded_episodes_of_an_rl_run_are_a_source(tmp_path, tokenizer):
    def episode(i: int, reward: float) -> Trajectory:
        tokens = np.arange(10 + i, dtype=np.int32)
        mask = np.arange(10 + i) >= 6
        return Trajectory(f"e{i}", "g", "t", 0, reward, [Segment(tokens, mask, np.zeros(10 + i, np.float32))])

    store = TrajectoryStore(tmp_path / "rl-run" / "trajectories")
    store.put("g0", [episode(0, 1.0), episode(1, 0.0), episode(2, 1.0)])
    store.put("g1", [episode(3, 0.5), episode(4, 1.0), episode(5, 1.0)])
    recipe = sft_recipe(tmp_path, tokenizer, [{"name": "rl", "kind": "trajectories", "paths": [str(tmp_path / "rl-run")]}])
    examples = prepare_sft_examples(recipe)
    lengths = sorted([*np.diff(examples.train.offsets), *np.diff(examples.valid.offsets)])
    assert lengths == [10, 12, 14, 15]  # episodes 0, 2, 4, 5
    assert examples.train[0][1].tolist() == (np.arange(len(examples.train[0][1])) >= 6).tolist()


def test_samples_shift_labels_mask_the_padding_and_follow_a_seeded_order(tmp_path, tokenizer):
    path = write_demonstrations(tmp_path / "demos.jsonl", 8)
    examples = prepare_sft_examples(sft_recipe(tmp_path, tokenizer, [{"name": "demos", "paths": [str(path)]}], pack=False))
    samples = ConversationSamples(examples.train, 1024, examples.pad, seed=5, shuffle=True)
    n = len(examples.train)

    def order(s, ks):
        return [s.sample_conversations(k)[0] for k in ks]

    first_pass = order(samples, range(n))
    assert sorted(first_pass) == list(range(n)) and first_pass != order(samples, range(n, 2 * n))
    fresh = ConversationSamples(examples.train, 1024, examples.pad, seed=5, shuffle=True)
    assert order(fresh, range(3 * n))[::-1] == order(samples, reversed(range(3 * n)))
    ids, mask = examples.train[first_pass[0]]
    sample = samples[0]
    assert sample["tokens"][: len(ids) - 1].tolist() == ids[:-1].tolist() and sample["labels"][: len(ids) - 1].tolist() == ids[1:].tolist()
    assert sample["loss_mask"][: len(ids) - 1].tolist() == mask[1:].astype(float).tolist() and not sample["loss_mask"][len(ids) - 1 :].any()


def _cli_case(tmp_path: Path, tokenizer: Path, case: str) -> tuple[list[str], str]:
    demos = write_demonstrations(tmp_path / "demos" / "d.jsonl", 3)
    sets = [
        f"run.dir={tmp_path / 'runs'}",
        f"model.checkpoint={tokenizer}",
        f"sft.sources=[{{name: d, paths: [{demos.parent}]}}]",
        "env=null",
    ]
    if case == "no assistant turn":
        (demos.parent / "e.jsonl").write_text(json.dumps(_no_assistant()) + "\n")
        expected = "e.jsonl:1: the conversation has no assistant turn (nothing to train on)"
    elif case == "arguments not JSON":
        (demos.parent / "e.jsonl").write_text(json.dumps(_arguments("{path: x}")) + "\n")
        expected = "e.jsonl:1: the arguments of tool call 'read_file' are not JSON"
    elif case == "longer than the context, refused":
        sets += ["sft.max_length=64", "sft.overlong=refuse"]
        expected = "d.jsonl:1: "
    else:  # a checkpoint it cannot read
        bad = tmp_path / "bad-checkpoint"
        bad.mkdir()
        (bad / "config.json").write_text("{not json")
        sets[1] = f"model.checkpoint={bad}"
        expected = "bad-checkpoint/config.json: invalid JSON"
    return ["train", "sft", str(RECIPES / "smoke-sft.yaml"), *(a for s in sets for a in ("--set", s))], expected


@pytest.mark.parametrize(
    "case",
    [
        "no assistant turn",
        pytest.param("arguments not JSON", marks=pytest.mark.slow),  # each a CLI start: the data checks cover them in-process
        pytest.param("longer than the context, refused", marks=pytest.mark.slow),
        "a checkpoint it cannot read",
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, tokenizer, composer, case):
    args, expected = _cli_case(tmp_path, tokenizer, case)
    result = composer(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in result.stderr, result.stderr
    if "refused" in case:
        assert "exceed sft.max_length=64 (sft.overlong: refuse" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_env_without_a_references_source_is_refused_as_sft_not_as_rl(tmp_path, tokenizer):
    demos = write_demonstrations(tmp_path / "d.jsonl", 3)
    sets = [f"model.checkpoint={tokenizer}", f"sft.sources=[{{name: d, paths: [{demos}]}}]"]
    with pytest.raises(UserError) as refused:
        load_recipe(RECIPES / "smoke-sft.yaml", sets)
    assert "env: an SFT recipe reads env only for a `references` source" in str(refused.value)
    assert "rollout" not in str(refused.value)
    assert load_recipe(RECIPES / "smoke-sft.yaml", [*sets, "env=null"]).env is None
    with pytest.raises(UserError, match="sft.max_observation_tokens: cuts the tool outputs of a `references` source"):
        load_recipe(RECIPES / "smoke-sft.yaml", [*sets, "env=null", "sft.max_observation_tokens=64"])


def test_a_checkpoint_that_is_missing_or_has_no_tokenizer_is_refused(tmp_path, tokenizer):
    source = [{"name": "demos", "paths": [str(write_demonstrations(tmp_path / "d.jsonl", 3))]}]
    with pytest.raises(UserError, match="nope: no such directory"):
        prepare_sft_examples(sft_recipe(tmp_path, tmp_path / "nope", source))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty: cannot read its tokenizer"):
        prepare_sft_examples(sft_recipe(tmp_path, tmp_path / "empty", source))


def test_function_task_references_become_episodes_of_training_tasks_only(tmp_path, tokenizer):
    recipe = load_recipe(
        RECIPES / "smoke-sft.yaml",
        [f"model.checkpoint={tokenizer}", "env.tasks.0.limit=12", "env.tasks.0.held_out=4", "sft.held_out=0.2"],
    )
    examples = prepare_sft_examples(recipe)
    assert len(examples.train) + len(examples.valid) == 8 and examples.summary["sources"]["smoke-references"]["skipped"] == 0
    renderer = ConversationRenderer(str(tokenizer), chat_template=False)
    training, held_out = held_out_split(recipe.env.tasks[0], 12)
    texts = [renderer.tok.decode(examples.train[i][0].tolist()) for i in range(len(examples.train))]
    texts += [renderer.tok.decode(examples.valid[i][0].tolist()) for i in range(len(examples.valid))]
    # the tasks demonstrated are the training split's, task for task (prompts repeat across tasks: compare as multisets)
    shown = sorted(re.search(r"(Return .*?\.)\n\ndef answer", t).group(1) for t in texts)
    assert shown == sorted(smoke_task(i).prompt.split("\n")[0] for i in training) and len(held_out) == 4
    for text, (ids, mask) in zip(texts, [examples.train[i] for i in range(len(examples.train))]):
        trained = renderer.tok.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m])
        assert [c.name for c in parse_tool_calls(trained)] == ["write_file", "run_tests", "finish"]
        assert "tests passed (ok)" in text  # the real run_tests output of the reference


def test_reference_edits_turn_a_changed_file_into_the_reference_each_old_string_occurring_once():
    import inspect
    import random

    import composer.rollout.agent.harness as harness
    from composer.rl.sft_references import read_ranges, reference_edits

    reference = inspect.getsource(harness)
    lines = reference.splitlines(keepends=True)
    rng = random.Random(0)
    for _ in range(200):
        changed = list(lines)
        for _ in range(rng.randint(1, 4)):  # deleted, repeated and altered lines, as mutations and commits make them
            i = rng.randrange(len(changed))
            kind = rng.choice(["delete", "insert", "alter"])
            if kind == "delete":
                del changed[i]
            elif kind == "insert":
                changed.insert(i, rng.choice(lines))
            else:
                changed[i] = changed[i].replace("a", "b", 1)
        text = "".join(changed)
        for old, new in reference_edits(text, reference):
            assert old and text.count(old) == 1  # what the harness's edit tool accepts
            text = text.replace(old, new, 1)
        assert text == reference
    # a repeated line gets the context that makes it unique
    assert reference_edits("x = 1\ny = 2\nx = 1\n", "x = 1\ny = 3\nx = 1\n") == [("y = 2\n", "y = 3\n")]
    assert reference_edits("a\na\n", "a\nb\na\n") == [("a\na\n", "a\nb\na\n")]
    # a change inside a function is read as the whole function, decorators included
    source = "import x\n\n\n@cache\ndef f(a):\n    b = a\n    return b\n\n\nc = 1\n"
    assert read_ranges(source, [(6, 6)]) == [(4, 7)] and read_ranges(source, [(10, 10)]) == [(4, 10)]


def test_a_references_episode_shows_each_tool_output_as_the_rl_harness_would(tmp_path, tokenizer):
    """`sft.max_observation_tokens`: a demonstration's tool output is what `run_reply` shows an RL episode under that
    budget (start and end kept, the cut noted), so SFT teaches on what RL will show; unset, outputs are whole."""
    from composer.rollout.agent.environment import CodingEnvironment
    from composer.rollout.agent.harness import ToolBox, run_reply

    sets = [
        f"model.checkpoint={tokenizer}",
        "env.tasks=[{name: recall, limit: 3, held_out: 1, recall: {parts: 2, filler_lines: 12}}]",
        "sft.max_length=4096",
        "model.max_position_embeddings=4096",
        "sft.held_out=0.5",
    ]
    renderer = ConversationRenderer(str(tokenizer), chat_template=False)

    def shown(overrides: list[str]) -> str:
        examples = prepare_sft_examples(load_recipe(RECIPES / "smoke-sft.yaml", [*sets, *overrides]))
        cut = examples.summary["sources"]["smoke-references"]["observations_cut"]
        assert cut == (4 if overrides else 0)  # two tasks' two part files each (their test reports are short)
        return "\n".join(renderer.tok.decode(part[i][0].tolist()) for part in (examples.train, examples.valid) for i in range(len(part)))

    recipe = load_recipe(RECIPES / "smoke-sft.yaml", sets)
    env = CodingEnvironment(recipe.env, seed=recipe.train.seed, sandbox_root=tmp_path / "sandbox")
    try:
        task = env.pool.task(0, env.pool.indices(0)[0])
        workspace = env.open_workspace(task, tools=True)
        try:
            read = '<tool_call>{"name": "read_file", "arguments": {"path": "notes/part_1.txt"}}</tool_call>'
            in_rl, in_full = (
                run_reply(
                    read, workspace, ToolBox(shell_seconds=10), renderer.tok, budget, renderer.format.tool_message_overhead()
                ).messages[0]["content"]
                for budget in (64, 100_000)
            )
        finally:
            workspace.close()
    finally:
        env.close()
    assert "characters (" in in_rl and "characters (" not in in_full  # the file is longer than the budget
    whole, cut = shown([]), shown(["sft.max_observation_tokens=64"])
    assert in_full in whole and in_rl not in whole
    assert in_rl in cut and in_full not in cut
