"""The store under failure: damaged or missing data is refused with nothing published, crashed pushes
resume without re-sending, racing pushers cannot both publish, a full disk is a clear error; gc and relay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from composer.recipes.errors import UserError
from composer.sync.checkpoint import write_safetensors
from composer.sync.codec import CorruptDataError
from composer.sync.pusher import push_version
from composer.sync.rebuild import WrongBaseError, verify
from composer.sync.receiver import pull, relay
from composer.sync.store import CHUNKS, MANIFESTS, Store, VersionTakenError
from tests.helpers.sync_testing import REPO, TrainingRun, checkpoint_files, kill_once_chunks_are_written, sync_section, to_bf16


@pytest.fixture
def two_versions(tmp_path):
    """A store with an anchor v1 and a delta v2, and a receiver at v1."""
    run = TrainingRun(tmp_path / "train")
    section = sync_section(tmp_path / "store")
    push_version(run.save(), section, cache_dir=tmp_path / "cache")
    push_version(run.next_checkpoint(), section, cache_dir=tmp_path / "cache")
    receiver = tmp_path / "recv"
    with Store.open(section.store) as store:
        pull(store, receiver, "v00000001")
        delta_chunks = sorted(store.manifest("v00000002").chunk_ids() - store.manifest("v00000001").chunk_ids())
    assert delta_chunks
    return Path(section.store), receiver, delta_chunks, run


def _assert_still_at_v1(receiver: Path) -> None:
    assert os.readlink(receiver / "current") == "versions/v00000001"
    assert sorted(p.name for p in (receiver / "versions").iterdir()) == ["v00000001"]  # no half-written version


def _pull_v2(store_dir: Path, receiver: Path) -> None:
    with Store.open(str(store_dir)) as store:
        pull(store, receiver, "v00000002")


def test_flipped_bit_in_a_chunk_is_refused_and_nothing_is_published(two_versions):
    store_dir, receiver, chunks, _ = two_versions
    path = store_dir / CHUNKS / chunks[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match=f"chunk {chunks[0]} .*damaged"):
        _pull_v2(store_dir, receiver)
    _assert_still_at_v1(receiver)
    with Store.open(str(store_dir)) as store, pytest.raises(CorruptDataError, match="damaged"):
        verify(store)


def test_truncated_chunk_is_refused(two_versions):
    store_dir, receiver, chunks, _ = two_versions
    path = store_dir / CHUNKS / chunks[0]
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CorruptDataError, match="damaged"):
        _pull_v2(store_dir, receiver)
    _assert_still_at_v1(receiver)


def test_missing_chunk_is_refused_naming_the_version(two_versions):
    store_dir, receiver, chunks, _ = two_versions
    (store_dir / CHUNKS / chunks[0]).unlink()
    with pytest.raises(CorruptDataError, match=r"missing") as error:
        _pull_v2(store_dir, receiver)
    assert "v00000002" in str(error.value)
    _assert_still_at_v1(receiver)


@pytest.mark.parametrize("damage", ["truncate", "edit"])
def test_damaged_manifest_is_refused(two_versions, damage):
    store_dir, receiver, _, _ = two_versions
    path = store_dir / MANIFESTS / "v00000002.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2] if damage == "truncate" else text.replace('"changed":', '"changed":1', 1))
    with pytest.raises(CorruptDataError, match="manifest is damaged"):
        _pull_v2(store_dir, receiver)
    _assert_still_at_v1(receiver)


def test_delta_on_a_modified_base_is_refused(two_versions):
    store_dir, receiver, _, _ = two_versions
    shard = receiver / "current" / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # someone edited the receiver's copy
    shard.write_bytes(bytes(data))
    with pytest.raises(WrongBaseError, match="the base does not match version v00000001"):
        _pull_v2(store_dir, receiver)
    _assert_still_at_v1(receiver)


def test_pusher_rebuilds_a_tampered_base_cache_from_the_store(two_versions, tmp_path):
    store_dir, _, _, run = two_versions
    cached = tmp_path / "cache" / "current" / "model-00002-of-00002.safetensors"
    os.unlink(cached)  # break the hard link, then change the cache's copy
    original = (run.root / "step0001" / cached.name).read_bytes()
    cached.write_bytes(original[:-8] + b"\xff" * 8)
    info = push_version(run.next_checkpoint(), sync_section(store_dir), cache_dir=tmp_path / "cache")
    assert not info.is_anchor
    with Store.open(str(store_dir)) as store:
        pull(store, tmp_path / "fresh", info.id)
    assert checkpoint_files(tmp_path / "fresh" / "current") == checkpoint_files(run.root / "step0002")


PUSH_SCRIPT = """
import sys
from pathlib import Path
from composer.recipes.schema import SyncSection
from composer.sync.pusher import push_version
push_version(sys.argv[1], SyncSection(store=sys.argv[2], codec={"chunk_mb": 1, "threads": 1}), cache_dir=Path(sys.argv[3]))
"""


def _big_checkpoint(directory: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    tensors = {f"layer{i}.weight": ("BF16", to_bf16(rng.standard_normal((1024, 1024)).astype(np.float32))) for i in range(12)}
    write_safetensors(directory / "model.safetensors", tensors)
    return directory


@pytest.mark.parametrize("kill_after_chunks", [1, 6])
def test_push_killed_midway_publishes_nothing_and_a_rerun_skips_existing_chunks(tmp_path, kill_after_chunks):
    checkpoint = _big_checkpoint(tmp_path / "ck", seed=1)
    store_dir = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-c", PUSH_SCRIPT, str(checkpoint), str(store_dir), str(tmp_path / "c1")],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    chunk_dir = store_dir / CHUNKS
    kill_once_chunks_are_written(proc, chunk_dir, kill_after_chunks, 60)
    with Store.open(str(store_dir)) as store:
        assert store.versions() == []  # the manifest comes last: no visible version
    before = {e.name: (e.inode(), e.stat().st_mtime_ns) for e in os.scandir(chunk_dir) if not e.name.startswith(".")}
    assert len(before) >= kill_after_chunks

    info = push_version(checkpoint, sync_section(store_dir, codec={"chunk_mb": 1, "threads": 1}), cache_dir=tmp_path / "c2")
    assert info.id == "v00000001"
    assert info.chunks_skipped >= len(before)
    after = {e.name: (e.inode(), e.stat().st_mtime_ns) for e in os.scandir(chunk_dir) if e.name in before}
    assert after == before  # existing chunks were not sent again
    with Store.open(str(store_dir)) as store:
        pull(store, tmp_path / "recv")
    assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(checkpoint)


def test_a_pusher_that_loses_the_race_gets_a_clear_error(tmp_path):
    run = TrainingRun(tmp_path / "train")
    section = sync_section(tmp_path / "store")
    push_version(run.save(), section, cache_dir=tmp_path / "cache_a")
    mine = run.next_checkpoint()
    theirs = run.next_checkpoint()
    raced = []

    def other_pusher_publishes_meanwhile(_nbytes: int) -> None:
        if not raced:
            raced.append(push_version(theirs, section, cache_dir=tmp_path / "cache_b"))

    with pytest.raises(VersionTakenError, match="v00000002 was published by another pusher"):
        push_version(mine, section, cache_dir=tmp_path / "cache_a", on_progress=other_pusher_publishes_meanwhile)
    assert raced[0].id == "v00000002"
    with Store.open(section.store) as store:
        assert store.versions() == ["v00000001", "v00000002"]
        pull(store, tmp_path / "recv")
    assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(theirs)
    # the loser pushes again and builds on the new head
    retry = push_version(mine, section, cache_dir=tmp_path / "cache_a")
    assert (retry.id, retry.parent) == ("v00000003", "v00000002")


def test_concurrent_pusher_processes_never_share_a_version(tmp_path):
    run = TrainingRun(tmp_path / "train")
    store_dir = tmp_path / "store"
    push_version(run.save(), sync_section(store_dir), cache_dir=tmp_path / "cache0")
    checkpoints = [run.next_checkpoint() for _ in range(3)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PUSH_SCRIPT, str(ck), str(store_dir), str(tmp_path / f"c{i}")],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, ck in enumerate(checkpoints)
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    for code, err in results:
        assert code == 0 or "published by another pusher" in err, err
    winners = sum(code == 0 for code, _ in results)
    with Store.open(str(store_dir)) as store:
        versions = store.versions()
        assert len(versions) == 1 + winners
        verify(store)


def test_full_disk_is_a_clear_error_and_publishes_nothing(tmp_path):
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        checkpoint = _big_checkpoint(tmp_path / "ck", seed=2)  # ~24 MB, far more than fits
        with pytest.raises(UserError, match="disk is full"):
            push_version(checkpoint, sync_section(mount_point / "store"), cache_dir=tmp_path / "cache")
        with Store.open(str(mount_point / "store")) as store:
            assert store.versions() == []
        assert not [n for n in os.listdir(mount_point / "store" / CHUNKS) if n.startswith(".tmp-")]
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_gc_keeps_the_newest_anchor_chains_and_only_their_chunks(tmp_path):
    run = TrainingRun(tmp_path / "train")
    section = sync_section(tmp_path / "store", anchor_every=2)
    push_version(run.save(), section, cache_dir=tmp_path / "cache")
    for _ in range(5):
        push_version(run.next_checkpoint(), section, cache_dir=tmp_path / "cache")
    with Store.open(section.store) as store:
        in_flight, _ = store.put_chunk(b"a chunk of a push whose manifest is not published yet")
        report = store.gc(keep_anchors=2, min_age_s=3600)
        assert report.kept_versions == ["v00000003", "v00000004", "v00000005", "v00000006"]
        assert report.deleted_versions == ["v00000001", "v00000002"]
        assert store.has_chunk(in_flight)  # too young to collect
        report = store.gc(keep_anchors=1, min_age_s=0)
        assert store.versions() == ["v00000005", "v00000006"]
        referenced = store.manifest("v00000005").chunk_ids() | store.manifest("v00000006").chunk_ids()
        assert set(os.listdir(Path(section.store) / CHUNKS)) == referenced
        verify(store)
        pull(store, tmp_path / "recv")
    assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(run.root / "step0005")


def test_relay_copies_the_chain_once_and_serves_pulls(tmp_path):
    run = TrainingRun(tmp_path / "train")
    section = sync_section(tmp_path / "origin")
    push_version(run.save(), section, cache_dir=tmp_path / "cache")
    push_version(run.next_checkpoint(), section, cache_dir=tmp_path / "cache")
    with Store.open(section.store) as origin, Store.open(str(tmp_path / "cluster"), create=True) as cluster:
        first = relay(origin, cluster)
        assert first.versions == ["v00000001", "v00000002"] and first.chunks_copied > 0
        again = relay(origin, cluster)
        assert again.versions == [] and again.chunks_copied == 0
        pull(cluster, tmp_path / "recv")
    assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(run.root / "step0001")


PULL_SCRIPT = """
import sys
from pathlib import Path
from composer.sync.receiver import pull
from composer.sync.store import Store
with Store.open(sys.argv[1]) as store:
    pull(store, Path(sys.argv[2]), threads=1)
