"""The agent harness: a coding agent's tools as structured tool calls in the policy's chat template.

The policy calls tools the way instruct models are trained to (Hermes / Qwen / SmolLM2 style):
`<tool_call>{"name": "read_file", "arguments": {"path": "solution.py"}}</tool_call>`, any number per reply. The tools
(`TOOL_SCHEMAS`): read a file (line ranges), search (grep -E), edit (exact string replace), write a file, run a shell
command, run the tests, finish. They act on a `Workspace` (rollout.tasks.workspace): file tools on its host directory,
never outside it (no absolute paths, no `..`, no symlinks: every component is opened with O_NOFOLLOW under the root's
descriptor); search, shell and tests in the sandbox. A malformed call (bad JSON, unknown tool, missing, extra or
mistyped arguments) is answered with an error observation, never an exception. Each result comes back as a tool
message of the chat template, cut to the observation budget with a note saying how much was cut and how to see it.

The schemas reach the policy through the template's `tools=` when it renders them (Qwen-style templates), else in the
plain format of `plain_tool_guide` inside the system message (SmolLM2's template, or no template at all).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer.recipes.errors import UserError
from composer.rollout.sandbox.results import CommandResult
from composer.rollout.tasks.files import PathRefused, workspace_relative
from composer.rollout.tasks.workspace import Workspace

MAX_CALLS_PER_REPLY = 8
MAX_READ_LINES = 400
MAX_SEARCH_MATCHES = 50

SYSTEM_PROMPT = (
    "You are a coding agent working in a workspace directory. Use the tools to read, search and change "
    "files, run commands and run the tests; call finish when the task is done."
)

TOOL_SCHEMAS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the workspace, with line numbers (at most 400 lines per call).",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "path relative to the workspace"},
                    "start_line": {"type": "integer", "description": "first line to show (1-based; default 1)"},
                    "end_line": {"type": "integer", "description": "last line to show (inclusive; default: the end)"},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the workspace's files for a regular expression (grep -E); shows at most 50 matching lines.",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string", "description": "extended regular expression"},
                    "path": {"type": "string", "description": "file or directory to search, relative to the workspace (default: all)"},
                },
                "required": ["pattern"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit",
            "description": "Replace the exact text old_string, which must occur exactly once in the file, by new_string.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "path relative to the workspace"},
                    "old_string": {"type": "string", "description": "text to replace, exactly as in the file (no line numbers)"},
                    "new_string": {"type": "string", "description": "replacement text"},
                },
                "required": ["path", "old_string", "new_string"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Create or overwrite a file with the given content.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "path relative to the workspace"},
                    "content": {"type": "string", "description": "the whole new content of the file"},
                },
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a bash command in the workspace directory (sandboxed, no network) and show its exit code and output.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "the bash command"},
                    "timeout": {
                        "type": "integer",
                        "description": "seconds before it is killed (default and most: the sandbox's wall-clock limit)",
                    },
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the task's tests on the workspace and show the results.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "End the episode: the workspace as it is now is graded.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    },
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOL_SCHEMAS)
_SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
_JSON_TYPES = {"string": (str,), "integer": (int,), "boolean": (bool,)}


def plain_tool_guide() -> str:
    """The tools and the call format, for a template that cannot render `tools=` (or no template)."""
    lines = ['Tools (call one or more per reply, each as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>):']
    for tool in TOOL_SCHEMAS:
        f = tool["function"]
        props, required = f["parameters"]["properties"], f["parameters"]["required"]
        args = ", ".join(f"{k}: {v['type']}{'' if k in required else ' (optional)'}" for k, v in props.items())
        lines.append(f"- {f['name']}({args}): {f['description']}")
    lines.append('Example: <tool_call>{"name": "read_file", "arguments": {"path": "solution.py"}}</tool_call>')
    return "\n".join(lines)


# --- parsing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    """A call the harness cannot run, and why (shown to the policy)."""

    message: str


CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_JSON_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def parse_tool_calls(reply: str) -> list[ToolCall | CallError]:
    """Every `<tool_call>...</tool_call>` of a reply in order (text around them is ignored), each checked against its
    schema; an empty list when there is none."""
    # Split at each opening tag: a call whose closing tag is missing ends where the next one opens.
    bodies = [chunk.split(CALL_CLOSE, 1)[0] for chunk in reply.split(CALL_OPEN)[1:]]
    return [_parse_call(body.strip(), number) for number, body in enumerate(bodies, 1)]


def _parse_call(body: str, number: int) -> ToolCall | CallError:
    where = f"tool call {number}"
    if fenced := _JSON_FENCE.match(body):
        body = fenced.group(1)
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return CallError(
            f"{where}: malformed JSON ({e.msg} at character {e.pos}); write "
            '{"name": TOOL, "arguments": {...}} between <tool_call> and </tool_call>'
        )
    except RecursionError:
        return CallError(f"{where}: JSON nested too deeply")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return CallError(f'{where}: expected a JSON object {{"name": TOOL, "arguments": {{...}}}}')
    name = call["name"]
    if name not in _SCHEMA:
        return CallError(f"{where}: unknown tool {name!r}; the tools are {', '.join(TOOL_NAMES)}")
    extra_keys = sorted(set(call) - {"name", "arguments"})
    if extra_keys:
        return CallError(f'{where} ({name}): unexpected keys {extra_keys}; put the tool\'s arguments under "arguments"')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string (OpenAI's wire format)
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError) as e:
            return CallError(f"{where} ({name}): arguments are a string that is not JSON ({getattr(e, 'msg', 'nested too deeply')})")
    if not isinstance(arguments, dict):
        return CallError(f'{where} ({name}): "arguments" must be a JSON object')
    problem = _argument_problem(name, arguments)
    return CallError(f"{where} ({name}): {problem}") if problem else ToolCall(name, arguments)


def _argument_problem(name: str, arguments: dict) -> str | None:
    schema = _SCHEMA[name]
    props = schema["properties"]
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        accepted = ", ".join(props) or "none"
        return f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (accepted: {accepted})"
    missing = [k for k in schema["required"] if k not in arguments]
    if missing:
        return f"missing required argument{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    for key, value in arguments.items():
        kind = props[key]["type"]
        if not isinstance(value, _JSON_TYPES[kind]) or (kind == "integer" and isinstance(value, bool)):
            return f"argument {key} must be a{'n' if kind[0] in 'aeiou' else ''} {kind}, not {type(value).__name__}"
        if isinstance(value, str) and not _is_text(value):
            return f"argument {key} must be text: no NUL characters or unpaired surrogates (\\u0000, \\ud800)"
    return None


def _is_text(value: str) -> bool:
    """UTF-8 text a file, a command line or a pattern can hold (JSON allows "\\u0000" and lone surrogates)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in value


