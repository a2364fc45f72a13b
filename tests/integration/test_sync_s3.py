"""s3:// stores against a local S3 emulator (moto's server mode, started by the tests on 127.0.0.1): push, pull,
verify, gc and relay as with directories; versions published exclusively by conditional writes; a push killed
with -9 in the middle of a multipart upload resumes it; a damaged object is refused with one message."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

import boto3
import numpy as np
import pytest

from composer.recipes.errors import UserError
from composer.runtime.processes import free_port
from composer.sync.checkpoint import write_safetensors
from composer.sync.manifest import Manifest
from composer.sync.pusher import push_version
from composer.sync.rebuild import verify
from composer.sync.receiver import pull, relay
from composer.sync.store import Store, VersionTakenError
from tests.helpers.sync_testing import REPO, TrainingRun, checkpoint_files, run_cli, sync_section, to_bf16

BUCKET = "composer-sync"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "emulator", "AWS_SECRET_ACCESS_KEY": "emulator", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_emulator(tmp_path_factory):
    """moto's S3 emulator in server mode on loopback, with one bucket; yields its endpoint URL."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the S3 emulator did not start") from None
                time.sleep(0.1)
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        proc.kill()
        proc.wait()
        log.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint)


def test_push_pull_verify_gc_and_relay_through_s3(s3_emulator, tmp_path):
    store = f"s3://{BUCKET}/runs/a"
    run = TrainingRun(tmp_path / "train")
    section = sync_section(store, anchor_every=2, endpoint=s3_emulator)
    checkpoints = [run.save()] + [run.next_checkpoint() for _ in range(3)]
    for checkpoint in checkpoints:
        push_version(checkpoint, section, cache_dir=tmp_path / "cache")
    with Store.open(store, endpoint=s3_emulator) as s3:
        assert s3.versions() == ["v00000001", "v00000002", "v00000003", "v00000004"]
        pull(s3, tmp_path / "recv", "v00000002")
        assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(checkpoints[1])
        pull(s3, tmp_path / "recv")  # v3 is an anchor, v4 a delta on it
        assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(checkpoints[3])
        assert len(verify(s3).versions) == 4
        with Store.open(str(tmp_path / "cluster"), create=True) as cluster:  # relay out of S3...
            assert relay(s3, cluster).versions == ["v00000003", "v00000004"]  # the head's chain
        _client(s3_emulator).create_multipart_upload(Bucket=BUCKET, Key="runs/a/chunks/abandoned")  # a killed push's
        report = s3.gc(keep_anchors=1, min_age_s=0)
        assert report.deleted_versions == ["v00000001", "v00000002"] and report.deleted_chunks > 0
        assert not _client(s3_emulator).list_multipart_uploads(Bucket=BUCKET, Prefix="runs/a/").get("Uploads")
        assert len(verify(s3).versions) == 2  # what gc kept is whole
    with (
        Store.open(str(tmp_path / "cluster")) as cluster,
        Store.open(f"s3://{BUCKET}/runs/b", create=True, endpoint=s3_emulator) as other,
    ):  # ...and into S3
        relay(cluster, other)
        pull(other, tmp_path / "recv-b")
    assert checkpoint_files(tmp_path / "recv-b" / "current") == checkpoint_files(checkpoints[3])


def test_versions_are_published_exclusively(s3_emulator, tmp_path):
    run = TrainingRun(tmp_path / "train")
    section = sync_section(f"s3://{BUCKET}/race", endpoint=s3_emulator)
    push_version(run.save(), section, cache_dir=tmp_path / "cache")
    with Store.open(section.store, endpoint=s3_emulator) as s3:
        manifest = Manifest.from_bytes(s3.manifest("v00000001").to_bytes(), "copy")
        manifest.created = "someone else"
        with pytest.raises(VersionTakenError, match="published by another pusher"):
            s3.publish(manifest)
    with Store.open(section.store, endpoint=s3_emulator) as s3:
        assert s3.manifest("v00000001").created != "someone else"