"""


def test_pull_killed_midway_leaves_the_previous_version_current(tmp_path):
    store_dir, receiver = tmp_path / "store", tmp_path / "recv"
    section = sync_section(store_dir, codec={"chunk_mb": 1, "threads": 1})
    push_version(_big_checkpoint(tmp_path / "ck0", seed=3), section, cache_dir=tmp_path / "cache")
    with Store.open(str(store_dir)) as store:
        pull(store, receiver)
    push_version(_big_checkpoint(tmp_path / "ck1", seed=4), section, cache_dir=tmp_path / "cache")  # all new bits
    proc = subprocess.Popen([sys.executable, "-c", PULL_SCRIPT, str(store_dir), str(receiver)], env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and not list((receiver / "versions").glob(".tmp-*")):
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the pull finished before it could be killed"
    assert list((receiver / "versions").glob(".tmp-*"))  # killed while writing...
    assert os.readlink(receiver / "current") == "versions/v00000001"  # ...readers still see the previous version
    assert checkpoint_files(receiver / "current") == checkpoint_files(tmp_path / "ck0")
    with Store.open(str(store_dir)) as store:
        pull(store, receiver)
    assert checkpoint_files(receiver / "current") == checkpoint_files(tmp_path / "ck1")
    assert not list((receiver / "versions").glob(".tmp-*"))


def test_verify_checks_a_piece_whose_chain_ends_where_another_piece_goes_on(tmp_path):
    """The next version stores piece 1 raw (densely changed) and piece 0 as a delta: piece 1 of this version
    must still be rebuilt and checked by itself."""
    from composer.sync.manifest import Manifest

    a = np.random.default_rng(0).integers(0, 65535, 1 << 20, dtype=np.uint16)  # two 1 MiB pieces as bf16
    b = a.copy()
    b[[5, 600000]] ^= 1
    c = b.copy()
    c[7] ^= 1
    c[524288:] = 0
    section = sync_section(tmp_path / "store")
    for i, values in enumerate((a, b, c)):
        (tmp_path / f"ck{i}").mkdir()
        write_safetensors(tmp_path / f"ck{i}" / "m.safetensors", {"w": ("BF16", values)})
        push_version(tmp_path / f"ck{i}", section, cache_dir=tmp_path / "cache")
    path = tmp_path / "store" / MANIFESTS / "v00000002.json"
    manifest = Manifest.from_bytes(path.read_bytes(), "test")
    manifest.tensors["w"].pieces[1].hash = "0" * 32  # a wrong hash in a well-formed manifest
    path.write_bytes(manifest.to_bytes())
    with Store.open(str(tmp_path / "store")) as store:
        assert [p.encoding for p in store.manifest("v00000003").tensors["w"].pieces][1] == "raw"
        with pytest.raises(CorruptDataError):
            verify(store)
