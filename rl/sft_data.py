"""SFT demonstrations -> token ids and a loss mask on the assistant's tokens, in the agent harness's own format.

Sources (`sft.sources`): chat JSONL (one `{"messages": [...]}` per line: OpenAI chat messages whose `tool_calls`
carry arguments as a JSON string, or the Hugging Face form with an object), the rewarded episodes (reward 1) of an
earlier RL run's `trajectories/`, and the references of the recipe's training tasks played as agent episodes
(`rl.sft_references`). A conversation is rendered as the harness renders an episode (`ChatFormat`: its
system message with the tools, the first user message as the task, each assistant turn's tool calls as
`<tool_call>{...}</tool_call>`, tool results as tool messages), so SFT teaches exactly the format RL then parses.
The loss covers each assistant turn's tokens and the end of its turn (tool calls included); the harness's system
message replaces a conversation's own. Everything is checked before anything is written: a malformed line, a
conversation without an assistant turn, a tool call whose arguments are not JSON or that the harness would refuse
end in one message naming the file and line.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from composer.recipes.errors import UserError
from composer.recipes.schema import Recipe, SftSource
from composer.rl.trajectories import decode_group
from composer.rollout.agent.harness import CALL_CLOSE, CALL_OPEN, CallError, ChatFormat, Tokenizer, parse_tool_calls
from composer.runtime.sft_examples import SftExamples, TokenizedConversations
from composer.trainer.sft import packing_summary

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")


@dataclass
class SourceCounts:
    conversations: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    cut: int = 0
    dropped: int = 0
    skipped: int = 0
    """Tasks without a reference that passes its own tests in the harness (references sources)."""
    observations_cut: int = 0
    """Tool outputs cut to `sft.max_observation_tokens` (references sources)."""


def _files(source: SftSource, suffixes: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for pattern in source.paths:
        matches = sorted(glob.glob(pattern, recursive=True)) or [pattern]
        for match in map(Path, matches):
            if match.is_dir():
                files += sorted(p for p in match.rglob("*") if p.is_file() and p.name.endswith(suffixes))
            elif match.is_file():
                files.append(match)
            else:
                raise UserError(f"sft.sources {source.name!r}: {pattern} matches no file or directory")
    if not files:
        raise UserError(f"sft.sources {source.name!r}: no {' / '.join(suffixes)} file under {', '.join(source.paths)}")
    return files


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
        elif path.name.endswith(".zst"):
            raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
        text = raw.decode()
    except (OSError, EOFError, zlib.error, zstandard.ZstdError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read it ({e})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            yield number, line


def _tool_call_text(call: object, where: str) -> str:
    """One OpenAI / HF tool call as the harness's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise UserError(f'{where}: a tool call needs {{"function": {{"name": ..., "arguments": ...}}}}')
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise UserError(
                f"{where}: the arguments of tool call {function['name']!r} are not JSON ({e.msg} at character {e.pos})"
            ) from None
    if not isinstance(arguments, dict):
        raise UserError(f"{where}: the arguments of tool call {function['name']!r} are not a JSON object")
    return f"{CALL_OPEN}{json.dumps({'name': function['name'], 'arguments': arguments})}{CALL_CLOSE}"


def _reply_text(message: dict, where: str) -> str:
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise UserError(f"{where}: an assistant message's content must be text")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise UserError(f"{where}: tool_calls must be a list")
    text = "\n".join(
        [content.strip(), *(_tool_call_text(c, where) for c in calls)] if content.strip() else [_tool_call_text(c, where) for c in calls]
    )
    for problem in (c for c in parse_tool_calls(text) if isinstance(c, CallError)):
        raise UserError(f"{where}: the harness would refuse a tool call: {problem.message}")
    return text


