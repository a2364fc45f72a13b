"""Where a store's files live: a local (or shared) directory, or a directory on an SSH host.

One small interface, one factory (`build_transport`) chosen by the store string. Every write is atomic
(temp file, then rename); `publish` is atomic AND exclusive (it fails if the name exists), which is how
two racing pushers are kept from publishing the same version. Paths are '/'-separated, relative to the root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import secrets
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

from recipes.errors import UserError
from recipes.runs import fsync_dir
from recipes.schema import SSHSection
from cluster.ssh import SSHHost


class Transport(ABC):
    location: str
    parallelism: int
    """Transfers worth running at once."""

    @abstractmethod
    def get(self, path: str) -> bytes:
        """The file's bytes; FileNotFoundError when absent."""

    @abstractmethod
    def put(self, path: str, data: bytes) -> None:
        """Write atomically, replacing any file of that name."""

    @abstractmethod
    def publish(self, path: str, data: bytes) -> None:
        """Write atomically; FileExistsError (and nothing written) when the name already exists."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def list(self, directory: str) -> dict[str, float]:
        """Names in `directory` (temp files included) with their modification times; empty when it does not exist."""

    @abstractmethod
    def delete(self, path: str) -> None: ...

    @abstractmethod
    def makedirs(self, directory: str) -> None: ...

    def close(self) -> None:
        """Release connections."""


def _temp_name(path: str) -> str:
    head, name = posixpath.split(path)
    return posixpath.join(head, f".tmp-{name}-{secrets.token_hex(4)}")


def is_temp(name: str) -> bool:
    return name.startswith(".tmp-")


class LocalTransport(Transport):
    parallelism = 2

    def __init__(self, root: Path):
        self.root = root
        self.location = str(root)

    @contextlib.contextmanager
    def _os_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as e:
            hint = " (the disk is full)" if e.errno == errno.ENOSPC else ""
            raise UserError(f"store {self.location}: cannot {what}: {e.strerror}{hint}") from None

    def get(self, path: str) -> bytes:
        with self._os_errors(f"read {path}"):
            return (self.root / path).read_bytes()

    def _write_temp(self, path: str, data: bytes) -> Path:
        tmp = self.root / _temp_name(path)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def put(self, path: str, data: bytes) -> None:
        with self._os_errors(f"write {path}"):
            tmp = self._write_temp(path, data)
            try:
                os.replace(tmp, self.root / path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

    def publish(self, path: str, data: bytes) -> None:
        with self._os_errors(f"publish {path}"):
            tmp = self._write_temp(path, data)
            try:
                os.link(tmp, self.root / path)  # unlike rename, link never replaces an existing file
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir((self.root / path).parent)

    def exists(self, path: str) -> bool:
        return (self.root / path).exists()

    def list(self, directory: str) -> dict[str, float]:
        with self._os_errors(f"list {directory}"):
            try:
                entries = list(os.scandir(self.root / directory))
            except FileNotFoundError:
                return {}
            return {e.name: e.stat().st_mtime for e in entries}

    def delete(self, path: str) -> None:
        with self._os_errors(f"delete {path}"):
            (self.root / path).unlink(missing_ok=True)

    def makedirs(self, directory: str) -> None:
        with self._os_errors(f"create {directory}"):
            (self.root / directory).mkdir(parents=True, exist_ok=True)


class SSHTransport(Transport):
    """A directory on an SSH host, through fabric and SFTP; one SFTP channel per worker thread."""

    parallelism = 4

    def __init__(self, location: str, ssh: SSHSection):
        parts = urlsplit(location)
        if not parts.hostname or not parts.path or parts.path == "/":
            raise UserError(f"store {location!r}: expected ssh://[user@]host[:port]/path")
        self.location = location
        self.root = parts.path
        self._host = SSHHost(parts.hostname, ssh, user=parts.username, port=parts.port)
        self._idle: list = []
        self._opened: list = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _sftp(self) -> Iterator:
        """An SFTP channel for one operation. Channels are reused, so their number stays the number of
        operations running at once (OpenSSH allows 10 per connection by default)."""
        with self._lock:
            sftp = self._idle.pop() if self._idle else None
        if sftp is None:
            sftp = self._host.conn.client.open_sftp()
            with self._lock:
                self._opened.append(sftp)
        try:
            yield sftp
        finally:
            with self._lock:
                self._idle.append(sftp)

    def _path(self, path: str) -> str:
        return posixpath.join(self.root, path)

    @contextlib.contextmanager
    def _io_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as e:
            raise UserError(f"store {self.location}: cannot {what}: {e}") from None

    def get(self, path: str) -> bytes:
        with self._io_errors(f"read {path}"), self._sftp() as sftp, sftp.open(self._path(path), "rb") as f:
            f.prefetch()
            return f.read()

    def _write_temp(self, sftp, path: str, data: bytes) -> str:
        tmp = self._path(_temp_name(path))
        try:
            with sftp.open(tmp, "wb") as f:
                f.set_pipelined(True)
                f.write(data)
        except BaseException:
            with contextlib.suppress(OSError):
                sftp.remove(tmp)
            raise
        return tmp

    def put(self, path: str, data: bytes) -> None:
        with self._io_errors(f"write {path}"), self._sftp() as sftp:
            sftp.posix_rename(self._write_temp(sftp, path, data), self._path(path))

    def publish(self, path: str, data: bytes) -> None:
        with self._io_errors(f"publish {path}"), self._sftp() as sftp:
            tmp = self._write_temp(sftp, path, data)
            try:
                # Plain SFTP rename refuses an existing target (OpenSSH implements it with link()).
                sftp.rename(tmp, self._path(path))
            except OSError as rename_error:
                with contextlib.suppress(OSError):
                    sftp.remove(tmp)
                try:
                    sftp.stat(self._path(path))
                except FileNotFoundError:
                    raise rename_error from None  # it failed for another reason
                raise FileExistsError(path) from None

    def exists(self, path: str) -> bool:
        with self._io_errors(f"look up {path}"), self._sftp() as sftp:
            try:
                sftp.stat(self._path(path))
            except FileNotFoundError:
                return False
            return True

    def list(self, directory: str) -> dict[str, float]:
        with self._io_errors(f"list {directory}"), self._sftp() as sftp:
            try:
                entries = sftp.listdir_attr(self._path(directory))
            except FileNotFoundError:
                return {}
            return {e.filename: float(e.st_mtime or 0) for e in entries}

    def delete(self, path: str) -> None:
        with self._io_errors(f"delete {path}"), self._sftp() as sftp, contextlib.suppress(FileNotFoundError):
            sftp.remove(self._path(path))

    def makedirs(self, directory: str) -> None:
        with self._io_errors(f"create {directory}"), self._sftp() as sftp:
            full = self._path(directory)
            current = "/" if full.startswith("/") else ""
            for part in filter(None, full.split("/")):
                current = posixpath.join(current, part) if current else part
                try:
                    sftp.stat(current)
                except FileNotFoundError:
                    sftp.mkdir(current)

    def close(self) -> None:
        for sftp in self._opened:
            sftp.close()
        self._host.close()


def build_transport(location: str, ssh: SSHSection) -> Transport:
    """The transport for a store string: `ssh://[user@]host[:port]/path`, or a local directory."""
    if location.startswith("ssh://"):
        return SSHTransport(location, ssh)
    if "://" in location:
        raise UserError(f"store {location!r}: unsupported scheme; use a directory or ssh://[user@]host[:port]/path")
    return LocalTransport(Path(location).expanduser())