# --- the tools ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolOutput:
    text: str
    more: str = ""
    """How to see what a truncation cuts from `text`."""
    finished: bool = False


class ToolBox:
    """Runs checked tool calls on a workspace; every failure is an output for the policy, never an exception."""

    def __init__(self, shell_seconds: float):
        self.shell_seconds = shell_seconds

    def call(self, workspace: Workspace, call: ToolCall) -> ToolOutput:
        handler: Callable[..., ToolOutput] = getattr(self, f"_{call.name}")
        try:
            return handler(workspace, **call.arguments)
        except (PathRefused, FileNotFoundError) as e:
            return ToolOutput(f"error: {e}")
        except OSError as e:
            return ToolOutput(f"error: {e.strerror or e}")

    def _read_file(self, ws: Workspace, path: str, start_line: int = 1, end_line: int | None = None) -> ToolOutput:
        lines = ws.read_file(path).splitlines()
        if start_line < 1 or (end_line is not None and end_line < start_line):
            return ToolOutput("error: lines are numbered from 1, and end_line must not be before start_line")
        if lines and start_line > len(lines):
            return ToolOutput(f"error: {path} has {len(lines)} lines")
        last = min(len(lines), end_line or len(lines), start_line + MAX_READ_LINES - 1)
        shown = "\n".join(f"{n:>5}  {lines[n - 1]}" for n in range(start_line, last + 1))
        header = f"{path}: lines {start_line}-{last} of {len(lines)}" if lines else f"{path}: empty"
        rest = (
            f"\n[lines {last + 1}-{len(lines)} not shown: read them with start_line={last + 1}]"
            if last < min(len(lines), end_line or len(lines))
            else ""
        )
        return ToolOutput(f"{header}\n{shown}{rest}", more=f"read a shorter range of {path} with start_line and end_line")

    def _search(self, ws: Workspace, pattern: str, path: str = ".") -> ToolOutput:
        where = "/".join(workspace_relative(path)) or "."
        # Without a path grep -r searches the working directory and names files without a leading ./
        command = (
            f"grep -rnIE --color=never --exclude-dir=.git --exclude-dir=__pycache__ -e {shlex.quote(pattern)} "
            f"{'' if where == '.' else '-- ' + shlex.quote(where)} | head -n {MAX_SEARCH_MATCHES + 1}"
        )
        result = ws.shell(command, self.shell_seconds)
        lines = [line for line in result.output.splitlines() if line.strip()]
        if result.status != "ok" and not lines:
            return ToolOutput(f"error: search {result.status}")
        if not lines:
            return ToolOutput(f"no match for {pattern!r} in {where}")
        if lines[0].startswith("grep:") and len(lines) == 1:
            return ToolOutput(f"error: {lines[0]}")
        note = f"\n[more than {MAX_SEARCH_MATCHES} matches: narrow the pattern or the path]" if len(lines) > MAX_SEARCH_MATCHES else ""
        return ToolOutput("\n".join(lines[:MAX_SEARCH_MATCHES]) + note, more="narrow the pattern or the path")

    def _edit(self, ws: Workspace, path: str, old_string: str, new_string: str) -> ToolOutput:
        if not old_string:
            return ToolOutput("error: old_string is empty; to create a file use write_file")
        if old_string == new_string:
            return ToolOutput("error: old_string and new_string are the same")
        text = ws.read_file(path)
        count = text.count(old_string)
        if count == 0:
            return ToolOutput(
                f"error: old_string does not occur in {path}; read the file and copy the text exactly "
                "(whitespace included, without line numbers)"
            )
        if count > 1:
            starts = [m.start() for m in re.finditer(re.escape(old_string), text)]
            at = ", ".join(str(text.count("\n", 0, s) + 1) for s in starts[:10])
            return ToolOutput(
                f"error: old_string occurs {count} times in {path} (lines {at}); include more of the "
                "surrounding text so that it occurs once"
            )
        ws.write_file(path, text.replace(old_string, new_string, 1))
        line = text.count("\n", 0, text.index(old_string)) + 1
        return ToolOutput(f"edited {path} at line {line}")

    def _write_file(self, ws: Workspace, path: str, content: str) -> ToolOutput:
        ws.write_file(path, content)
        return ToolOutput(f"wrote {path} ({content.count(chr(10)) + (not content.endswith(chr(10)) and bool(content))} lines)")

    def _shell(self, ws: Workspace, command: str, timeout: int | None = None) -> ToolOutput:
        seconds = self.shell_seconds if timeout is None else min(max(timeout, 1), self.shell_seconds)
        return ToolOutput(
            command_text(ws.shell(command, seconds)),
            more="redirect the output to a file and read parts of it, or filter it (grep, head, tail)",
        )

    def _run_tests(self, ws: Workspace) -> ToolOutput:
        return ToolOutput(command_text(ws.run_tests()), more="run a subset of the tests with the shell tool")

    def _finish(self, ws: Workspace) -> ToolOutput:
        return ToolOutput("finished: the workspace is graded as it is", finished=True)


