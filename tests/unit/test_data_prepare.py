"""`composer data prepare`: real tokenizer, real Megatron indexed datasets, real files (the pipeline's own steps are
tested in test_data_pipeline.py; here every cleaning step is off unless a test says otherwise)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from composer.data.inputs import plan_units
from composer.data.prepare import prepare_data
from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from composer.recipes.schema import DataSource
from tests.conftest import run_composer
from tests.helpers.data_helpers import EOS, STDLIB, train_tokenizer, write_jsonl, write_recipe

REPO = Path(__file__).resolve().parents[2]
JSON_FILES = sorted((STDLIB / "json").glob("*.py"))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def prepare(tmp_path: Path, data: dict, vocab_size: int = 4096, checkpoint: str | None = None):
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", data, vocab_size))
    return prepare_data(recipe.data, model_checkpoint=checkpoint, model_vocab_size=recipe.model.vocab_size)


OFF = {
    "redact_secrets": False,
    "redact_pii": False,
    "exact_dedup": False,
    "near_dedup": False,
    "licenses": None,
    "max_line_length": 100_000,
    "max_mean_line_length": 100_000,
    "min_alphanumeric_fraction": 0,
    "drop_generated": False,
}


def data_section(tmp_path: Path, tokenizer_dir: Path, sources: list[dict], **extra) -> dict:
    return {
        "tokenizer": str(tokenizer_dir),
        "cache_dir": str(tmp_path / "cache"),
        "num_workers": 2,
        "tasks": 2,
        "cleaning": OFF,
        "sources": sources,
        **extra,
    }


def documents(prefix: Path) -> list[np.ndarray]:
    # Index, don't iterate (reads past the end are not checked), and copy: the arrays view a mmap closed with the dataset.
    dataset = IndexedDataset(str(prefix))
    return [dataset[i].copy() for i in range(len(dataset))]


def cache_entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.exists() else []


def test_documents_are_tokenized_in_file_order_and_each_ends_with_eod(tmp_path, tokenizer_dir):
    (tmp_path / "empty.py").write_text("")  # empty files hold no document
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": "def f():\n    return 1\n"}, "", {"text": "x = [1, 2]\n", "id": 7}])
    prepared = prepare(
        tmp_path,
        data_section(
            tmp_path,
            tokenizer_dir,
            [
                {"name": "json-lib", "paths": ["{stdlib}/json/*.py", str(tmp_path / "empty.py")], "weight": 3},
                {"name": "snippets", "paths": [str(docs)], "format": "jsonl"},
            ],
        ),
    )

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eod = tokenizer.token_to_id(EOS)
    code, snippets = prepared.sources
    assert (code.name, code.weight, code.summary["inputs"], code.cached) == ("json-lib", 3.0, len(JSON_FILES) + 1, False)
    dataset = documents(code.prefix)
    assert len(dataset) == code.num_documents == len(JSON_FILES)
    for document, file in zip(dataset, JSON_FILES):
        assert document[-1] == eod
        assert tokenizer.decode(document[:-1].tolist(), skip_special_tokens=False) == file.read_text()
    assert code.num_tokens == sum(len(d) for d in dataset)

    dataset = documents(snippets.prefix)
    assert snippets.num_documents == len(dataset) == 2
    assert [tokenizer.decode(d[:-1].tolist()) for d in dataset] == ["def f():\n    return 1\n", "x = [1, 2]\n"]
    assert dataset[0].dtype == np.uint16  # vocab of 512 fits 16-bit tokens


def test_text_that_is_not_utf8_is_kept_with_replacement_characters_and_counted(tmp_path, tokenizer_dir):
    (tmp_path / "latin1.txt").write_bytes("café = 1\n".encode("latin-1"))
    (tmp_path / "utf8.txt").write_text("café = 2\n")
    prepared = prepare(tmp_path, data_section(tmp_path, tokenizer_dir, [{"name": "mixed", "paths": [str(tmp_path / "*.txt")]}]))
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert prepared.sources[0].summary["not_utf8"] == 1
    assert [tokenizer.decode(d[:-1].tolist()) for d in documents(prepared.sources[0].prefix)] == ["caf\ufffd = 1\n", "café = 2\n"]
    assert (
        prepare(tmp_path, data_section(tmp_path, tokenizer_dir, [{"name": "mixed", "paths": [str(tmp_path / "*.txt")]}]))
        .sources[0]
        .summary["not_utf8"]
        == 1
    )


def test_stdlib_placeholder_means_the_standard_library_without_installed_packages():
    files = [Path(u.path) for u in plan_units(DataSource(name="stdlib", paths=["{stdlib}/**/*.py"]), 0)]
    assert STDLIB / "json" / "decoder.py" in files
    assert not [f for f in files if "site-packages" in f.parts or "dist-packages" in f.parts]


def test_second_prepare_reuses_the_cache_until_an_input_or_the_tokenizer_changes(tmp_path, tokenizer_dir):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"document number {i}\n")
    data = data_section(tmp_path, tokenizer_dir, [{"name": "notes", "paths": [str(corpus / "*.txt")]}])
    first = prepare(tmp_path, data)
    bin_file = first.sources[0].prefix.with_suffix(".bin")
    written = bin_file.stat().st_mtime_ns

    again = prepare(tmp_path, data)
    assert again.all_cached and again.sources[0].prefix == first.sources[0].prefix
    assert (again.sources[0].num_documents, again.sources[0].num_tokens) == (3, first.sources[0].num_tokens)
    assert bin_file.stat().st_mtime_ns == written

    (corpus / "1.txt").write_text("document number one, edited\n")
    edited = prepare(tmp_path, data)
    assert not edited.all_cached and edited.sources[0].prefix != first.sources[0].prefix

    other_tokenizer = train_tokenizer(tmp_path / "tokenizer-300", vocab_size=300)
    retokenized = prepare(tmp_path, {**data, "tokenizer": str(other_tokenizer)})
    assert not retokenized.all_cached
    assert len({first.sources[0].prefix, edited.sources[0].prefix, retokenized.sources[0].prefix}) == 3


def test_tokenizer_defaults_to_the_model_checkpoint(tmp_path, tokenizer_dir):
    data = data_section(tmp_path, tokenizer_dir, [{"name": "lib", "paths": ["{stdlib}/json/tool.py"]}])
    del data["tokenizer"]
    prepared = prepare(tmp_path, data, checkpoint=str(tokenizer_dir))
    assert prepared.tokenizer.directory == tokenizer_dir and prepared.sources[0].num_documents == 1


def test_an_error_mid_source_leaves_no_cache_entry(tmp_path, tokenizer_dir):
    good = write_jsonl(tmp_path / "a.jsonl", [{"text": "fine"}] * 20)
    bad = write_jsonl(tmp_path / "b.jsonl", [{"text": "fine"}, '{"text": "cut off'])
    data = data_section(tmp_path, tokenizer_dir, [{"name": "mixed", "paths": [str(good), str(bad)], "format": "jsonl"}])
    with pytest.raises(UserError, match=rf"^{bad}:2: invalid JSON"):
        prepare(tmp_path, data)
    assert [e for e in cache_entries(tmp_path / "cache") if not e.startswith(".")] == []  # only the resumable work


@pytest.mark.parametrize(
    "records, field, message",
    [
        ([{"text": "ok"}, {"body": "no text"}], "text", r":2: no string field 'text'"),
        ([{"text": "ok"}, ["a", "list"]], "text", r":2: no string field 'text'"),
        ([{"content": "ok"}, {"content": 3}], "content", r":2: no string field 'content'"),
    ],
)
def test_jsonl_records_without_the_text_field_are_named_by_line(tmp_path, tokenizer_dir, records, field, message):
    file = write_jsonl(tmp_path / "docs.jsonl", records)
    data = data_section(tmp_path, tokenizer_dir, [{"name": "docs", "paths": [str(file)], "format": "jsonl", "text_field": field}])
    with pytest.raises(UserError, match=str(file) + message):
        prepare(tmp_path, data)


def test_bad_inputs_are_user_errors(tmp_path, tokenizer_dir):
    def fails(sources: list[dict], match: str, **extra) -> None:
        with pytest.raises(UserError, match=match):
            prepare(tmp_path, data_section(tmp_path, tokenizer_dir, sources, **extra))

    fails([{"name": "typo", "paths": ["{stdlib}/jsn/*.py"]}], r"data.sources\[0\] \(typo\): '\{stdlib\}/jsn/\*.py' \(.*\) matches no files")
    (tmp_path / "blank.txt").write_text("  \n")
    fails([{"name": "blank", "paths": [str(tmp_path / "blank.txt")]}], r"hold no text; the corpus would be empty")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "missing-target.txt")
    fails([{"name": "gone", "paths": [str(tmp_path / "gone.txt")]}], rf"{tmp_path / 'gone.txt'}: cannot read")
    lib = [{"name": "lib", "paths": ["{stdlib}/json/*.py"]}]
    fails(lib, r"does not exist", tokenizer=str(tmp_path / "no-tokenizer"))
    fails(lib, r"has no tokenizer.json", tokenizer=str(tmp_path))
    with pytest.raises(UserError, match=r"tokenizer/model mismatch: .* has 512 tokens but model.vocab_size is 256"):
        prepare(tmp_path, data_section(tmp_path, tokenizer_dir, lib), vocab_size=256)
    no_tokenizer = data_section(tmp_path, tokenizer_dir, lib)
    del no_tokenizer["tokenizer"]
    with pytest.raises(UserError, match=r"data.tokenizer and model.checkpoint are both unset"):
        prepare(tmp_path, no_tokenizer)
    assert [e for e in cache_entries(tmp_path / "cache") if not e.startswith(".")] == []


def test_cli_prepares_then_reports_a_cache_hit_and_shows_errors_without_traceback(tmp_path, tokenizer_dir):
    recipe = write_recipe(
        tmp_path / "recipe.yaml", data_section(tmp_path, tokenizer_dir, [{"name": "json-lib", "paths": ["{stdlib}/json/*.py"]}])
    )
    first = run_composer("data", "prepare", str(recipe))
    assert first.returncode == 0, first.stderr
    assert "json-lib" in first.stdout and "built" in first.stdout and "nothing to do" not in first.stdout
    second = run_composer("data", "prepare", str(recipe))
    assert second.returncode == 0, second.stderr
    assert "hit" in second.stdout and "nothing to do" in second.stdout

    failed = run_composer("data", "prepare", str(recipe), "--set", "model.vocab_size=100")
    assert failed.returncode == 2
    assert "tokenizer/model mismatch" in failed.stderr and "Traceback" not in failed.stderr
    rl_recipe = run_composer("data", "prepare", str(REPO / "recipes" / "smoke-rl.yaml"))
    assert rl_recipe.returncode == 2 and "no data section" in rl_recipe.stderr
    stats = run_composer("data", "stats", str(recipe))
    assert stats.returncode == 0 and "json-lib" in stats.stdout and "exact duplicates" in stats.stdout