class ConversationRenderer:
    """Messages -> (token ids, loss mask) through the harness's `ChatFormat`."""

    def __init__(self, tokenizer_dir: str, chat_template: bool, trust_remote_code: bool = False):
        from transformers import AutoTokenizer

        self.tok = Tokenizer(tokenizer_dir, trust_remote_code)
        hf = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
        self.chat_template = chat_template
        # the plain format has no end-of-turn marker: the end-of-sequence token ends a reply (the engine stops there)
        self.end_of_reply = [] if chat_template or hf.eos_token_id is None else [hf.eos_token_id]
        self.pad = hf.pad_token_id if hf.pad_token_id is not None else (hf.eos_token_id or 0)
        self.vocab_size = len(hf)
        self.format = ChatFormat(self.tok, chat_template, tools=True)

    def render(self, messages: object, where: str) -> tuple[list[int], list[bool]]:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise UserError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
        turns = [m for m in messages if m["role"] != "system"]
        if not any(m["role"] == "assistant" for m in turns):
            raise UserError(f"{where}: the conversation has no assistant turn (nothing to train on)")
        if not turns or turns[0]["role"] != "user" or not isinstance(turns[0].get("content"), str):
            raise UserError(f"{where}: the conversation must open with a user message (the task)")
        tokens = self.format.prompt(turns[0]["content"])
        mask = [False] * len(tokens)
        names: dict[str, str] = {}
        i = 1
        while i < len(turns):
            message = turns[i]
            if message["role"] != "assistant":
                raise UserError(f"{where}: message {i + 1} ({message['role']}) comes where an assistant turn belongs")
            for call in message.get("tool_calls") or []:
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    names[call["id"]] = (call.get("function") or {}).get("name", "tool")
            reply = self.tok.encode(_reply_text(message, where)) + self.end_of_reply
            after: list[dict] = []
            i += 1
            while i < len(turns) and turns[i]["role"] in ("tool", "user"):
                m = turns[i]
                content = m.get("content")
                if not isinstance(content, str):
                    raise UserError(f"{where}: message {i + 1} ({m['role']}) needs text content")
                after.append(
                    {"role": "tool", "name": m.get("name") or names.get(m.get("tool_call_id"), "tool"), "content": content}
                    if m["role"] == "tool"
                    else {"role": "user", "content": content}
                )
                i += 1
            closing, following = self.format.after_reply(reply, after or [{"role": "user", "content": ""}])
            tokens += reply + closing
            mask += [True] * (len(reply) + len(closing))
            if after:
                tokens += following
                mask += [False] * len(following)
        return tokens, mask


def _chat_conversations(source: SftSource, renderer: ConversationRenderer) -> Iterator[tuple[str, list[int], list[bool]]]:
    for path in _files(source, JSONL_SUFFIXES):
        for number, line in _lines(path):
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: not JSON ({e.msg} at character {e.pos})") from None
            if not isinstance(record, dict) or "messages" not in record:
                raise UserError(f'{where}: expected an object with "messages"')
            yield (where, *renderer.render(record["messages"], where))


def _rewarded_episodes(source: SftSource, renderer: ConversationRenderer) -> Iterator[tuple[str, list[int], list[bool]]]:
    roots = [Path(p) for pattern in source.paths for p in (sorted(glob.glob(pattern)) or [pattern])]
    files = []
    for root in roots:
        base = root / "trajectories" if (root / "trajectories").is_dir() else root
        if not base.is_dir():
            raise UserError(f"sft.sources {source.name!r}: {root} is not an RL run directory or its trajectories/")
        files += sorted(base.rglob("*.traj"))
    if not files:
        raise UserError(f"sft.sources {source.name!r}: no trajectory files under {', '.join(source.paths)}")
    for path in files:
        for trajectory in decode_group(path.read_bytes(), str(path)):
            if trajectory.reward != 1.0:
                continue
            for k, segment in enumerate(trajectory.segments):
                where = f"{path}: episode {trajectory.id} segment {k}"
                if len(segment.token_ids) and int(segment.token_ids.max()) >= renderer.vocab_size:
                    raise UserError(f"{where}: token ids beyond this tokenizer's vocabulary (an episode of another model?)")
                yield where, segment.token_ids.tolist(), segment.loss_mask.tolist()


def _reference_episodes(
    recipe: Recipe, renderer: ConversationRenderer, counts: SourceCounts
) -> Iterator[tuple[str, list[int], list[bool]]]:
    import tempfile
    import threading

    from composer.rl.sft_references import reference_episodes, whole
    from composer.rollout.agent.environment import CodingEnvironment
    from composer.rollout.agent.harness import ToolBox, observation_share, truncate

    env_section = recipe.env
    observe = whole
    if recipe.sft.max_observation_tokens is not None:  # as the harness cuts a reply's one call in RL
        share = observation_share(recipe.sft.max_observation_tokens, 1, renderer.format.tool_message_overhead())
        counting = threading.Lock()  # the episodes play on the sandbox's threads

        def observe(text: str, more: str) -> str:
            shown = truncate(text, share, renderer.tok, more)
            if shown != text:
                with counting:
                    counts.observations_cut += 1
            return shown

    with tempfile.TemporaryDirectory(prefix="composer-sft-") as scratch:
        env = CodingEnvironment(env_section, seed=recipe.train.seed, sandbox_root=Path(scratch), ssh=recipe.cluster.ssh)
        try:
            for where, messages in reference_episodes(env, ToolBox(env_section.sandbox.wall_seconds), observe):
                if messages is None:
                    counts.skipped += 1
                    continue
                yield (where, *renderer.render(messages, where))
        finally:
            env.close()


