"""The data pipeline (`data/`, on datatrove): planted duplicates and secrets, FIM and repository documents decoded
back, every input kind giving the same documents, kill -9 then rerun, bad input. Real tokenizer, real datatrove
stages, real Megatron indexed datasets."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from composer.data.prepare import prepare_data
from composer.recipes.errors import UserError
from composer.recipes.loader import load_recipe
from tests.conftest import COMPOSER, REPO, run_composer
from tests.helpers.data_helpers import EOS, STDLIB, train_tokenizer, write_recipe

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
"""Every cleaning step off: the documents are the inputs."""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def prepare(tmp_path: Path, tokenizer_dir: Path, sources: list[dict], **data):
    tmp_path.mkdir(parents=True, exist_ok=True)
    section = {
        "tokenizer": str(tokenizer_dir),
        "cache_dir": str(tmp_path / "cache"),
        "tasks": 3,
        "num_workers": 2,
        "sources": sources,
        **data,
    }
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", section))
    return prepare_data(recipe.data, model_checkpoint=None, model_vocab_size=recipe.model.vocab_size)


def documents(prefix: Path) -> list[list[int]]:
    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


def texts(prepared, tokenizer: Tokenizer) -> list[str]:
    eod = tokenizer.token_to_id(EOS)
    out = []
    for document in documents(prepared.sources[0].prefix):
        assert document[-1] == eod
        out.append(tokenizer.decode(document[:-1], skip_special_tokens=False))
    return out


# --- deduplication -------------------------------------------------------------------------------


def synthetic_code(rng: random.Random, words: list[str], lines: int) -> str:
    return "".join(
        f"def {rng.choice(words)}_{i}({rng.choice(words)}, {rng.choice(words)}):\n"
        f"    return {rng.choice(words)} + {rng.choice(words)} * {rng.randrange(1000)}\n"
        for i in range(lines // 2)
    )


def edit_lines(rng: random.Random, text: str, words: list[str], share: float) -> str:
    lines = text.splitlines(keepends=True)
    for i in rng.sample(range(len(lines)), max(1, int(share * len(lines)))):
        lines[i] = f"    {rng.choice(words)} = {rng.choice(words)}({rng.randrange(1000)})\n"
    return "".join(lines)


def test_planted_exact_and_near_duplicates_are_found_at_the_stated_threshold(tmp_path, tokenizer_dir, tokenizer):
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(4, 10))) for _ in range(3000)]
    bases = [synthetic_code(rng, words, 80) for _ in range(150)]
    groups = [[b] for b in bases]
    for group in groups[:40]:
        group.append(group[0])  # exact copy
    for group in groups[30:80]:
        group.append(edit_lines(rng, group[0], words, rng.uniform(0.02, 0.04)))  # a few percent of the lines edited
    records = [(i, text) for i, group in enumerate(groups) for text in group]
    rng.shuffle(records)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text, "path": f"f{n}.py"}) + "\n" for n, (_, text) in enumerate(records)))

    prepared = prepare(
        tmp_path,
        tokenizer_dir,
        [{"name": "code", "paths": [str(corpus)], "format": "jsonl"}],
        cleaning={**OFF, "exact_dedup": True, "near_dedup": True, "near_threshold": 0.7},
    )
    kept = texts(prepared, tokenizer)
    group_of = {}
    for i, text in records:
        group_of.setdefault(text, i)
    kept_per_group = np.bincount([group_of[text] for text in kept], minlength=len(groups))
    planted = sum(len(g) - 1 for g in groups)
    assert kept_per_group.min() >= 1  # precision: no group lost all its documents...
    found = sum(len(g) - kept_per_group[i] for i, g in enumerate(groups))
    false_removals = sum(1 for i, g in enumerate(groups) if len(g) == 1 and kept_per_group[i] == 0)
    assert found / planted >= 0.95
    assert (found - false_removals) / max(found, 1) >= 0.99
    summary = prepared.sources[0].summary
    assert summary["removed"]["exact duplicates"]["documents"] == 40  # every exact copy, by content hash
    assert summary["removed"]["exact duplicates"]["tokens"] > 0
    assert summary["near_dedup"]["clusters"] == summary["removed"]["near duplicates"]["documents"]
    assert (summary["near_dedup"]["bands"], summary["near_dedup"]["rows"]) == (16, 8)


# --- redaction -------------------------------------------------------------------------------------

SECRETS = {
    "aws_access_key": "AKIAIOSFODNN7EXAMPLQ",
    "github_token": "ghp_" + "aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY3z5A",
    "private_key": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA0Z3VS5JJcds3xfn\n-----END RSA PRIVATE KEY-----",
    "assigned_secret": "Xk93hdP0qLm2",
    "email": "jane.doe@corp-mail.com",
}


def test_planted_secrets_are_redacted_and_reported_without_their_values(tmp_path, tokenizer_dir, tokenizer):
    repo = tmp_path / "service"
    repo.mkdir()
    (repo / "settings.py").write_text(
        f'AWS_KEY = "{SECRETS["aws_access_key"]}"\nGITHUB = "{SECRETS["github_token"]}"\n'
        f'password = "{SECRETS["assigned_secret"]}"\nplaceholder_password = "password"\n'
    )
    (repo / "deploy.pem.txt").write_text(SECRETS["private_key"] + "\n")
    (repo / "README.md").write_text(f"Contact {SECRETS['email']} for access.\n")
    prepared = prepare(
        tmp_path,
        tokenizer_dir,
        [{"name": "service", "paths": [str(repo)], "format": "repository"}],
        cleaning={**OFF, "redact_secrets": True, "redact_pii": True},
    )
    text = "".join(texts(prepared, tokenizer))
    for kind, value in SECRETS.items():
        assert value.split("\n")[0] not in text
        assert f"<REDACTED_{kind.upper()}>" in text
    assert 'placeholder_password = "password"' in text  # not every assignment is a secret
    report = [json.loads(line) for line in (prepared.sources[0].prefix.parent / "redactions.jsonl").read_text().splitlines()]
    assert sorted(r["kind"] for r in report) == sorted(SECRETS)
    assert {"path": "settings.py", "line": 3, "kind": "assigned_secret"}.items() <= next(
        r for r in report if r["kind"] == "assigned_secret"
    ).items()
    assert not any(value.split("\n")[0] in json.dumps(report) for value in SECRETS.values())
    assert prepared.sources[0].summary["redactions"] == {kind: 1 for kind in SECRETS}


# --- FIM and repository documents --------------------------------------------------------------------


def split_at(ids: list[int], marks: set[int]) -> list[tuple[int | None, list[int]]]:
    pieces, mark, run = [], None, []
    for token in ids:
        if token in marks:
            pieces.append((mark, run))
            mark, run = token, []
        else:
            run.append(token)
    return [*pieces, (mark, run)]


def test_fim_documents_decode_to_the_file_when_the_parts_are_put_back(tmp_path, tokenizer_dir, tokenizer):
    prepared = prepare(
        tmp_path,
        tokenizer_dir,
        [{"name": "lib", "paths": ["{stdlib}/json/*.py", "{stdlib}/http/*.py"]}],
        cleaning=OFF,
        fim={"rate": 1.0, "spm_rate": 0.5},
    )
    files = sorted([*(STDLIB / "json").glob("*.py"), *(STDLIB / "http").glob("*.py")])
    prefix, middle, suffix = (tokenizer.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"))
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    for document, file in zip(documents(prepared.sources[0].prefix), files, strict=True):
        pieces = split_at(document[:-1], {prefix, middle, suffix})
        assert [mark for mark, _ in pieces] == [None, prefix, suffix, middle]
        # PSM: <P> prefix <S> suffix <M> middle; SPM: <P> <S> suffix <M> prefix+middle (nothing after <P>)
        first, after_suffix, after_middle = (ids for _, ids in pieces[1:])
        assert decode(first) + decode(after_middle) + decode(after_suffix) == file.read_text()
    fim = prepared.sources[0].summary["fim"]
    assert fim["psm"] > 0 and fim["spm"] > 0 and fim["psm"] + fim["spm"] == fim["files"] == len(files)


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args], check=True, capture_output=True)


def make_repository(root: Path) -> Path:
    """A git repository: a package with imports, a vendored copy, a binary, an oversized file, an uncommitted one."""
    repo = root / "toolkit"
    (repo / "toolkit").mkdir(parents=True)
    (repo / "vendor" / "lib").mkdir(parents=True)
    files = {
        "toolkit/__init__.py": "from .core import run\n",
        "toolkit/core.py": "from toolkit.util import helper\n\n\ndef run(x):\n    return helper(x) + 1\n",
        "toolkit/util.py": "def helper(x):\n    return x * 2\n",
        "main.py": "import toolkit\n\nprint(toolkit.run(3))\n",
        "README.md": "# toolkit\n\nDoubles numbers, then adds one.\n",
        "web/app.js": "const h = require('./helpers')\nconsole.log(h.twice(2))\n",
        "web/helpers.js": "exports.twice = (x) => 2 * x\n",
        "vendor/lib/copied.py": "def copied():\n    return 'vendored'\n",
        "big.py": "x = 1\n" * 200_000,
    }
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    (repo / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)))
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    (repo / "scratch.py").write_text("not committed = True\n")
    return repo


def test_repository_documents_keep_every_kept_file_once_in_dependency_order(tmp_path, tokenizer_dir, tokenizer):
    repo = make_repository(tmp_path)
    prepared = prepare(tmp_path, tokenizer_dir, [{"name": "repos", "paths": [str(repo)], "format": "repository"}], cleaning=OFF)
    [document] = documents(prepared.sources[0].prefix)
    repo_name, file_sep = tokenizer.token_to_id("<|repo_name|>"), tokenizer.token_to_id("<|file_sep|>")
    pieces = split_at(document[:-1], {repo_name, file_sep})
    assert [mark for mark, _ in pieces[:2]] == [None, repo_name] and tokenizer.decode(pieces[1][1]) == "toolkit\n"
    paths = []
    for _, ids in pieces[2:]:
        path, _, content = tokenizer.decode(ids, skip_special_tokens=False).partition("\n")
        assert content == (repo / path).read_text()
        paths.append(path)
    assert sorted(paths) == [
        "README.md",
        "main.py",
        "toolkit/__init__.py",
        "toolkit/core.py",
        "toolkit/util.py",
        "web/app.js",
        "web/helpers.js",
    ]
    for before, after in [
        ("toolkit/util.py", "toolkit/core.py"),
        ("toolkit/core.py", "toolkit/__init__.py"),
        ("toolkit/__init__.py", "main.py"),
        ("web/helpers.js", "web/app.js"),
    ]:
        assert paths.index(before) < paths.index(after)
    summary = prepared.sources[0].summary
    assert summary["left_out"] == {"binary": 1, "oversized": 1, "excluded */vendor/*": 1}
    assert (summary["repository_documents"], summary["repository_files"]) == (1, 7)


def test_a_repository_declaring_a_licence_not_allowed_is_dropped_and_counted(tmp_path, tokenizer_dir, tokenizer):
    repos = tmp_path / "repos"
    for name, licence in (
        ("permissive", "MIT License\n\nPermission is hereby granted, free of charge, to any person"),
        ("copyleft", "GNU GENERAL PUBLIC LICENSE\nVersion 3, 29 June 2007"),
        ("silent", None),
    ):
        (repos / name).mkdir(parents=True)
        (repos / name / "code.py").write_text(f"def {name}():\n    return '{name}'\n")
        if licence:
            (repos / name / "LICENSE").write_text(licence + "\n")
    prepared = prepare(
        tmp_path,
        tokenizer_dir,
        [{"name": "repos", "paths": [str(repos / "*")], "format": "repository"}],
        cleaning={**OFF, "licenses": ["MIT"]},
    )
    text = "".join(texts(prepared, tokenizer))
    assert "permissive" in text and "silent" in text and "copyleft" not in text
    removed = prepared.sources[0].summary["removed"]["licence"]
    assert removed["documents"] == 2 and removed["reasons"] == {"license GPL-3.0": 2} and removed["tokens"] > 0


# --- inputs -------------------------------------------------------------------------------------------


def test_git_repository_parquet_and_compressed_jsonl_give_the_documents_of_their_plain_text_files(tmp_path, tokenizer_dir):
    files = {f"pkg/m{i}.py": f"def f{i}(x):\n    return x + {i}\n" for i in range(6)} | {"notes.txt": "plain prose\n"}
    plain = tmp_path / "plain"
    for rel, text in files.items():
        (plain / rel).parent.mkdir(parents=True, exist_ok=True)
        (plain / rel).write_text(text)
    repo = tmp_path / "repo"
    subprocess.run(["cp", "-r", str(plain), str(repo)], check=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "files")
    rows = [{"path": rel, "text": files[rel]} for rel in sorted(files)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "rows.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(lines))

    def tokens(name: str, source: dict) -> list[list[int]]:
        return documents(prepare(tmp_path / name, tokenizer_dir, [{"name": name, **source}], cleaning=OFF).sources[0].prefix)

    reference = tokens("text", {"paths": [str(plain / "**" / "*")]})
    assert len(reference) == len(files)
    assert tokens("git", {"paths": [str(repo)], "format": "repository", "repository_documents": False}) == reference
    assert tokens("parquet", {"paths": [str(tmp_path / "rows.parquet")], "format": "parquet"}) == reference
    assert tokens("zst", {"paths": [str(tmp_path / "rows.jsonl.zst")], "format": "jsonl"}) == reference
    assert tokens("gz", {"paths": [str(tmp_path / "rows.jsonl.gz")], "format": "jsonl"}) == reference


def test_bad_inputs_are_one_clear_message_or_skipped_and_counted(tmp_path, tokenizer_dir):
    def fails(source: dict, match: str, **data) -> None:
        with pytest.raises(UserError, match=match):
            prepare(tmp_path, tokenizer_dir, [{"name": "bad", **source}], **data)
        assert not [p for p in (tmp_path / "cache").glob("bad-*")]  # never a cache entry

    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    fails({"paths": [str(tmp_path / "broken.parquet")], "format": "parquet"}, r"broken.parquet: not a readable Parquet file")
    (tmp_path / "broken.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x"}\n' * 100)[:-9])
    fails({"paths": [str(tmp_path / "broken.jsonl.zst")], "format": "jsonl"}, r"broken.jsonl.zst: not a valid zstd file")
    (tmp_path / "gone.py").symlink_to(tmp_path / "missing-target.py")
    fails({"paths": [str(tmp_path / "gone.py")]}, rf"{tmp_path / 'gone.py'}: cannot read")
    fails({"paths": [str(tmp_path / "no-such-repo")], "format": "repository"}, r"repository .*no-such-repo does not exist")
    fails(
        {"paths": [str(tmp_path / "broken.parquet")], "format": "parquet"},
        r"needs the special tokens <\|fim_prefix\|>",
        tokenizer=str(train_tokenizer(tmp_path / "plain-tokenizer", special=False)),
        fim={"rate": 0.5},
    )

    (tmp_path / "good.jsonl").write_text('{"text": "fine = 1\\n"}\n')
    prepared = prepare(
        tmp_path,
        tokenizer_dir,
        [{"name": "skipping", "format": "jsonl", "paths": [str(tmp_path / "good.jsonl"), str(tmp_path / "broken.jsonl.zst")]}],
        cleaning=OFF,
        files={"on_unreadable": "skip"},
    )
    assert prepared.sources[0].summary["left_out"] == {"unreadable": 1} and prepared.sources[0].num_documents == 1


def test_a_fim_rate_outside_zero_to_one_is_a_recipe_error(tmp_path, tokenizer_dir):
    recipe = write_recipe(
        tmp_path / "recipe.yaml", {"tokenizer": str(tokenizer_dir), "sources": [{"name": "x", "paths": ["{stdlib}/json/*.py"]}]}
    )
    result = run_composer("data", "prepare", str(recipe), "--set", "data.fim.rate=1.5")
    assert result.returncode == 2 and "data.fim.rate" in result.stderr and "less than or equal to 1" in result.stderr
    assert "Traceback" not in result.stderr


# --- kill -9, workers ----------------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow  # three data runs, two killed (about 30 s)
@pytest.mark.engines
def test_kill_9_of_a_worker_or_the_driver_then_a_rerun_gives_the_bytes_of_one_uninterrupted_worker(tmp_path, tokenizer_dir):
    corpus = ["{stdlib}/email/**/*.py", "{stdlib}/asyncio/*.py", "{stdlib}/json/*.py"]
    section = lambda cache, workers: {
        "tokenizer": str(tokenizer_dir),
        "cache_dir": str(tmp_path / cache),
        "tasks": 4,
        "num_workers": workers,
        "fim": {"rate": 0.5},
        "sources": [{"name": "lib", "paths": corpus}],
    }
    reference = prepare(
        tmp_path / "one", tokenizer_dir, section("one", 1)["sources"], **{k: v for k, v in section("one", 1).items() if k != "sources"}
    )
    expected = [reference.sources[0].prefix.with_suffix(s).read_bytes() for s in (".bin", ".idx")]

    def start(cache: str) -> subprocess.Popen:
        recipe = write_recipe(tmp_path / f"{cache}.yaml", section(cache, 2))
        return subprocess.Popen(
            [*COMPOSER, "data", "prepare", str(recipe)],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def wait_for_tasks(cache: str, process: subprocess.Popen, stage: str) -> None:
        deadline = time.monotonic() + 300
        while not list((tmp_path / cache).glob(f".work-*/{stage}/completions/*")):
            assert process.poll() is None and time.monotonic() < deadline, "prepare ended before it could be killed"
            time.sleep(0.05)

    def output(cache: str) -> list[bytes]:
        [entry] = [p for p in (tmp_path / cache).glob("lib-*")]
        return [(entry / f"tokens{s}").read_bytes() for s in (".bin", ".idx")]

    # a worker killed mid-run: the driver replaces it and runs its task again
    process = start("worker-killed")
    wait_for_tasks("worker-killed", process, "clean")
    workers = children(process.pid)
    assert workers, "no worker to kill"
    os.kill(workers[0], signal.SIGKILL)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-2000:]
    assert output("worker-killed") == expected

    # the driver killed mid-run: its workers die with it; a rerun goes on from the finished tasks
    process = start("driver-killed")
    wait_for_tasks("driver-killed", process, "minhash-signatures")
    workers = children(process.pid)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 30
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(w) for w in workers), "a worker outlived its driver"
    assert not list((tmp_path / "driver-killed").glob("lib-*"))  # nothing published by the killed run
    rerun = start("driver-killed")
    _, stderr = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, stderr[-2000:]
    assert output("driver-killed") == expected