def command_text(result: CommandResult) -> str:
    if result.exit_code is None:
        head = f"[killed: {result.status}, {result.wall_seconds:.1f} s]"
    else:
        head = f"[exit {result.exit_code}, {result.wall_seconds:.1f} s]"
    return f"{head}\n{result.output.rstrip()}" if result.output.strip() else f"{head} (no output)"


# --- rendering ---------------------------------------------------------------------------------


def tokenizer_code(model_dir: str | Path) -> str | None:
    """The Python class a checkpoint ships for its tokenizer (tokenizer_config.json `auto_map`, as Kimi's tiktoken
    tokenizer `tokenization_kimi.TikTokenTokenizer`), if any."""
    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    auto = (
        config.get("auto_map", {}).get("AutoTokenizer") if isinstance(config, dict) and isinstance(config.get("auto_map"), dict) else None
    )
    classes = [c for c in (auto if isinstance(auto, list) else [auto]) if isinstance(c, str)]
    return classes[0] if classes else None


def check_tokenizer_code(model_dir: str | Path, trust_remote_code: bool) -> None:
    code = tokenizer_code(model_dir)
    if code and not trust_remote_code:
        raise UserError(
            f"{model_dir}: its tokenizer is Python code it ships ({code}, named by tokenizer_config.json); "
            "set model.trust_remote_code: true to run it"
        )


