"""Pushing a checkpoint held in memory as torch tensors (the RL learner's policy each step) gives the store the
versions that writing the same tensors as safetensors and pushing that directory gives: the same chunks, the same
manifests, the same bit-exact pulls; a tensor set that does not match its files, or a damaged previous version,
is one clear error with nothing published."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from composer.recipes.errors import UserError
from composer.sync.codec import CorruptDataError
from composer.sync.manifest import Manifest
from composer.sync.pusher import TensorPusher, push_version
from composer.sync.receiver import pull
from composer.sync.store import CHUNKS, MANIFESTS, Store
from tests.helpers.sync_testing import REPO, checkpoint_files, kill_once_chunks_are_written, sync_section

FILES = {
    "model-00001-of-00002.safetensors": ["model.embed.weight", "model.layers.0.mlp.weight", "model.layers.0.mlp.weight_scale_inv"],
    "model-00002-of-00002.safetensors": ["model.norm.weight", "model.step", "lm_head.weight", "model.rotary.inv_freq"],
}


class Policy:
    """Tensors that change like RL policy steps: ~2% of bf16 and fp8 values move, one tensor changes throughout
    (dense encodings), one grows a row at step 3 (a new layout), one never changes, an int64 counter."""

    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.master = {
            "model.embed.weight": torch.randn(640, 1024, generator=self.g) * 0.02,  # 2 pieces at chunk_mb=1
            "model.layers.0.mlp.weight": torch.randn(256, 512, generator=self.g) * 0.02,
            "model.norm.weight": torch.ones(512),
            "lm_head.weight": torch.randn(64, 512, generator=self.g) * 0.02,
        }
        self.step_count = 0

    def step(self) -> None:
        self.step_count += 1
        for name, w in self.master.items():
            touched = torch.rand(w.shape, generator=self.g) < (0.6 if name == "model.norm.weight" else 0.02)
            w += touched * torch.randn(w.shape, generator=self.g) * w.abs() * 0.05
        if self.step_count == 3:
            self.master["lm_head.weight"] = torch.cat([self.master["lm_head.weight"], torch.zeros(1, 512)])

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {name: w.to(torch.bfloat16) for name, w in self.master.items()}
        mlp = self.master["model.layers.0.mlp.weight"]
        out["model.layers.0.mlp.weight"] = mlp.to(torch.float8_e4m3fn)
        out["model.layers.0.mlp.weight_scale_inv"] = mlp.abs().amax().reshape(1, 1).float()
        out["model.step"] = torch.tensor([self.step_count], dtype=torch.int64)
        out["model.rotary.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)
        return out

    def export(self, root: Path) -> Path:
        """The tensors written as an HF-style export (the old path): safetensors shards, config, index."""
        out = root / f"export-{self.step_count}"
        out.mkdir(parents=True)
        tensors = self.tensors()
        for file, names in FILES.items():
            save_file({n: tensors[n] for n in names}, str(out / file), metadata={"format": "pt"})
        (out / "config.json").write_text('{"architectures": ["Tiny"], "torch_dtype": "bfloat16"}\n')
        (out / "model.safetensors.index.json").write_text(f'{{"step": {self.step_count}}}\n')
        return out


def other_files(export: Path) -> Path:
    """What the learner writes beside the in-memory tensors: the export's files but its safetensors."""
    out = export.with_name(export.name + "-other")
    shutil.copytree(export, out, ignore=shutil.ignore_patterns("*.safetensors"))
    return out


def store_files(store: Path) -> dict[str, bytes]:
    """Chunks verbatim; manifests with their creation time dropped (the one field two pushes may differ in)."""
    files = {f"{CHUNKS}/{p.name}": p.read_bytes() for p in (store / CHUNKS).iterdir()}
    for path in (store / MANIFESTS).iterdir():
        manifest = Manifest.from_bytes(path.read_bytes(), str(path))
        manifest.created = ""
        files[f"{MANIFESTS}/{path.name}"] = manifest.to_bytes()
    return files


