"""Stores on an SSH host: a real OpenSSH server on loopback, host-key verification on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from composer.recipes.errors import UserError
from composer.recipes.schema import SSHSection
from composer.runtime.processes import free_port
from composer.sync.manifest import Manifest
from composer.sync.pusher import push_version
from composer.sync.rebuild import verify
from composer.sync.receiver import pull, relay
from composer.sync.store import Store, VersionTakenError
from tests.conftest import keygen
from tests.helpers.sync_testing import TrainingRun, checkpoint_files, run_cli, sync_section

pytestmark = pytest.mark.ssh


def _ssh(sshd, **kw) -> SSHSection:
    _, key, known_hosts, _ = sshd
    return SSHSection(key_file=str(key), known_hosts=str(known_hosts), **kw)


def _url(sshd, path: Path) -> str:
    return f"ssh://root@127.0.0.1:{sshd[0]}{path}"


def test_push_pull_verify_gc_relay_over_ssh(sshd, tmp_path):
    ssh = _ssh(sshd)
    run = TrainingRun(tmp_path / "train")
    section = sync_section(_url(sshd, tmp_path / "remote"), anchor_every=2)
    first = push_version(run.save(), section, ssh, cache_dir=tmp_path / "cache")
    second = push_version(run.next_checkpoint(), section, ssh, cache_dir=tmp_path / "cache")
    assert first.chunks_sent > 0 and not second.is_anchor and second.ratio > 10
    assert (tmp_path / "remote" / "manifests" / "v00000002.json").is_file()  # really on the "remote" host
    again = push_version(run.root / "step0001", section, ssh, cache_dir=tmp_path / "cache")
    assert again.is_anchor and again.chunks_skipped > 0  # chunks already on the host are not re-sent
    # another trainer machine (empty base cache) pushes next: it fetches the head over SSH to diff against
    other = push_version(run.next_checkpoint(), section, ssh, cache_dir=tmp_path / "other-cache")
    assert (other.id, other.is_anchor) == ("v00000004", False)
    with Store.open(section.store, ssh) as store:
        pulled = pull(store, tmp_path / "recv", "v00000002")
        assert pulled.fetched_bytes > 0
        assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(run.root / "step0001")
        assert not (tmp_path / "recv" / ".incoming").exists()
        assert verify(store).versions == ["v00000001", "v00000002", "v00000003", "v00000004"]
        assert store.gc(keep_anchors=1, min_age_s=0).deleted_versions == ["v00000001", "v00000002"]
        with Store.open(str(tmp_path / "local"), create=True) as local:
            assert relay(store, local).versions == ["v00000003", "v00000004"]
            pull(local, tmp_path / "recv2")
    assert checkpoint_files(tmp_path / "recv2" / "current") == checkpoint_files(run.root / "step0002")


def test_publish_over_sftp_is_exclusive(sshd, tmp_path):
    ssh = _ssh(sshd)
    run = TrainingRun(tmp_path / "train")
    section = sync_section(_url(sshd, tmp_path / "remote"))
    push_version(run.save(), section, ssh, cache_dir=tmp_path / "cache")
    with Store.open(section.store, ssh) as a, Store.open(section.store, ssh) as b:
        manifest = a.manifest("v00000001")
        rival = Manifest.from_bytes(manifest.to_bytes(), "copy")
        rival.created = "another pusher's version"
        with pytest.raises(VersionTakenError, match="published by another pusher"):
            b.publish(rival)
    with Store.open(section.store, ssh) as store:
        assert store.manifest("v00000001").created == manifest.created


def test_cli_over_ssh(sshd, tmp_path):
    _, key, known_hosts, _ = sshd
    run = TrainingRun(tmp_path / "train")
    url = _url(sshd, tmp_path / "remote")
    auth = ["--ssh-key", str(key), "--known-hosts", str(known_hosts)]
    run.save()
    pushed = run_cli("sync", "push", str(run.root / "step0000"), "--store", url, "--cache", str(tmp_path / "c"), *auth)
    assert pushed.returncode == 0, pushed.stderr
    status = run_cli("sync", "status", "--store", url, *auth)
    assert status.returncode == 0 and "v00000001" in status.stdout
    pulled = run_cli("sync", "pull", "--store", url, "--to", str(tmp_path / "recv"), "--relay-store", str(tmp_path / "relay"), *auth)
    assert pulled.returncode == 0, pulled.stderr
    assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(run.root / "step0000")
    assert (tmp_path / "relay" / "manifests" / "v00000001.json").is_file()


def test_unknown_host_key_is_refused(sshd, tmp_path):
    other = tmp_path / "known_hosts"
    other.write_text("[127.0.0.1]:1 " + " ".join(keygen(tmp_path / "k").split()[:2]) + "\n")
    ssh = _ssh(sshd).model_copy(update={"known_hosts": str(other)})
    with pytest.raises(UserError, match=f"host key is not in {other}"):
        Store.open(_url(sshd, tmp_path / "remote"), ssh, create=True)
    assert not (tmp_path / "remote").exists()


def test_changed_host_key_is_refused(sshd, tmp_path):
    port = sshd[0]
    changed = tmp_path / "known_hosts"
    changed.write_text(f"[127.0.0.1]:{port} " + " ".join(keygen(tmp_path / "k").split()[:2]) + "\n")
    ssh = _ssh(sshd).model_copy(update={"known_hosts": str(changed)})
    with pytest.raises(UserError, match="host key does NOT match"):
        Store.open(_url(sshd, tmp_path / "remote"), ssh, create=True)


def test_unreachable_port_is_a_clear_error(sshd, tmp_path):
    url = f"ssh://root@127.0.0.1:{free_port()}{tmp_path}/remote"
    with pytest.raises(UserError, match="cannot connect"):
        Store.open(url, _ssh(sshd))
    result = run_cli("sync", "status", "--store", url, "--ssh-key", str(sshd[1]), "--known-hosts", str(sshd[2]))
    assert result.returncode == 2
    assert "cannot connect" in result.stderr and "Traceback" not in result.stderr


def test_many_parallel_transfers_share_one_connection(sshd, tmp_path):
    # OpenSSH allows 10 channels per connection: transfers from many short-lived threads must reuse them.
    from concurrent.futures import ThreadPoolExecutor

    with Store.open(_url(sshd, tmp_path / "remote"), _ssh(sshd), create=True) as store:
        for round_ in range(4):
            with ThreadPoolExecutor(8) as pool:
                ids = list(pool.map(lambda i: store.put_chunk(f"{round_}-{i}".encode() * 100)[0], range(24)))
            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(store.get_chunk, ids)) == [f"{round_}-{i}".encode() * 100 for i in range(24)]


def test_pull_over_ssh_resumes_and_refuses_damaged_chunks(sshd, tmp_path):
    ssh = _ssh(sshd)
    run = TrainingRun(tmp_path / "train")
    remote = tmp_path / "remote"
    section = sync_section(_url(sshd, remote), codec={"chunk_mb": 1, "threads": 2})
    push_version(run.save(), section, ssh, cache_dir=tmp_path / "cache")
    chunks = sorted((remote / "chunks").iterdir(), key=lambda p: p.stat().st_size)
    incoming = tmp_path / "recv" / ".incoming"
    incoming.mkdir(parents=True)
    (incoming / chunks[-1].name).write_bytes(chunks[-1].read_bytes())  # left by an interrupted pull
    (incoming / chunks[0].name).write_bytes(b"torn")  # a partial download is fetched again
    with Store.open(section.store, ssh) as store:
        info = pull(store, tmp_path / "recv")
    assert info.fetched_bytes == sum(p.stat().st_size for p in chunks[:-1])
    assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(run.root / "step0000")

    push_version(run.next_checkpoint(), section, ssh, cache_dir=tmp_path / "cache")
    with Store.open(section.store, ssh) as store:
        victim = remote / "chunks" / sorted(store.manifest("v00000002").chunk_ids() - store.manifest("v00000001").chunk_ids())[0]
        victim.write_bytes(victim.read_bytes()[::-1])
        with pytest.raises(UserError, match="damaged"):
            pull(store, tmp_path / "recv")
    assert os.readlink(tmp_path / "recv" / "current") == "versions/v00000001"
