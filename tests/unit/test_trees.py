"""Host-side walks and removals of trees a run made (`rollout.sandbox.trees`): any depth, paths past PATH_MAX,
symlinks never followed, bounded walks that cut what is over the bounds instead of raising."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from composer.rollout.sandbox.trees import TreeTooLarge, remove_tree, walk_files


def chain(top: Path, depth: int, name: str = "d") -> None:
    """`depth` nested directories `name` under top, made through descriptors (the paths pass PATH_MAX)."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        inner = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(os.open("leaf.txt", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    os.close(fd)


def test_a_1500_deep_tree_is_removed_without_recursion(tmp_path):
    chain(tmp_path / "run", 1500)
    remove_tree(tmp_path / "run", ignore_errors=False)
    assert list(tmp_path.iterdir()) == []


def test_paths_past_path_max_are_removed_and_cut_from_walks(tmp_path):
    chain(tmp_path / "run", 22, "n" * 255)
    cut: list[str] = []
    seen = [relative for relative, _ in walk_files(tmp_path / "run", cut)]
    assert cut and all(len(p) <= 2048 + 256 for p in seen)
    assert len(str(tmp_path / "run" / cut[0])) < 4096
    with pytest.raises(TreeTooLarge):
        list(walk_files(tmp_path / "run"))
    remove_tree(tmp_path / "run", ignore_errors=False)
    assert list(tmp_path.iterdir()) == []


def test_symlinks_are_removed_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("host file")
    run = tmp_path / "run"
    (run / "a").mkdir(parents=True)
    (run / "a" / "to-outside").symlink_to(outside)
    (run / "to-etc").symlink_to("/etc")
    (run / "up").symlink_to("../../../../..")
    walked = dict(walk_files(run))
    assert set(walked) == {"a", "a/to-outside", "to-etc", "up"}
    remove_tree(run, ignore_errors=False)
    assert not run.exists() and (outside / "keep.txt").read_text() == "host file" and Path("/etc/passwd").exists()


def test_walks_are_bounded_in_entries(tmp_path):
    for i in range(30):
        (tmp_path / f"f{i}").touch()
    with pytest.raises(TreeTooLarge):
        list(walk_files(tmp_path, max_entries=20))
    assert len(list(walk_files(tmp_path))) == 30
