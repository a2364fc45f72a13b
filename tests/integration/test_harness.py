"""The agent harness: tool calls parsed from replies, tools on a real workspace in the real sandbox, observations in
the chat template, the one agent loop driven by a scripted policy (no engine: its replies are fixed)."""

import json

import pytest

from composer.recipes.env_schema import EnvSection, TaskSet
from composer.recipes.schema import RolloutSection, SamplingSection
from composer.rollout.agent.harness import CallError, ToolBox, ToolCall, parse_tool_calls, truncate
from composer.rollout.engines.vllm_engine import Completion

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else '' }}
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""A Qwen/Hermes-style template that renders `tools=` (written for this test)."""


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptedPolicy:
    """An `Engine` whose replies are fixed: the next of `replies` per turn (one episode), `summary` whenever the
    context ends with the summary request."""

    def __init__(self, tok, replies: list[str], summary: str = "I read the files.", end: list[int] | None = None):
        self.tok = tok
        self.replies = list(replies)
        self.summary = summary
        self.end = end or []
        self.prompts: list[str] = []

    def generate(self, prompts, n=1, seeds=None, max_tokens=None, temperature=None):
        out = []
        for prompt in prompts:
            text = self.tok.decode(prompt)
            self.prompts.append(text)
            reply = self.summary if text.endswith("Summary:") else self.replies.pop(0)
            ids = self.tok.encode(reply) + self.end
            out.append([Completion(list(prompt), ids, [-0.25] * len(ids), None, "stop")])
        return out


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from composer.trainer.checkpoint_init import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(4096, 2**18).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from composer.rollout.agent.harness import Tokenizer

    return Tokenizer(str(tokenizer_dir))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from composer.rollout.agent.environment import CodingEnvironment

    return CodingEnvironment(
        EnvSection(tasks=[TaskSet(name="smoke"), TaskSet(name="humaneval")]), seed=0, sandbox_root=tmp_path_factory.mktemp("sandbox")
    )


TOOLS = RolloutSection(harness="tools", max_context=4096, max_turns=8, sampling=SamplingSection(max_tokens=256))
HUMANEVAL_0 = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"


def run_episode(tok, env, replies, task_index=(1, 0), rollout=TOOLS, **policy):
    from composer.rollout.agent.loop import EpisodeRunner

    policy = ScriptedPolicy(tok, replies, **policy)
    [trajectory] = EpisodeRunner(policy, tok, env, rollout).run_group(env.pool.task(*task_index), "g", 1, 0, seed=0)
    return trajectory, policy


# --- parsing -----------------------------------------------------------------------------------


def test_tool_calls_are_parsed_from_text_around_them_in_order():
    reply = (
        "Let me look first.\n"
        + call("read_file", path="a.py", start_line=2)
        + "\nthen\n"
        + '<tool_call>\n```json\n{"name": "run_tests", "arguments": {}}\n```\n</tool_call>'
        + '<tool_call>{"name": "edit", "arguments": "{\\"path\\": \\"a.py\\", \\"old_string\\": \\"x\\", \\"new_string\\": \\"y\\"}"}</tool_call>'
        + '<tool_call>{"name": "search", "arguments": {"pattern": "x"}}\n'  # its closing tag forgotten
        + '<tool_call>{"name": "finish"}'
    )
    assert parse_tool_calls(reply) == [
        ToolCall("read_file", {"path": "a.py", "start_line": 2}),
        ToolCall("run_tests", {}),
        ToolCall("edit", {"path": "a.py", "old_string": "x", "new_string": "y"}),
        ToolCall("search", {"pattern": "x"}),
        ToolCall("finish", {}),
    ]
    assert parse_tool_calls("no call here, ```python\nprint(1)\n```") == []


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "read_file", "arguments": {"path": "a.py"', "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"name": "rm_rf", "arguments": {}}', "unknown tool 'rm_rf'"),
        ('{"name": "read_file", "arguments": {}}', "missing required argument path"),
        ('{"name": "read_file", "arguments": {"path": "a", "lines": 3}}', "unknown argument lines"),
        ('{"name": "read_file", "arguments": {"path": 7}}', "argument path must be a string, not int"),
        ('{"name": "read_file", "arguments": {"path": "a", "start_line": "3"}}', "start_line must be an integer, not str"),
        ('{"name": "read_file", "arguments": {"path": "a", "start_line": true}}', "start_line must be an integer, not bool"),
        ('{"name": "shell", "arguments": ["ls"]}', '"arguments" must be a JSON object'),
        ('{"name": "shell", "command": "ls"}', "unexpected keys ['command']"),
        ('{"name": "shell", "arguments": {"command": "echo a\\u0000b"}}', "argument command must be text"),
        ('{"name": "write_file", "arguments": {"path": "x", "content": "\\ud800"}}', "argument content must be text"),
        ("[" * 100_000, "nested too deeply"),
        ('{"name": "finish", "arguments": "' + "[" * 100_000 + '"}', "nested too deeply"),
    ],
)
def test_malformed_calls_are_errors_that_say_what_is_wrong(body, message):
    [error] = parse_tool_calls(f"text <tool_call>{body}</tool_call> more")
    assert isinstance(error, CallError) and message in error.message, error


def test_truncation_keeps_both_ends_and_says_what_was_cut(tok):
    text = "".join(f"line {i}\n" for i in range(2000))
    cut = truncate(text, 200, tok, "read a range")
    assert cut.startswith("line 0\n") and cut.endswith("line 1999\n") and len(tok.encode(cut)) <= 200
    note = next(line for line in cut.splitlines() if "cut" in line)
    characters = int(note.split()[1])
    assert characters == len(text) - len(cut) + len(note) + 2 and "lines) cut: read a range" in note
    assert truncate("short", 200, tok, "x") == "short"


# --- tools on a workspace ----------------------------------------------------------------------


@pytest.fixture
def workspace(env):
    workspace = env.open_workspace(env.pool.task(1, 0), tools=True)
    yield workspace
    workspace.close()


def tool(workspace, name, **arguments) -> str:
    return ToolBox(shell_seconds=10).call(workspace, ToolCall(name, arguments)).text


def test_file_tools_refuse_every_way_out_of_the_workspace(workspace, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("secret\n")
    made = tool(workspace, "shell", command=f"ln -s {outside} link && ln -s {tmp_path} dir && ln -s / root && mkfifo pipe && echo ok")
    assert made.endswith("ok"), made
    for path in ("link", "dir/outside.txt", "root/etc/passwd", "../outside.txt", "a/../../outside.txt", str(outside)):
        assert tool(workspace, "read_file", path=path).startswith("error:"), path
        assert tool(workspace, "write_file", path=path, content="pwned\n").startswith("error:"), path
        assert tool(workspace, "edit", path=path, old_string="secret", new_string="pwned").startswith("error:"), path
    assert outside.read_text() == "secret\n"
    assert "not a regular file" in tool(workspace, "read_file", path="pipe")  # and it did not block
    assert "symlink" in tool(workspace, "read_file", path="dir/outside.txt")
    # a hard link made by a command is not written through (it could be a file the harness must not change)
    assert tool(workspace, "shell", command="ln solution.py twin && echo ok").endswith("ok")
    assert "hard link" in tool(workspace, "write_file", path="twin", content="x\n")


def test_edit_replaces_one_exact_match_and_explains_the_others(workspace):
    assert tool(workspace, "write_file", path="pkg/m.py", content="x = 1\ny = 1\nz = 2\n") == "wrote pkg/m.py (3 lines)"
    assert "occurs 2 times in pkg/m.py (lines 1, 2)" in tool(workspace, "edit", path="pkg/m.py", old_string=" = 1", new_string=" = 3")
    assert "does not occur" in tool(workspace, "edit", path="pkg/m.py", old_string="w = 1", new_string="w = 3")
    assert "the same" in tool(workspace, "edit", path="pkg/m.py", old_string="z", new_string="z")
    assert tool(workspace, "edit", path="pkg/m.py", old_string="y = 1", new_string="y = 5") == "edited pkg/m.py at line 2"
    # the sandbox's commands (another uid) see and may change what the file tools wrote
    assert tool(workspace, "shell", command="sed -i s/5/6/ pkg/m.py && cat pkg/m.py").endswith("x = 1\ny = 6\nz = 2")
    assert "    2  y = 6" in tool(workspace, "read_file", path="pkg/m.py", start_line=2, end_line=2)


def test_read_search_and_shell_outputs(workspace):
    long = "".join(f"row {i}\n" for i in range(1, 1001))
    tool(workspace, "write_file", path="long.txt", content=long)
    shown = tool(workspace, "read_file", path="long.txt")
    assert shown.startswith("long.txt: lines 1-400 of 1000") and "[lines 401-1000 not shown: read them with start_line=401]" in shown
    assert tool(workspace, "read_file", path="long.txt", start_line=999).endswith("  999  row 999\n 1000  row 1000")
    assert "has 1000 lines" in tool(workspace, "read_file", path="long.txt", start_line=2000)
    assert tool(workspace, "search", pattern="def has_close").startswith("solution.py:4:def has_close_elements")
    many = tool(workspace, "search", pattern="^row [0-9]+$", path="long.txt")
    assert many.count("\n") == 50 and "more than 50 matches" in many
    assert "no match" in tool(workspace, "search", pattern="zzz_absent")
    assert "error: grep:" in tool(workspace, "search", pattern="(")
    assert tool(workspace, "shell", command="echo out; echo err >&2; exit 3").startswith("[exit 3,")
    assert "[killed: timeout" in tool(workspace, "shell", command="sleep 30", timeout=1)


# --- the agent loop with tools -----------------------------------------------------------------


def test_scripted_tool_calls_that_fix_a_function_task_earn_full_reward(tok, env):
    trajectory, policy = run_episode(
        tok,
        env,
        [
            "I will read the file first. " + call("read_file", path="solution.py"),
            call("edit", path="solution.py", old_string='    True\n    """\n', new_string='    True\n    """\n' + HUMANEVAL_0)
            + call("run_tests"),
            call("finish"),
        ],
    )
    assert trajectory.reward == 1.0 and trajectory.info["end_reason"] == "finished" and trajectory.info["turns"] == 3
    assert trajectory.info["tool_calls"] == 4 and trajectory.info["tool_errors"] == 0
    assert "def has_close_elements" in policy.prompts[1] and "edited solution.py" in policy.prompts[2]
    assert "7/7 tests passed" in policy.prompts[2]
    [segment] = trajectory.segments
    trained = tok.decode(segment.token_ids[segment.loss_mask].tolist())
    assert "read_file" in trained and "has_close_elements(numbers" not in trained  # observations are not trained on
    assert (segment.logprobs[~segment.loss_mask] == 0).all() and (segment.logprobs[segment.loss_mask] == -0.25).all()


def test_an_episode_without_finish_is_graded_at_the_turn_limit(tok, env):
    rollout = TOOLS.model_copy(update={"max_turns": 2})
    fix = call("write_file", path="solution.py", content="def has_close_elements(numbers, threshold):\n" + HUMANEVAL_0)
    trajectory, _ = run_episode(tok, env, ["thinking", fix], rollout=rollout)
    assert trajectory.reward == 1.0 and trajectory.info["end_reason"] == "max_turns"
    trajectory, _ = run_episode(tok, env, [call("shell", command="rm solution.py"), call("finish")])
    assert trajectory.reward == 0.0 and trajectory.info["tests_total"] == 7


def test_malformed_calls_get_error_observations_and_the_episode_goes_on(tok, env):
    trajectory, policy = run_episode(
        tok,
        env,
        [
            "The answer is 4.",
            '<tool_call>{"name": "read_file", "arguments": {"path": </tool_call>',
            call("delete_everything") + call("read_file", path="solution.py", start_line="1"),
            call("finish", reason="done"),
            call("write_file", path="solution.py", content="def answer():\n    return 4\n")
            + call("finish")
            + call("shell", command="touch late"),
        ],
        task_index=(0, 0),
    )
    assert "No tool call found" in policy.prompts[1]
    assert "malformed JSON" in policy.prompts[2]
    assert "unknown tool 'delete_everything'" in policy.prompts[3] and "start_line must be an integer" in policy.prompts[3]
    assert "unknown argument reason" in policy.prompts[4]
    assert trajectory.info["end_reason"] == "finished" and trajectory.info["tool_errors"] == 5
    assert trajectory.info["tests_total"] == 4  # graded; the call after finish did not run
    from composer.rl.trajectories import episode_stats

    stats = episode_stats([trajectory], TOOLS.max_context)
    assert stats["tool_calls_per_episode"] == 7 and stats["tool_error_rate"] == 5 / 7


@pytest.mark.parametrize("observation_tokens", [None, 400])
def test_long_observations_are_cut_to_the_budget_with_a_note(tok, env, observation_tokens):
    """The budget is rollout.max_observation_tokens, or a reply's sampling.max_tokens when that is unset."""
    rollout = TOOLS.model_copy(update={"sampling": SamplingSection(max_tokens=128), "max_observation_tokens": observation_tokens})
    _, policy = run_episode(tok, env, [call("shell", command="seq 1 5000"), call("finish")], rollout=rollout)
    observation = policy.prompts[1][len(policy.prompts[0]) :].split("</tool_call>", 1)[1]
    assert "\n1\n2\n" in observation and observation.rstrip().endswith("5000\n</tool_response>")
    assert "lines) cut: redirect the output to a file" in observation
    budget = observation_tokens or 128
    assert budget - 64 < len(tok.encode(observation)) <= budget + 16