@pytest.mark.parametrize("device_encoder", [None, True], ids=["host-codec-on-memory", "sync.device"])
def test_in_memory_push_writes_the_versions_of_the_export_push(tmp_path, device_encoder):
    """Anchors (v1, v4), deltas against the tensors held from the last push (v2, v5) and against the previous
    version read from the cache by a fresh pusher (v3, the learner after a restart): byte-identical stores, with
    CPU tensors encoded in place by the host codec (the default) or by the device encoder (a GPU's, here on CPU)."""
    policy, exports = Policy(), []
    from_export, from_memory = (
        sync_section(tmp_path / "export-store", anchor_every=3),
        sync_section(tmp_path / "memory-store", anchor_every=3),
    )
    pusher = TensorPusher(from_memory, cache_dir=tmp_path / "memory-cache", device_encoder=device_encoder)
    for step in range(5):
        if step:
            policy.step()
        export = policy.export(tmp_path / "exports")
        exports.append(export)
        expected = push_version(export, from_export, cache_dir=tmp_path / "export-cache")
        if step == 2:
            pusher = TensorPusher(from_memory, cache_dir=tmp_path / "memory-cache", device_encoder=device_encoder)
        info = pusher.push(policy.tensors(), FILES, other_files(export))
        # the held tensors served as the base; only the fresh pusher read one, from the cache
        cached = sorted(p.name for p in (tmp_path / "memory-cache" / "versions").glob("*"))
        assert cached == ([] if step < 2 else ["v00000002"])
        assert (info.id, info.is_anchor, info.stored_bytes, info.changed_elements) == (
            expected.id,
            expected.is_anchor,
            expected.stored_bytes,
            expected.changed_elements,
        )
    assert store_files(tmp_path / "memory-store") == store_files(tmp_path / "export-store")
    with Store.open(from_memory.store) as store:
        encodings = {e for v in store.versions() for e in store.manifest(v).stats["encodings"]}
        assert encodings == {"raw", "sparse", "xor", "same"}
        for step, export in enumerate(exports):
            pull(store, tmp_path / "receiver", f"v{step + 1:08d}")
            assert checkpoint_files(tmp_path / "receiver" / "current") == checkpoint_files(export)


@pytest.mark.parametrize(
    "files,message",
    [
        (
            {**FILES, "model-00002-of-00002.safetensors": ["model.norm.weight", "model.step", "model.rotary.inv_freq"]},
            "'lm_head.weight' is in no file",
        ),
        ({**FILES, "extra.safetensors": ["model.gone"]}, "names tensor 'model.gone', which is not among the tensors"),
        ({**FILES, "extra.safetensors": ["model.step"]}, "'model.step' is in both"),
        ({"weights.bin": ["model.step"]}, "'weights.bin' is not a *.safetensors file"),
    ],
)
def test_a_tensor_set_that_does_not_match_its_files_is_refused(tmp_path, files, message):
    policy = Policy()
    section = sync_section(tmp_path / "store")
    pusher = TensorPusher(section, cache_dir=tmp_path / "cache")
    pusher.push(policy.tensors(), FILES, other_files(policy.export(tmp_path)))
    policy.step()
    with pytest.raises(UserError, match=f"in-memory checkpoint: .*{message.replace('*', '[*]').replace('(', '[(]')}"):
        pusher.push(policy.tensors(), files, other_files(policy.export(tmp_path)))
    with Store.open(section.store) as store:
        assert store.versions() == ["v00000001"]


def test_a_dtype_sync_cannot_store_is_refused(tmp_path):
    policy = Policy()
    tensors = {**policy.tensors(), "model.step": torch.zeros(2, dtype=torch.complex64)}
    with pytest.raises(UserError, match="tensor 'model.step' has dtype torch.complex64, which sync does not handle"):
        TensorPusher(sync_section(tmp_path / "store"), cache_dir=tmp_path / "cache").push(
            tensors, FILES, other_files(policy.export(tmp_path))
        )


