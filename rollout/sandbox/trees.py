"""Host-side walks and removals of trees a run made: iterative (no recursion, whatever the depth), through directory
descriptors (`dir_fd`: no path is ever longer than one name, so trees past PATH_MAX work), never following a symlink
and never leaving the tree's filesystem. A walk is bounded in depth and entries; a tree over the bounds raises
`TreeTooLarge`, which callers treat as the run's fault (a flag), never as an infrastructure failure."""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterator
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_OPEN = 64
"""Directory descriptors a removal holds at most: a subtree deeper is first moved up beside the tree's top (a rename
on the same filesystem), then removed from there."""
MAX_DEPTH = 48
MAX_PATH_CHARS = 2048
"""A walk's bounds: a real project's paths are far shorter and shallower (and PATH_MAX is 4096 with the top's path)."""
MAX_ENTRIES = 200_000


class TreeTooLarge(Exception):
    """A tree a run made is deeper, or holds more entries, than a host-side walk reads."""


def _entries(fd: int) -> list[os.DirEntry]:
    with os.scandir(fd) as it:
        return list(it)


def remove_tree(path: str | os.PathLike, ignore_errors: bool = True) -> None:
    """Remove `path` and everything under it (as `shutil.rmtree`, but at any depth and path length; a symlink is
    removed, never followed; a mount point below it is left, with the directories above it)."""
    path = Path(path)
    _counter = itertools.count()
    try:
        parent = os.open(path.parent, _DIR_FLAGS)
    except OSError:
        if ignore_errors:
            return
        raise
    try:
        pending = [path.name]
        while pending:
            name = pending.pop()
            try:
                st = os.lstat(name, dir_fd=parent)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=parent)
                    continue
                _remove_dir(parent, name, st.st_dev, pending, lambda: f"{path.name}.deep-{next(_counter)}")
            except FileNotFoundError:
                continue
            except OSError:
                if not ignore_errors:
                    raise
    finally:
        os.close(parent)


def _remove_dir(parent: int, name: str, device: int, pending: list[str], spare_name) -> None:
    # Each frame: (its parent's fd, its name, its fd, its subdirectories not yet removed).
    top = os.open(name, _DIR_FLAGS, dir_fd=parent)
    stack: list[tuple[int, str, int, list[str]]] = []

    def enter(pfd: int, dname: str, fd: int) -> None:
        subdirs = []
        for entry in _entries(fd):
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(entry.name, dir_fd=fd)
            elif st.st_dev == device:
                subdirs.append(entry.name)
        stack.append((pfd, dname, fd, subdirs))

    enter(parent, name, top)
    try:
        while stack:
            pfd, dname, fd, subdirs = stack[-1]
            if subdirs:
                sub = subdirs.pop()
                if len(stack) >= MAX_OPEN:
                    spare = spare_name()
                    os.rename(sub, spare, src_dir_fd=fd, dst_dir_fd=parent)
                    pending.append(spare)
                    continue
                enter(fd, sub, os.open(sub, _DIR_FLAGS, dir_fd=fd))
                continue
            stack.pop()
            os.close(fd)
            os.rmdir(dname, dir_fd=pfd)
    finally:
        for _, _, fd, _ in stack:
            os.close(fd)


def walk_files(
    top: str | os.PathLike,
    cut: list[str] | None = None,
    max_depth: int = MAX_DEPTH,
    max_path: int = MAX_PATH_CHARS,
    max_entries: int = MAX_ENTRIES,
) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under `top` as (path relative to top, its lstat), directories included (so whiteouts and opaque
    directories can be seen); symlinks are entries, never followed; other filesystems mounted below are not
    entered. A directory `max_depth` levels down or with a path over `max_path` characters is yielded but not
    entered: its path goes into `cut` (`TreeTooLarge` when no list is given); past `max_entries` entries,
    `TreeTooLarge`. Every path yielded opens from `top` without reaching PATH_MAX."""
    root = os.open(top, _DIR_FLAGS)
    device = os.fstat(root).st_dev
    # Each frame: a directory's fd, its relative path with "/", its subdirectories not yet entered (at most
    # max_depth descriptors open, however wide the tree).
    stack: list[tuple[int, str, list[str]]] = []
    seen = 0

    def enter(fd: int, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
        nonlocal seen
        subdirs: list[str] = []
        stack.append((fd, prefix, subdirs))
        for entry in _entries(fd):
            seen += 1
            if seen > max_entries:
                raise TreeTooLarge(f"more than {max_entries} entries")
            st = entry.stat(follow_symlinks=False)
            yield prefix + entry.name, st
            if stat.S_ISDIR(st.st_mode) and st.st_dev == device:
                subdirs.append(entry.name)

    try:
        yield from enter(root, "")
        while stack:
            fd, prefix, subdirs = stack[-1]
            if not subdirs:
                stack.pop()
                os.close(fd)
                continue
            sub = subdirs.pop()
            if len(stack) >= max_depth or len(prefix) + len(sub) > max_path:
                if cut is None:
                    raise TreeTooLarge(f"{prefix}{sub}: deeper than {max_depth} levels or longer than {max_path} characters")
                cut.append(prefix + sub)
                continue
            yield from enter(os.open(sub, _DIR_FLAGS, dir_fd=fd), f"{prefix}{sub}/")
    finally:
        for fd, _, _ in stack:
            os.close(fd)
