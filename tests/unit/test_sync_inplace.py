"""`update_in_place`: a receiver moved to a new version by rewriting only the pieces that differ, in its one copy;
bit-exact with a full pull, safe against kill -9 and against a copy modified behind its back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from composer.sync.checkpoint import write_safetensors
from composer.sync.pusher import push_version
from composer.sync.receiver import ReceiverDir, pull, update_in_place
from composer.sync.store import Store
from tests.helpers.sync_testing import REPO, TrainingRun, checkpoint_files, run_cli, sync_section, to_bf16


def _history(tmp_path: Path, steps: int) -> tuple[Store, list[Path]]:
    run = TrainingRun(tmp_path / "train", density=0.01)
    section = sync_section(tmp_path / "store", anchor_every=100)
    checkpoints = [run.save()] + [run.next_checkpoint() for _ in range(steps)]
    for checkpoint in checkpoints:
        push_version(checkpoint, section, cache_dir=tmp_path / "cache")
    return Store.open(section.store), checkpoints


def test_in_place_updates_equal_full_pulls_and_keep_one_copy(tmp_path):
    store, checkpoints = _history(tmp_path, 3)
    receiver = tmp_path / "recv"
    pull(store, receiver, "v00000001")
    for seq in (2, 4, 1):  # one step, two steps along the chain, then back: off the chain, rebuilt from the anchor
        info = update_in_place(store, receiver, f"v{seq:08d}")
        assert not info.full
        assert checkpoint_files(receiver / "current") == checkpoint_files(checkpoints[seq - 1])
        assert [p.name for p in (receiver / "versions").iterdir()] == [f"v{seq:08d}"]  # the one copy, renamed
        assert ReceiverDir(receiver).current_id() == f"v{seq:08d}"
    # the step changed about 1% of the bf16 weights and the step counter: every tensor differs, but only
    # the pieces that differ are written, and nothing is downloaded twice
    assert set(info.changed) == {"model.embed.weight", "model.layers.0.mlp.weight", "model.norm.weight", "model.step"}
    fresh = update_in_place(store, tmp_path / "fresh", "v00000003")  # nothing held yet: a full pull
    assert fresh.full and checkpoint_files(tmp_path / "fresh" / "current") == checkpoint_files(checkpoints[2])


def test_a_modified_receiver_copy_is_rebuilt_not_patched(tmp_path):
    store, checkpoints = _history(tmp_path, 1)
    receiver = tmp_path / "recv"
    pull(store, receiver, "v00000001")
    path = receiver / "current" / "model-00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # inside model.layers.0.mlp.weight, which the next version changes
    path.write_bytes(bytes(data))
    info = update_in_place(store, receiver, "v00000002")
    assert info.full
    assert checkpoint_files(receiver / "current") == checkpoint_files(checkpoints[1])


def test_a_hard_linked_copy_is_never_written_through(tmp_path):
    store, checkpoints = _history(tmp_path, 1)
    receiver = tmp_path / "recv"
    pull(store, receiver, "v00000001")
    held = receiver / "current" / "model-00001-of-00002.safetensors"
    os.link(held, tmp_path / "other-link")
    before = (tmp_path / "other-link").read_bytes()
    assert update_in_place(store, receiver, "v00000002").full
    assert (tmp_path / "other-link").read_bytes() == before
    assert checkpoint_files(receiver / "current") == checkpoint_files(checkpoints[1])


UPDATE_SCRIPT = """
import sys
from pathlib import Path
from composer.sync.receiver import update_in_place
from composer.sync.store import Store
with Store.open(sys.argv[1]) as store:
    update_in_place(store, Path(sys.argv[2]), threads=1)
"""


def test_update_killed_while_patching_is_rebuilt_from_the_anchor(tmp_path):
    store_dir, receiver = tmp_path / "store", tmp_path / "recv"
    section = sync_section(store_dir, codec={"chunk_mb": 1, "threads": 1})
    rng = np.random.default_rng(0)
    for seq in range(2):  # all new bits, so every piece is rewritten and the kill lands mid-patch
        directory = tmp_path / f"ck{seq}"
        directory.mkdir()
        write_safetensors(
            directory / "model.safetensors",
            {f"layer{i}.weight": ("BF16", to_bf16(rng.standard_normal((1024, 1024)).astype(np.float32))) for i in range(12)},
        )
        push_version(directory, section, cache_dir=tmp_path / "cache")
        if seq == 0:
            with Store.open(str(store_dir)) as store:
                pull(store, receiver)
    proc = subprocess.Popen(
        [sys.executable, "-c", UPDATE_SCRIPT, str(store_dir), str(receiver)], env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and not (receiver / ".patching").exists():
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the update finished before it could be killed"
    assert ReceiverDir(receiver).current_id() is None  # half-patched: no version claims it
    result = run_cli("sync", "pull", "--store", str(store_dir), "--to", str(receiver), "--in-place")
    assert result.returncode == 0, result.stderr
    assert "full copy" in result.stdout
    assert checkpoint_files(receiver / "current") == checkpoint_files(tmp_path / "ck1")
    assert [p.name for p in (receiver / "versions").iterdir()] == ["v00000002"]