def test_a_damaged_previous_version_is_a_clear_error_and_publishes_nothing(tmp_path):
    """A fresh pusher (no tensors held) rebuilds the previous version from the store: a damaged chunk of it stops
    the push with the chunk named."""
    policy = Policy()
    section = sync_section(tmp_path / "store")
    push_version(policy.export(tmp_path), section, cache_dir=tmp_path / "other-machine-cache")
    chunk = max((tmp_path / "store" / CHUNKS).iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    policy.step()
    pusher = TensorPusher(section, cache_dir=tmp_path / "cache")
    with pytest.raises(CorruptDataError, match=f"chunk {chunk.name} .*is damaged"):
        pusher.push(policy.tensors(), FILES, other_files(policy.export(tmp_path)))
    with Store.open(section.store) as store:
        assert store.versions() == ["v00000001"]


def test_a_tampered_base_cache_is_rebuilt_from_the_store(tmp_path):
    policy = Policy()
    section = sync_section(tmp_path / "store")
    first = policy.export(tmp_path)
    push_version(first, section, cache_dir=tmp_path / "cache")  # the cache now holds v1, hard-linked to `first`
    cached = next((tmp_path / "cache" / "current").glob("*.safetensors"))
    cached.unlink()
    shutil.copy(first / cached.name, cached)
    with cached.open("r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x01\x02\x03\x04")
    policy.step()
    export = policy.export(tmp_path)
    info = TensorPusher(section, cache_dir=tmp_path / "cache").push(policy.tensors(), FILES, other_files(export))
    assert not info.is_anchor
    with Store.open(section.store) as store:
        pull(store, tmp_path / "receiver")
    assert checkpoint_files(tmp_path / "receiver" / "current") == checkpoint_files(export)


KILLED_PUSH = """
import sys
from pathlib import Path
from tests.unit.test_sync_tensor_push import big_tensors
from composer.sync.pusher import TensorPusher
from tests.helpers.sync_testing import sync_section
tensors, files = big_tensors()
store, cache, other = sys.argv[1:]
TensorPusher(sync_section(store, codec={"chunk_mb": 1, "threads": 1}), cache_dir=Path(cache)).push(tensors, files, Path(other))
"""


def big_tensors() -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    g = torch.Generator().manual_seed(1)
    tensors = {f"layer{i}.weight": torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for i in range(12)}
    return tensors, {"model.safetensors": sorted(tensors)}


@pytest.mark.slow  # 38 s at load 25 (a fresh interpreter importing torch, then killed)
def test_a_push_killed_midway_publishes_nothing_and_its_rerun_writes_the_same_chunks(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}\n")
    store_dir, chunk_dir = tmp_path / "store", tmp_path / "store" / CHUNKS
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_PUSH, str(store_dir), str(tmp_path / "c1"), str(other)], env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    kill_once_chunks_are_written(proc, chunk_dir, 3, 120)
    with Store.open(str(store_dir)) as store:
        assert store.versions() == []  # the manifest comes last: no visible version
    before = {e.name: e.stat().st_mtime_ns for e in os.scandir(chunk_dir) if not e.name.startswith(".")}

    tensors, files = big_tensors()
    section = sync_section(store_dir, codec={"chunk_mb": 1, "threads": 1})
    info = TensorPusher(section, cache_dir=tmp_path / "c2").push(tensors, files, other)
    assert info.id == "v00000001" and info.chunks_skipped >= len(before)
    assert {e.name: e.stat().st_mtime_ns for e in os.scandir(chunk_dir) if e.name in before} == before  # not sent again
    clean = sync_section(tmp_path / "clean", codec={"chunk_mb": 1, "threads": 1})
    TensorPusher(clean, cache_dir=tmp_path / "c3").push(tensors, files, other)
    assert store_files(store_dir) == store_files(tmp_path / "clean")