def test_self_summarization_keeps_working_with_tools(tok, env):
    from composer.rollout.agent.loop import SUMMARY_HEADER, SUMMARY_REQUEST

    rollout = TOOLS.model_copy(
        update={"max_context": 3072, "summarize_at": 0.5, "max_summaries": 4, "max_turns": 12, "sampling": SamplingSection(max_tokens=160)}
    )
    reads = [call("read_file", path="solution.py")] * 6
    fix = call("write_file", path="solution.py", content="def has_close_elements(numbers, threshold):\n" + HUMANEVAL_0)
    trajectory, policy = run_episode(tok, env, reads + [fix, call("finish")], rollout=rollout, summary="SUMMARY: solution.py needs a body.")
    assert trajectory.reward == 1.0 and trajectory.info["end_reason"] == "finished"
    assert trajectory.info["summaries"] >= 1 and len(trajectory.segments) == trajectory.info["summaries"] + 1
    prompt = policy.prompts[0]
    for before, after in zip(trajectory.segments, trajectory.segments[1:]):
        assert tok.decode(before.token_ids.tolist()).endswith(SUMMARY_REQUEST + "SUMMARY: solution.py needs a body.")
        restart = tok.decode(after.token_ids.tolist())
        assert restart.startswith(prompt + SUMMARY_HEADER + "SUMMARY: solution.py needs a body.\n<tool_response>")
        assert not after.loss_mask[: len(tok.encode(prompt))].any()
    assert all(len(s.token_ids) <= 3072 for s in trajectory.segments)


