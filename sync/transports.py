"""Where a store's files live: a local (or shared) directory, a directory on an SSH host, or an S3 bucket.

One small interface, one factory (`build_transport`) chosen by the store string. Every write is atomic
(temp file then rename; on S3 an object appears whole); `publish` is atomic AND exclusive (it fails if the
name exists: link/rename on files, a conditional write on S3), which is how two racing pushers are kept from
publishing the same version. Paths are '/'-separated, relative to the root.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from composer.cluster.ssh import SSHHost
from composer.recipes.errors import UserError
from composer.recipes.schema import SSHSection
from composer.runtime.run_dir import fsync_dir


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

    def abort_partial_uploads(self, min_age_s: float) -> int:
        """Drop uploads that were started at least `min_age_s` ago and never finished (where a transport keeps
        them apart from files: S3 multipart uploads); returns how many."""
        return 0


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


class S3Transport(Transport):
    """A prefix in an S3 bucket (AWS or any S3-compatible endpoint), through boto3 with its standard retry mode
    (exponential backoff with jitter on throttling, 5xx and dropped connections). Credentials come from boto3's
    usual chain (environment, ~/.aws, instance role). Objects above `part_bytes` go up as multipart uploads that
    a rerun resumes: parts already uploaded with the same content are not sent again (object names are content
    hashes, so a rerun uploads the same bytes). Manifests are published with a conditional write
    (If-None-Match: *), which S3 and most compatible stores implement."""

    parallelism = 8

    def __init__(self, location: str, endpoint: str | None = None, part_bytes: int = 8 << 20):
        import boto3
        from botocore.config import Config

        parts = urlsplit(location)
        if not parts.netloc or parts.query or parts.fragment:
            raise UserError(f"store {location!r}: expected s3://bucket[/prefix]")
        self.location = location
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.part_bytes = max(part_bytes, 5 << 20)  # S3's smallest part
        config = Config(
            retries={"max_attempts": 10, "mode": "standard"},
            connect_timeout=15,
            read_timeout=120,
            max_pool_connections=2 * self.parallelism,
            s3={"addressing_style": "path"} if endpoint else None,
        )
        self._client = boto3.client("s3", endpoint_url=endpoint, config=config)
        self.where = f"{location}" + (f" at {endpoint}" if endpoint else "")

    def _key(self, path: str) -> str:
        return posixpath.join(self.prefix, path) if self.prefix else path

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """S3 failures as FileNotFoundError / FileExistsError or one UserError that says what to fix."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            yield
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(what) from None
            if code == "PreconditionFailed" or status == 412:
                raise FileExistsError(what) from None
            if code == "NoSuchBucket":
                raise UserError(f"store {self.where}: bucket {self.bucket!r} does not exist; create it first") from None
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
                raise UserError(
                    f"store {self.where}: access denied ({code}) when trying to {what}; check the "
                    "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws)"
                ) from None
            if code == "NotImplemented" or status == 501:
                raise UserError(
                    f"store {self.where}: the endpoint does not implement what sync needs to {what} (conditional writes, If-None-Match)"
                ) from None
            raise UserError(f"store {self.where}: cannot {what}: {code or status} {e}") from None
        except NoCredentialsError:
            raise UserError(
                f"store {self.where}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or configure ~/.aws)"
            ) from None
        except BotoCoreError as e:
            raise UserError(f"store {self.where}: cannot {what}: {e}") from None

    def get(self, path: str) -> bytes:
        with self._errors(f"read {path}"):
            return self._client.get_object(Bucket=self.bucket, Key=self._key(path))["Body"].read()

    def put(self, path: str, data: bytes) -> None:
        self._write(path, data, exclusive=False)

    def publish(self, path: str, data: bytes) -> None:
        self._write(path, data, exclusive=True)

    def _write(self, path: str, data: bytes, exclusive: bool) -> None:
        condition = {"IfNoneMatch": "*"} if exclusive else {}
        with self._errors(f"{'publish' if exclusive else 'write'} {path}"):
            if len(data) <= self.part_bytes:
                self._client.put_object(Bucket=self.bucket, Key=self._key(path), Body=data, **condition)
            else:
                self._multipart(self._key(path), memoryview(data), condition)

    def _multipart(self, key: str, data: memoryview, condition: dict) -> None:
        """Upload in parts, continuing an unfinished upload of the same key where one exists."""
        upload_id, uploaded = None, {}
        listing = self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=key)
        for upload in listing.get("Uploads", []):
            if upload["Key"] == key:
                upload_id = upload["UploadId"]
        if upload_id is None:
            upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        else:
            for page in self._client.get_paginator("list_parts").paginate(Bucket=self.bucket, Key=key, UploadId=upload_id):
                uploaded.update((p["PartNumber"], p["ETag"].strip('"')) for p in page.get("Parts", []))
        parts = []
        for number, start in enumerate(range(0, len(data), self.part_bytes), start=1):
            body = data[start : start + self.part_bytes]
            etag = hashlib.md5(body, usedforsecurity=False).hexdigest()  # S3's ETag of an unencrypted part
            if uploaded.get(number) != etag:
                etag = self._client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=bytes(body))[
                    "ETag"
                ].strip('"')
            parts.append({"PartNumber": number, "ETag": f'"{etag}"'})
        self._client.complete_multipart_upload(
            Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **condition
        )

    def exists(self, path: str) -> bool:
        keys = [self._key(path)] + ([self._key(path) + "/"] if "/" not in path else [])  # or a directory's marker
        for key in keys:
            try:
                with self._errors(f"look up {path}"):
                    self._client.head_object(Bucket=self.bucket, Key=key)
                return True
            except FileNotFoundError:
                continue
        return False

    def list(self, directory: str) -> dict[str, float]:
        prefix = self._key(directory) + "/"
        found: dict[str, float] = {}
        with self._errors(f"list {directory}"):
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for entry in page.get("Contents", []):
                    name = entry["Key"][len(prefix) :]
                    if name and "/" not in name:
                        found[name] = entry["LastModified"].timestamp()
        return found

    def delete(self, path: str) -> None:
        with self._errors(f"delete {path}"):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(path))

    def makedirs(self, directory: str) -> None:
        """S3 has no directories: an empty `<directory>/` object marks that the store was created."""
        if not self.exists(directory):
            with self._errors(f"create {directory}"):
                self._client.put_object(Bucket=self.bucket, Key=self._key(directory) + "/", Body=b"")

    def abort_partial_uploads(self, min_age_s: float) -> int:
        import time

        aborted = 0
        with self._errors("list unfinished uploads"):
            prefix = self._key("")
            for page in self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix):
                for upload in page.get("Uploads", []):
                    if time.time() - upload["Initiated"].timestamp() >= min_age_s:
                        self._client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                        aborted += 1
        return aborted

    def close(self) -> None:
        self._client.close()


def build_transport(location: str, ssh: SSHSection, endpoint: str | None = None) -> Transport:
    """The transport for a store string: `ssh://[user@]host[:port]/path`, `s3://bucket[/prefix]` (at `endpoint`,
    an S3-compatible URL, when given), or a local directory."""
    if location.startswith("ssh://"):
        return SSHTransport(location, ssh)
    if location.startswith("s3://"):
        return S3Transport(location, endpoint)
    if "://" in location:
        raise UserError(f"store {location!r}: unsupported scheme; use a directory, ssh://[user@]host[:port]/path or s3://bucket/prefix")
    return LocalTransport(Path(location).expanduser())
