"""Files inside a workspace, as the agent's file tools and the workspaces reach them: never outside its root (no
absolute paths, no `..`, no symlinks: every component is opened with O_NOFOLLOW under the root's descriptor)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

MAX_FILE_BYTES = 1 << 20
"""Largest file the file tools read or write."""


class PathRefused(Exception):
    """A path the file tools do not follow (outside the workspace, through a symlink, not a regular file)."""


def workspace_relative(path: str) -> list[str]:
    """The components of a workspace-relative path; refuses what could leave the workspace."""
    if not path or "\x00" in path:
        raise PathRefused("an empty path" if not path else "a path with a NUL byte")
    if path.startswith("/") or path.startswith("~"):
        raise PathRefused(f"{path}: absolute paths are refused; give a path relative to the workspace")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathRefused(f"{path}: paths with .. are refused; stay inside the workspace")
    return parts


def _open_parent(root: Path, parts: list[str], create: bool) -> int:
    """A descriptor of the directory holding `parts[-1]`, reached from `root` without following any symlink."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            made = False
            if create:
                try:
                    os.mkdir(part, dir_fd=fd)
                    made = True
                except FileExistsError:
                    pass
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                raise _refusal(parts, part, e) from None
            os.close(fd)
            fd = child
            if made:
                os.fchmod(fd, 0o777)  # each sandboxed command runs as another uid
        return fd
    except BaseException:
        os.close(fd)
        raise


def _refusal(parts: list[str], part: str, e: OSError) -> Exception:
    shown = "/".join(parts)
    if e.errno in (errno.ELOOP, errno.ENOTDIR) and part != parts[-1]:
        return PathRefused(f"{shown}: {part} is a symlink or not a directory; the file tools do not follow symlinks")
    if e.errno == errno.ELOOP:
        return PathRefused(f"{shown}: a symlink; the file tools do not follow symlinks")
    if e.errno == errno.ENOENT:
        return FileNotFoundError(f"{shown}: no such file")
    return PathRefused(f"{shown}: {os.strerror(e.errno or 0)}")


def read_text(root: Path, path: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The text of the regular file `path` inside `root` (no symlink followed, no FIFO or device opened)."""
    parts = workspace_relative(path)
    if not parts:
        raise PathRefused(f"{path}: a directory, not a file")
    fd = _open_last(root, parts, os.O_RDONLY, create=False)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if stat.S_ISDIR(info.st_mode):
            raise PathRefused(f"{path}: a directory; search it or list it with the shell tool")
        if not stat.S_ISREG(info.st_mode):
            raise PathRefused(f"{path}: not a regular file")
        if info.st_size > max_bytes:
            raise PathRefused(f"{path}: {info.st_size} bytes, more than the file tools' {max_bytes}; use the shell tool")
        data = f.read(max_bytes + 1)
    if b"\x00" in data:
        raise PathRefused(f"{path}: a binary file")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise PathRefused(f"{path}: not UTF-8 text") from None


def _open_last(root: Path, parts: list[str], flags: int, *, create: bool) -> int:
    """The descriptor of the last part of `parts` below `root`, opened with `flags` without following a symlink
    (nor blocking on a FIFO); its parents opened the same way (`create`: made when missing)."""
    parent = _open_parent(root, parts, create=create)
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=parent)
    except OSError as e:
        raise _refusal(parts, parts[-1], e) from None
    finally:
        os.close(parent)


def write_text(root: Path, path: str, text: str) -> None:
    """Create or replace the regular file `path` inside `root` (parents made; no symlink followed, no hard link
    to a file elsewhere written through)."""
    parts = workspace_relative(path)
    if not parts:
        raise PathRefused(f"{path}: a directory, not a file")
    data = text.encode()
    if len(data) > MAX_FILE_BYTES:
        raise PathRefused(f"{path}: {len(data)} bytes, more than the file tools' {MAX_FILE_BYTES}")
    fd = _open_last(root, parts, os.O_WRONLY | os.O_CREAT, create=True)
    with os.fdopen(fd, "wb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PathRefused(f"{path}: not a regular file")
        if info.st_nlink > 1:
            raise PathRefused(f"{path}: a hard link to another file; write a new file instead")
        # Writable by the sandbox's commands, which run as other uids (Sandbox.run_command).
        os.fchmod(f.fileno(), stat.S_IMODE(info.st_mode) | 0o666)
        f.truncate(0)
        f.write(data)