# --- chat templates ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tok(tmp_path_factory):
    """SmolLM2-135M-Instruct's real tokenizer and chat template (ChatML; it does not render `tools=`)."""
    from transformers import AutoTokenizer

    from composer.rollout.agent.harness import Tokenizer
    from composer.trainer.checkpoint_init import smollm2_gguf

    gguf = smollm2_gguf()
    out = tmp_path_factory.mktemp("smollm2")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return Tokenizer(str(out))


def test_a_template_without_tools_gets_the_plain_tool_guide_and_tool_turns(smollm2_tok, env):
    from composer.rollout.agent.harness import ChatFormat, plain_tool_guide

    chat = ChatFormat(smollm2_tok, chat_template=True, tools=True)
    assert not chat.template_tools
    rollout = TOOLS.model_copy(update={"chat_template": True})
    end = smollm2_tok.encode("<|im_end|>")
    trajectory, policy = run_episode(smollm2_tok, env, [call("read_file", path="solution.py"), call("finish")], rollout=rollout, end=end)
    tokens = trajectory.segments[0].token_ids.tolist()
    text = smollm2_tok._tok.decode(tokens)
    assert text.startswith("<|im_start|>system\nYou are a coding agent") and plain_tool_guide() in text
    # the reply ended with its end-of-turn token: only the newline after it is added, then the tool turn
    assert '"solution.py"}}</tool_call><|im_end|>\n<|im_start|>tool\nsolution.py: lines 1-11 of 11\n' in text
    assert text.endswith("</tool_call><|im_end|>") and trajectory.reward == 0.0
    assert text.count("<|im_end|>") == text.count("<|im_start|>")


