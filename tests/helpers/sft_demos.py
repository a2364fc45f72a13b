"""Demonstration conversations in the chat JSONL convention, as a user's SFT source holds them."""

from __future__ import annotations

import json
from pathlib import Path


def demonstration(k: int, openai: bool = True) -> dict:
    """An agent episode on a one-line task: write the solution, run the tests, finish. `openai`: tool-call arguments
    as a JSON string with ids (OpenAI); else as an object (the Hugging Face form)."""

    def call(i: int, name: str, arguments: dict) -> dict:
        function = {"name": name, "arguments": json.dumps(arguments) if openai else arguments}
        return {"id": f"call_{k}_{i}", "type": "function", "function": function} if openai else {"type": "function", "function": function}

    def result(i: int, name: str, content: str) -> dict:
        return (
            {"role": "tool", "tool_call_id": f"call_{k}_{i}", "content": content}
            if openai
            else {"role": "tool", "name": name, "content": content}
        )

    return {
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": f"Write solution.py defining answer() that returns {k}."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [call(0, "write_file", {"path": "solution.py", "content": f"def answer():\n    return {k}\n"})],
            },
            result(0, "write_file", "wrote solution.py (1 line)"),
            {"role": "assistant", "content": None, "tool_calls": [call(1, "run_tests", {})]},
            result(1, "run_tests", "1 passed"),
            {"role": "assistant", "content": "Done.", "tool_calls": [call(2, "finish", {})]},
        ]
    }


def write_demonstrations(path: Path, count: int, openai: bool = True, start: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(demonstration(start + k, openai)) + "\n" for k in range(count)))
    return path


def tiny_tokenizer(out: Path) -> Path:
    """A byte-level BPE tokenizer trained in a moment on the demonstrations and the harness's tool guide (no model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from composer.rollout.agent.harness import SYSTEM_PROMPT, plain_tool_guide

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [SYSTEM_PROMPT, plain_tool_guide(), *(json.dumps(demonstration(k)) for k in range(20))]
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    return out