PUSH_SCRIPT = """
import sys
from pathlib import Path
from composer.sync.pusher import push_version
from tests.helpers.sync_testing import sync_section
push_version(sys.argv[1], sync_section(sys.argv[2], endpoint=sys.argv[3], codec={"chunk_mb": 32, "threads": 1}),
             cache_dir=Path(sys.argv[4]))
"""


def test_push_killed_in_a_multipart_upload_resumes_it(s3_emulator, tmp_path):
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    rng = np.random.default_rng(0)
    write_safetensors(
        checkpoint / "model.safetensors",
        {  # 48 MiB of bf16 noise: a first chunk of ~33 MB
            f"layer{i}.weight": ("BF16", to_bf16(rng.standard_normal((1024, 2048)).astype(np.float32))) for i in range(12)
        },
    )
    store, client = f"s3://{BUCKET}/killed", _client(s3_emulator)
    proc = subprocess.Popen(
        [sys.executable, "-c", PUSH_SCRIPT, str(checkpoint), store, s3_emulator, str(tmp_path / "c1")],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    upload, before = None, []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and len(before) < 2:
        uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix="killed/").get("Uploads", [])
        if uploads:
            upload = uploads[0]
            before = client.list_parts(Bucket=BUCKET, Key=upload["Key"], UploadId=upload["UploadId"]).get("Parts", [])
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the push finished before it could be killed"
    before = client.list_parts(Bucket=BUCKET, Key=upload["Key"], UploadId=upload["UploadId"]).get("Parts", [])
    with Store.open(store, endpoint=s3_emulator) as s3:
        assert s3.versions() == []  # the manifest comes last: no visible version

    sent: list[tuple[str, int]] = []
    session = boto3._get_default_session()
    counter = lambda params, **kw: sent.append((params["Key"], params["PartNumber"]))  # noqa: E731
    session.events.register("provide-client-params.s3.UploadPart", counter)
    try:
        push_version(checkpoint, sync_section(store, endpoint=s3_emulator, codec={"chunk_mb": 32, "threads": 1}), cache_dir=tmp_path / "c2")
    finally:
        session.events.unregister("provide-client-params.s3.UploadPart", counter)
    size = client.head_object(Bucket=BUCKET, Key=upload["Key"])["ContentLength"]
    total_parts = math.ceil(size / (8 << 20))
    resent = sorted(n for key, n in sent if key == upload["Key"])
    assert resent == sorted(set(range(1, total_parts + 1)) - {p["PartNumber"] for p in before})  # only what was missing
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix="killed/").get("Uploads")  # completed, not restarted
    with Store.open(store, endpoint=s3_emulator) as s3:
        pull(s3, tmp_path / "recv")
    assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(checkpoint)


def test_a_damaged_object_is_refused_with_one_message(s3_emulator, tmp_path):
    run = TrainingRun(tmp_path / "train")
    store = f"s3://{BUCKET}/damaged"
    push_version(run.save(), sync_section(store, endpoint=s3_emulator), cache_dir=tmp_path / "cache")
    client = _client(s3_emulator)
    chunk = next(
        o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="damaged/chunks/")["Contents"] if not o["Key"].endswith("/")
    )
    data = bytearray(client.get_object(Bucket=BUCKET, Key=chunk)["Body"].read())
    data[len(data) // 2] ^= 0x10
    client.put_object(Bucket=BUCKET, Key=chunk, Body=bytes(data))
    result = run_cli("sync", "pull", "--store", store, "--endpoint", s3_emulator, "--to", str(tmp_path / "recv"))
    assert result.returncode != 0
    assert "damaged (hash mismatch)" in result.stderr and chunk.rsplit("/", 1)[1] in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "recv" / "current").exists()


def test_a_missing_bucket_and_a_misplaced_endpoint_are_clear_errors(s3_emulator, tmp_path):
    with pytest.raises(UserError, match="bucket 'no-such-bucket' does not exist"):
        push_version(
            TrainingRun(tmp_path / "train").save(),
            sync_section("s3://no-such-bucket/x", endpoint=s3_emulator),
            cache_dir=tmp_path / "cache",
        )
    result = run_cli("sync", "status", "--store", str(tmp_path), "--endpoint", s3_emulator)
    assert result.returncode != 0 and "sync.endpoint is only for s3:// stores" in result.stderr