def test_a_template_that_renders_tools_gets_the_schemas_through_it(tokenizer_dir, tmp_path, env):
    from transformers import AutoTokenizer

    from composer.rollout.agent.harness import TOOL_SCHEMAS, ChatFormat, Tokenizer, plain_tool_guide

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    hf.chat_template = HERMES_TEMPLATE
    hf.save_pretrained(tmp_path)
    tok = Tokenizer(str(tmp_path))
    assert ChatFormat(tok, chat_template=True, tools=True).template_tools
    rollout = TOOLS.model_copy(update={"chat_template": True})
    trajectory, policy = run_episode(tok, env, [call("run_tests") + call("run_tests"), call("finish")], rollout=rollout)
    text = policy.prompts[1]
    assert json.dumps(TOOL_SCHEMAS[0]) in text and plain_tool_guide() not in text
    observation = text[len(policy.prompts[0]) :].rsplit("</tool_call>", 1)[1]
    assert observation.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n[exit 1,")
    assert observation.count("<tool_response>") == 2 and observation.endswith("<|im_start|>assistant\n")


# --- the reply harness through the same loop ---------------------------------------------------


def test_replies_are_still_the_solution_without_tools(tok, env):
    rollout = RolloutSection(max_context=512, max_turns=3, sampling=SamplingSection(max_tokens=32))
    k = int(env.pool.task(0, 0).prompt.split()[1].rstrip("."))
    trajectory, policy = run_episode(tok, env, [str((k + 5) % 10), str(k)], task_index=(0, 0), rollout=rollout)
    assert "[Test results]\n2/4 tests passed" in policy.prompts[1]
    assert trajectory.reward == 1.0 and trajectory.info["end_reason"] == "solved" and trajectory.info["turns"] == 2


# --- repository tasks --------------------------------------------------------------------------

EGO = "networkx/generators/ego.py"
EGO_TESTS = "networkx/generators/tests/test_ego.py"
EGO_FIX = (
    "if distance is None:\n            sp, _ = nx.single_source_dijkstra(G, n",
    "if distance is not None:\n            sp, _ = nx.single_source_dijkstra(G, n",
)


@pytest.fixture(scope="module")
def repo_task(tmp_path_factory):
    """A networkx bug task made the way `composer env build` makes them (its seeded mutation `is not` -> `is` in
    ego_graph breaks test_ego_distance, test_ego still passes), without the build's survey of the whole project."""
    from composer.rollout.sandbox.isolation import installed_copies
    from composer.rollout.tasks.functions import Task
    from composer.rollout.tasks.repository.grading_policy import Scope
    from composer.rollout.tasks.repository.mutations import changed_module, mutations
    from composer.rollout.tasks.repository.task_set import project_bases
    from composer.rollout.tasks.repository.workspace import RepoTests

    root = tmp_path_factory.mktemp("repo")
    bases = project_bases(root / "cache", "networkx")
    source = (bases / "grading" / EGO).read_text()
    changed = [changed_module(source, m) for m in mutations(source, "bug", (bases / "grading" / EGO_TESTS).read_text())]
    [buggy] = [text for text in changed if text and EGO_FIX[0] in text]
    layer = root / "layer"
    (layer / EGO).parent.mkdir(parents=True)
    (layer / EGO).write_text(buggy)
    for path in [layer, *layer.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)  # the episode's commands run as other uids
    tests = RepoTests(
        packages=("networkx",),
        test_files=(EGO_TESTS,),
        fail_to_pass=(f"{EGO_TESTS}::TestGeneratorEgo::test_ego_distance",),
        pass_to_pass=(f"{EGO_TESTS}::TestGeneratorEgo::test_ego",),
        pytest_args=(),
        layer=layer,
        episode_base=bases / "episode",
        grading_base=bases / "grading",
        hidden=installed_copies("networkx"),
        timeout_s=60,
        scope=(Scope(EGO, ("ego_graph",)),),
    )
    prompt = f"You are working in a checkout of networkx at /sandbox. The test {tests.fail_to_pass[0]} fails. Fix the library."
    return Task(id="repo/networkx/bug/ego", family="repo", prompt=prompt, entry_point="", tests=tests)


REPO = TOOLS.model_copy(update={"max_context": 8192, "max_turns": 6, "sampling": SamplingSection(max_tokens=1024)})


def test_scripted_tool_calls_that_fix_a_repository_bug_earn_full_reward(tok, env, repo_task):
    from composer.rollout.agent.loop import EpisodeRunner

    policy = ScriptedPolicy(
        tok,
        [
            call("search", pattern="def ego_graph") + call("shell", command="python -c 'import networkx; print(networkx.__file__)'"),
            call("read_file", path=EGO, start_line=50, end_line=66),
            call("run_tests"),
            call("edit", path=EGO, old_string=EGO_FIX[0], new_string=EGO_FIX[1]) + call("run_tests"),
            call("finish"),
        ],
    )
    [trajectory] = EpisodeRunner(policy, tok, env, REPO).run_group(repo_task, "r", 1, 0, seed=0)
    assert f"{EGO}:" in policy.prompts[1] and "/sandbox/networkx/__init__.py" in policy.prompts[1]  # its own copy
    assert "if distance is None:" in policy.prompts[2]
    assert "1 failed, 1 passed" in policy.prompts[3] and "2 passed" in policy.prompts[4][len(policy.prompts[3]) :]
    assert trajectory.reward == 1.0 and trajectory.info["flags"] == [] and trajectory.info["end_reason"] == "finished"
    assert (trajectory.info["tests_passed"], trajectory.info["tests_total"]) == (2, 2)


SKIP_ALL = (
    "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n    for item in items:\n        item.add_marker(pytest.mark.skip)\n"
)


@pytest.mark.parametrize(
    "cheat",
    [
        call("shell", command=f"sed -i 's/assert /assert True or /' {EGO_TESTS}"),
        call("edit", path=EGO_TESTS, old_string="    def test_ego_distance(self):", new_string="    def _ego_distance(self):"),
        call("write_file", path="conftest.py", content=SKIP_ALL),
        call("write_file", path="networkx/conftest.py", content=SKIP_ALL)
        + call("edit", path=EGO, old_string=EGO_FIX[0], new_string=EGO_FIX[1]),  # a fix, but with a cheat
    ],
    ids=["edit-test", "delete-failing-test", "conftest-skips", "fix-and-conftest"],
)
def test_scripted_cheats_earn_nothing_and_are_flagged(tok, env, repo_task, cheat):
    from composer.rollout.agent.loop import EpisodeRunner

    policy = ScriptedPolicy(tok, [cheat + call("run_tests"), call("finish")])
    [trajectory] = EpisodeRunner(policy, tok, env, REPO).run_group(repo_task, "c", 1, 0, seed=0)
    visible = policy.prompts[1][len(policy.prompts[0]) :]
    assert "failed" not in visible.split("</tool_call>")[-1]  # the cheat fools the agent-visible test run ...
    assert trajectory.reward == 0.0 and "tests_modified" in trajectory.info["flags"]  # ... not the grade
