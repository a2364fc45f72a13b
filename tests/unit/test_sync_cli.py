"""`composer sync` as a user runs it: exit codes, readable errors without tracebacks, the status table."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.sync_testing import TrainingRun, checkpoint_files, run_cli


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    run = TrainingRun(root / "train")
    store = root / "store"
    run.save()
    for step in range(3):
        ck = run.root / f"step{step:04d}"
        result = run_cli("sync", "push", str(ck), "--store", str(store), "--anchor-every", "2", "--cache", str(root / "cache"))
        assert result.returncode == 0, result.stderr
        if step < 2:
            run.next_checkpoint()
    return root, run, store


def test_push_reports_and_status_lists_the_chain(pushed):
    root, _, store = pushed
    result = run_cli("sync", "status", "--store", str(store))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "v0000000" in line]
    assert len(lines) == 3
    assert "anchor" in lines[0] and "anchor" in lines[2]  # anchor every 2 versions
    assert "3 version(s)" in result.stdout


def test_pull_and_verify(pushed, tmp_path):
    root, run, store = pushed
    result = run_cli("sync", "pull", "--store", str(store), "--to", str(tmp_path / "recv"), "--version", "v00000002")
    assert result.returncode == 0, result.stderr
    assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(run.root / "step0001")
    again = run_cli("sync", "pull", "--store", str(store), "--to", str(tmp_path / "recv"), "--version", "v00000002")
    assert again.returncode == 0 and "already at v00000002" in again.stdout
    verified = run_cli("sync", "verify", "--store", str(store))
    assert verified.returncode == 0 and "3 version(s)" in verified.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["push", "/no/such/dir", "--store", "{tmp}/s"], "no such checkpoint directory"),
        (["push", "{tmp}", "--store", "{tmp}/s"], "no *.safetensors files"),
        (["pull", "--store", "{tmp}/nothing", "--to", "{tmp}/r"], "no sync store at"),
        (["status"], "pass --store"),
        (["verify", "--store", "{store}", "--version", "v99"], "no version v99"),
        (["pull", "--store", "{store}", "--to", "{tmp}/r", "--version", "v00000042"], "no version v00000042"),
        (["status", "--store", "ftp://host/x"], "unsupported scheme"),
        (["status", "--store", "ssh://host-without-path"], "expected ssh://"),
        (["push", "{tmp}", "--store", "{tmp}/s", "--set", "sync.anchor_every=2"], "--set needs --recipe"),
    ],
)
def test_user_errors_exit_2_without_traceback(pushed, tmp_path, args, message, monkeypatch, capsys):
    # main() in this process (the same path the `composer` script takes; the subprocess tests cover startup)
    from composer.cli.main import main

    _, _, store = pushed
    monkeypatch.setattr(sys, "argv", ["composer", "sync", *[a.format(tmp=tmp_path, store=store) for a in args]])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert message in err
    assert "Traceback" not in err


def test_damaged_store_fails_verify_with_exit_2(pushed, tmp_path):
    root, _, store = pushed
    copy = tmp_path / "copy"
    run_cli("sync", "relay", "--store", str(store), "--to-store", str(copy))
    victim = sorted((copy / "chunks").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:-1])
    result = run_cli("sync", "verify", "--store", str(copy))
    assert result.returncode == 2
    assert "damaged" in result.stderr and "Traceback" not in result.stderr


def test_gc_keeps_the_newest_anchor_chain(pushed, tmp_path):
    _, _, store = pushed
    copy = tmp_path / "copy"
    for version in ("v00000002", "v00000003"):  # the chain of v2 (v1, v2), then the anchor v3
        assert run_cli("sync", "relay", "--store", str(store), "--to-store", str(copy), "--version", version).returncode == 0
    result = run_cli("sync", "gc", "--store", str(copy), "--keep-anchors", "1", "--grace-minutes", "0")
    assert result.returncode == 0, result.stderr
    assert "deleted 2 version(s)" in result.stdout
    assert sorted(p.name for p in (copy / "manifests").iterdir()) == ["v00000003.json"]


def test_push_with_a_recipe_uses_its_sync_section(tmp_path):
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    run = TrainingRun(tmp_path / "train")
    run.save()
    store = tmp_path / "from-recipe"
    result = run_cli(
        "sync",
        "push",
        str(run.root / "step0000"),
        "--recipe",
        str(recipes / "smoke-rl.yaml"),
        "--set",
        f"sync.store={store}",
        "--set",
        "sync.codec.chunk_mb=1",
        "--cache",
        str(tmp_path / "c"),
    )
    assert result.returncode == 0, result.stderr
    assert (store / "manifests" / "v00000001.json").is_file()