def prepare_sft_examples(recipe: Recipe, console=None) -> SftExamples:
    """Every source rendered, checked, cut or refused, and split into train and held-out (nothing is written)."""
    sft, model = recipe.sft, recipe.model
    if not model.checkpoint:
        raise UserError("train sft: model.checkpoint is required (its tokenizer renders the conversations)")
    if not Path(model.checkpoint).is_dir():
        raise UserError(f"model.checkpoint {model.checkpoint}: no such directory (SFT renders the conversations with its tokenizer here)")
    try:
        renderer = ConversationRenderer(model.checkpoint, sft.chat_template, model.trust_remote_code)
    except UserError:
        raise
    except Exception as e:  # transformers raises many kinds for a directory it cannot read
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"model.checkpoint {model.checkpoint}: cannot read its tokenizer ({reason})") from None
    conversations: list[tuple[list[int], list[bool]]] = []
    counts: dict[str, SourceCounts] = {}
    for source in sft.sources:
        c = counts[source.name] = SourceCounts()
        if source.kind == "references":
            conversations_of = _reference_episodes(recipe, renderer, c)
        else:
            conversations_of = (_chat_conversations if source.kind == "chat" else _rewarded_episodes)(source, renderer)
        for where, tokens, mask in conversations_of:
            if len(tokens) > sft.max_length:
                if sft.overlong == "refuse":
                    raise UserError(
                        f"{where}: {len(tokens)} tokens exceed sft.max_length={sft.max_length} (sft.overlong: refuse; "
                        "set sft.overlong: cut to keep the first max_length tokens)"
                    )
                tokens, mask = tokens[: sft.max_length], mask[: sft.max_length]
                c.cut += 1
                if not any(mask[1:]):  # the first token is never a label
                    c.dropped += 1
                    continue
            c.conversations += 1
            c.tokens += len(tokens)
            c.assistant_tokens += sum(mask[1:])
            conversations.append((tokens, mask))
        if c.conversations == 0:
            raise UserError(
                f"sft.sources {source.name!r}: no conversation to train on ({c.dropped} dropped: no assistant token within "
                f"sft.max_length; {c.skipped} task(s) skipped: no reference that earns 1.0 in the harness)"
            )
    n = len(conversations)
    order = np.random.default_rng(recipe.train.seed).permutation(n)
    held = max(1, round(n * sft.held_out))
    if held >= n:
        raise UserError(f"sft.held_out={sft.held_out} leaves nothing to train on: {n} conversation(s) in all")
    valid = {int(i) for i in order[:held]}
    train = TokenizedConversations.of([conv for i, conv in enumerate(conversations) if i not in valid])
    packing = packing_summary(train, sft.max_length, recipe.train.seed, sft.pack)
    summary = {
        "sources": {name: vars(c) for name, c in counts.items()},
        "train": n - held,
        "held_out": held,
        "max_length": sft.max_length,
        "overlong": sft.overlong,
        "packing": packing,
    }
    examples = SftExamples(
        train,
        TokenizedConversations.of([conv for i, conv in enumerate(conversations) if i in valid]),
        renderer.pad,
        str(model.checkpoint),
        summary,
    )
    if console is not None:
        source_kinds = {s.name: s.kind for s in sft.sources}
        for name, c in counts.items():
            console.print(
                f"sft source {name}: {c.conversations} conversations, {c.tokens} tokens ({c.assistant_tokens} trained on); "
                f"cut to sft.max_length={sft.max_length}: {c.cut}, dropped: {c.dropped}"
                + (f", tasks skipped (no passing reference): {c.skipped}" if source_kinds[name] == "references" else "")
                + (
                    f", tool outputs cut to sft.max_observation_tokens={sft.max_observation_tokens}: {c.observations_cut}"
                    if source_kinds[name] == "references" and sft.max_observation_tokens is not None
                    else ""
                ),
                highlight=False,
            )
        console.print(f"sft: {n - held} conversations for training, {held} held out", highlight=False)
        console.print(
            f"sft samples: {packing['samples']} of {sft.max_length} positions in a pass, "
            f"{packing['conversations_per_sample']:.2f} conversations each, {packing['real_share']:.0%} of positions real tokens"
            + (f" (one conversation a sample: {packing['real_share_unpacked']:.0%}; sft.pack: true)" if sft.pack else " (sft.pack: false)"),
            highlight=False,
        )
    return examples
