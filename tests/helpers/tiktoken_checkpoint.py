"""A checkpoint tokenizer shipped as the checkpoint's own tiktoken code, as Kimi-K2 / K2.5 ship theirs, made here.

Kimi's directory holds `tiktoken.model` (base64 token bytes and rank per line), a Python tokenizer class over
tiktoken (`tokenization_kimi.py`, named by tokenizer_config.json `auto_map`) and a chat template with its role
tokens; no tokenizer.json. `write_tiktoken_tokenizer` writes the same kinds of files: a byte-pair encoding
trained with tiktoken's own trainer on a little standard-library source, a small tokenizer class written for this
test (not Kimi's), special tokens after the ranks, and a chat template in the same role-token style.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set role = 'tool' if m.role == 'tool' else m.role -%}"
    "<|im_{{ 'system' if m.role in ['system', 'tool'] else m.role }}|>{{ role }}<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
TOKENIZER_CODE = (
    '''
"""A tokenizer over tiktoken: token strings are their bytes read as latin-1 (a bijection)."""

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

PATTERN = %r


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, **kwargs):
        self.vocab_file = vocab_file
        self.encoding = tiktoken.Encoding("checkpoint", pat_str=PATTERN, mergeable_ranks=load_tiktoken_bpe(vocab_file), special_tokens={})
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return self.encoding.n_vocab

    def get_vocab(self):
        vocab = {self._convert_id_to_token(i): i for i in range(self.encoding.n_vocab)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text, **kwargs):
        return [self._convert_id_to_token(i) for i in self.encoding.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        return self.encoding.encode_single_token(token.encode("latin-1"))

    def _convert_id_to_token(self, index):
        return self.encoding.decode_single_token_bytes(index).decode("latin-1")

    def convert_tokens_to_string(self, tokens):
        return b"".join(t.encode("latin-1") for t in tokens).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''
    % PATTERN
)


def write_tiktoken_tokenizer(directory: Path, vocab_size: int = 300) -> list[str]:
    """The tokenizer files in `directory`; returns the special tokens (ids vocab_size.. in order)."""
    import sysconfig

    from tiktoken._educational import bpe_train

    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()[:8000]
    ranks = bpe_train(text, vocab_size, PATTERN, visualise=None)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiktoken.model").write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    (directory / "tokenization_kimi.py").write_text(TOKENIZER_CODE)
    added = {
        str(vocab_size + i): {
            "content": token,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for i, token in enumerate(SPECIAL)
    }
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                "tokenizer_class": "TikTokenTokenizer",
                "added_tokens_decoder": added,
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "pad_token": "[EOS]",
                "additional_special_tokens": SPECIAL[2:],
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 1048576,
            },
            indent=2,
        )
    )
    return SPECIAL