class Tokenizer:
    """Text <-> token ids with an HF tokenizer, never adding special tokens inside an episode. A checkpoint's own
    tokenizer code (Kimi's tiktoken tokenizer) runs only with `trust_remote_code`; everything loads offline from
    `model_dir`."""

    def __init__(self, model_dir: str, trust_remote_code: bool = False):
        from transformers import AutoTokenizer

        check_tokenizer_code(model_dir, trust_remote_code)
        self._tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tok.chat_template)

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False) -> str:
        """`messages` in the tokenizer's chat template (with the tool schemas where it renders `tools`)."""
        return self._tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def truncate(text: str, max_tokens: int, tok: Tokenizer, more: str) -> str:
    """`text` cut to about `max_tokens` tokens, its start and its end kept (errors are at the end), with a note
    saying how many characters and lines were cut and how to see them."""
    ids = tok.encode(text)
    if len(ids) <= max_tokens:
        return text
    note_room = 40  # the note's own tokens
    keep = max(max_tokens - note_room, 2)
    head, tail = tok.decode(ids[: keep // 3]), tok.decode(ids[len(ids) - (keep - keep // 3) :])
    # (a token boundary inside a multi-byte character decodes to a replacement character: lengths are approximate there)
    cut = text[len(head) : max(len(text) - len(tail), len(head))]
    note = f"\n[... {len(cut)} characters ({cut.count(chr(10))} lines) cut{': ' + more if more else ''} ...]\n"
    return head + note + tail


class ChatFormat:
    """Conversation <-> tokens for an episode that only ever grows: the prompt, the end of each reply, the tool
    and user messages after it and the opening of the next reply, each rendered once and appended.

    `chat_template`: the tokenizer's chat template (its `tools=` when it renders them, else the plain tool guide in the
    system message); off: a plain format of the same conversation, for base models without a template."""

    _MARK = "\u2063REPLY\u2063"

    def __init__(self, tok: Any, chat_template: bool, tools: bool):
        self.tok = tok
        self.chat_template = chat_template
        self.tools = tools
        if chat_template and not tok.has_chat_template:
            raise UserError("rollout.chat_template: the policy's tokenizer has no chat template")
        self.template_tools = chat_template and tools and self._renders_tools()
        self._base: tuple[list[dict], str, list[int]] | None = None

    def _renders_tools(self) -> bool:
        messages = [{"role": "user", "content": "x"}]
        return self.tok.render(messages, tools=TOOL_SCHEMAS) != self.tok.render(messages)

    def _system(self) -> str:
        if not self.tools:
            return ""
        return SYSTEM_PROMPT if self.template_tools else f"{SYSTEM_PROMPT}\n\n{plain_tool_guide()}"

    def _head(self, user: str) -> list[dict]:
        system = self._system()
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]

    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.tok.render(messages, tools=TOOL_SCHEMAS if self.template_tools else None, add_generation_prompt=generation)

    def prompt(self, task_prompt: str) -> list[int]:
        """The system message (tools) and the task as the user's message, then the opening of the first reply."""
        if not self.chat_template:
            system = self._system()
            return self.tok.encode(f"{system}\n\n{task_prompt}\n" if system else task_prompt)
        return self.tok.encode(self._render(self._head(task_prompt), generation=True))

    def after_reply(self, reply_ids: list[int], messages: list[dict]) -> tuple[list[int], list[int]]:
        """What follows a reply: (the end of its turn that the policy did not write, `messages` (tool or user
        messages) then the opening of the next reply)."""
        if not self.chat_template:
            parts = [
                f"\n<tool_response>\n{m['content']}\n</tool_response>" if m["role"] == "tool" else f"\n\n{m['content']}" for m in messages
            ]
            return [], self.tok.encode("".join(parts) + "\n")
        if self._base is None:
            base = self._head("task") + [{"role": "assistant", "content": self._MARK}]
            before = self._render(base, generation=False)
            self._base = (base, before, self.tok.encode(before[before.rindex(self._MARK) + len(self._MARK) :]))
        base, before, closing = self._base
        after = self._render(base + messages, generation=True)
        if not after.startswith(before):
            raise UserError(
                "rollout.chat_template: the policy's chat template re-renders earlier turns when messages "
                "are added; the harness needs one that only appends"
            )
        return self._rest_of(closing, reply_ids), self.tok.encode(after[len(before) :])

    def tool_message_overhead(self) -> int:
        """Tokens the format adds around a tool message, the opening of the next reply included (an upper bound)."""
        empty = {"role": "tool", "name": "t", "content": ""}
        one, two = (len(self.after_reply([], [empty] * n)[1]) for n in (1, 2))
        return max(one, two - one)

    @staticmethod
    def _rest_of(closing: list[int], reply_ids: list[int]) -> list[int]:
        """The part of the turn's closing tokens the reply did not already end with (a reply stopped at its end-of-turn
        token carries it)."""
        for k in range(min(len(closing), len(reply_ids)), 0, -1):
            if reply_ids[-k:] == closing[:k]:
                return closing[k:]
        return closing


@dataclass(frozen=True)
class TurnResult:
    """The harness's answer to one reply: the messages to show, and whether the policy called finish."""

    messages: list[dict]
    finished: bool
    calls: int
    errors: int
    malformed: int = 0
    """Calls the harness could not parse or that its schemas refuse (among `calls`)."""
    tests_run: int = 0
    """run_tests calls that ran."""


def observation_share(budget_tokens: int, outputs: int, message_overhead: int) -> int:
    """Tokens each of a reply's `outputs` tool outputs is cut to: its share of the budget, less the format's own."""
    return max(budget_tokens // outputs - message_overhead, 8)


def run_reply(
    reply: str, workspace: Workspace, toolbox: ToolBox, tok: Tokenizer, budget_tokens: int, message_overhead: int = 0
) -> TurnResult:
    """Run the tool calls of one reply in order, up to finish; their outputs as tool messages, each cut to its share of
    `budget_tokens` (less the `message_overhead` tokens the chat format adds to each)."""
    calls = parse_tool_calls(reply)
    if not calls:
        text = (
            'No tool call found in your reply. Call a tool as <tool_call>{"name": TOOL, "arguments": {...}}'
            "</tool_call>; call finish when the task is done."
        )
        return TurnResult([{"role": "user", "content": text}], finished=False, calls=0, errors=1)
    outputs: list[tuple[str, ToolOutput]] = []
    errors = 0
    for call in calls[:MAX_CALLS_PER_REPLY]:
        if isinstance(call, CallError):
            errors += 1
            outputs.append(("error", ToolOutput(f"error: {call.message}")))
            continue
        output = toolbox.call(workspace, call)
        errors += output.text.startswith("error:")
        outputs.append((call.name, output))
        if output.finished:
            break
    finished = any(o.finished for _, o in outputs)
    if len(calls) > MAX_CALLS_PER_REPLY and not finished:
        outputs.append(
            (
                "error",
                ToolOutput(f"error: only {MAX_CALLS_PER_REPLY} tool calls run per reply; {len(calls) - MAX_CALLS_PER_REPLY} were not run"),
            )
        )
    share = observation_share(budget_tokens, len(outputs), message_overhead)
    messages = [{"role": "tool", "name": name, "content": truncate(o.text, share, tok, o.more)} for name, o in outputs]
    malformed = sum(isinstance(c, CallError) for c in calls)
    tests_run = sum(name == "run_tests" for name, _ in outputs)
    return TurnResult(messages, finished=finished, calls=len(calls), errors=errors, malformed=malformed, tests_run=tests_run)
