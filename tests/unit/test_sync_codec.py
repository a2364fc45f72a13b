"""The delta codec and full push/pull round trips: bit-exact for every dtype, along anchor/delta chains."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zstandard

from composer.sync.codec import RAW, SAME, SPARSE, XOR, apply_piece, encode_piece
from composer.sync.pusher import push_version
from composer.sync.receiver import apply_version, pull
from composer.sync.store import Store
from tests.helpers.sync_testing import TrainingRun, checkpoint_files, sync_section

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _roundtrip(new: np.ndarray, old: np.ndarray | None):
    encoded = encode_piece(new, old, zstandard.ZstdCompressor(write_checksum=True))
    out = np.zeros_like(new) if old is None else old.copy()
    apply_piece(encoded.encoding, encoded.payload, encoded.changed, encoded.gap_width, out, zstandard.ZstdDecompressor(), "test")
    return encoded, out


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.02, 0.3, 1.0])
def test_piece_roundtrip_is_bit_exact_and_picks_a_fitting_encoding(width, density):
    rng = np.random.default_rng(width)
    dtype = np.dtype(f"uint{8 * width}")
    old = rng.integers(0, np.iinfo(dtype).max, size=100_000, dtype=dtype, endpoint=True)
    new = old.copy()
    changed = rng.random(old.size) < density
    new[changed] ^= rng.integers(1, 255, size=int(changed.sum()), dtype=dtype)
    encoded, out = _roundtrip(new, old)
    assert np.array_equal(out, new)
    assert encoded.changed == int(changed.sum())
    if density == 0.0:
        assert encoded.encoding == SAME and encoded.payload == b""
    elif density <= 0.02:
        assert encoded.encoding == SPARSE
    elif density == 1.0:
        assert encoded.encoding in (XOR, RAW)


def test_sparse_gaps_wider_than_uint16_and_changes_at_both_ends():
    old = np.zeros(300_000, np.uint16)
    new = old.copy()
    new[[0, 1, 200_000, 299_999]] = [1, 2, 3, 4]  # a gap of ~200k needs 32-bit gaps
    encoded, out = _roundtrip(new, old)
    assert encoded.encoding == SPARSE and encoded.gap_width == 4
    assert np.array_equal(out, new)


def test_without_a_base_a_piece_is_raw():
    new = np.arange(1000, dtype=np.uint32)
    encoded, out = _roundtrip(new, None)
    assert encoded.encoding == RAW and np.array_equal(out, new)


def test_every_dtype_roundtrips_bit_exactly_through_torch_written_files(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    base = {
        "bf16": torch.randn(300, 70, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(1000, generator=g).to(torch.float16),
        "fp32": torch.randn(64, 65, generator=g),
        "fp8_e4m3": torch.randn(4096, generator=g).to(torch.float8_e4m3fn),
        "fp8_e5m2": torch.randn(4096, generator=g).to(torch.float8_e5m2),
        "int8": torch.randint(-128, 127, (999,), generator=g, dtype=torch.int8),
        "int16": torch.randint(-30000, 30000, (999,), generator=g, dtype=torch.int16),
        "int32": torch.randint(-(2**31), 2**31 - 1, (999,), generator=g, dtype=torch.int32),
        "int64": torch.randint(-(2**62), 2**62, (999,), generator=g, dtype=torch.int64),
        "uint8": torch.randint(0, 255, (7, 11), generator=g, dtype=torch.uint8),
        "bool": torch.rand(1001, generator=g) < 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    store = tmp_path / "store"
    checkpoints = []
    for step in range(3):
        ck = tmp_path / f"ck{step}"
        ck.mkdir()
        tensors = {}
        for name, t in base.items():
            t = t.clone()
            if t.numel() and step:
                flat = t.view(-1)
                idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
                flat[idx] = ~flat[idx] if t.dtype == torch.bool else torch.randn(idx.numel(), generator=g).to(t.dtype)
            tensors[name] = t
        base = tensors
        save_file(tensors, ck / "model.safetensors", metadata={"format": "pt"})
        (ck / "tokenizer_config.json").write_text('{"step": %d}' % step)
        push_version(ck, sync_section(store, codec={"chunk_mb": 1, "threads": 2}), cache_dir=tmp_path / "cache")
        checkpoints.append(ck)
    with Store.open(str(store)) as s:
        for step, ck in enumerate(checkpoints):
            to = tmp_path / f"recv{step}"
            pull(s, to, f"v{step + 1:08d}")
            # byte-identical files (header verbatim), and torch reads back the same bits
            assert checkpoint_files(to / "current") == checkpoint_files(ck)
            rebuilt = load_file(to / "current" / "model.safetensors")
            for name, t in load_file(ck / "model.safetensors").items():
                assert rebuilt[name].dtype == t.dtype and rebuilt[name].shape == t.shape
                assert rebuilt[name].view(-1).view(torch.uint8).equal(t.view(-1).view(torch.uint8)), name


def test_anchor_delta_chain_and_incremental_pull(tmp_path):
    run = TrainingRun(tmp_path / "train")
    section = sync_section(tmp_path / "store", anchor_every=3)
    infos = [push_version(run.save() if i == 0 else run.next_checkpoint(), section, cache_dir=tmp_path / "cache") for i in range(5)]
    assert [i.is_anchor for i in infos] == [True, False, False, True, False]
    assert [i.parent for i in infos] == [None, "v00000001", "v00000002", "v00000003", "v00000004"]
    assert infos[4].anchor == "v00000004"
    assert all(i.ratio > 10 for i in infos if not i.is_anchor)  # ~2% of bf16 elements change per step
    to = tmp_path / "recv"
    with Store.open(section.store) as store:
        first = pull(store, to, "v00000002")
        assert first.started_from == "v00000001"
        second = pull(store, to, "v00000003")
        assert second.started_from == "v00000002"  # applied only the new delta to what it had
        assert checkpoint_files(to / "current") == checkpoint_files(run.root / "step0002")
        assert pull(store, to, "v00000003").already_current
        pull(store, to)  # across an anchor: rebuilt from v4, then v5
        assert checkpoint_files(to / "current") == checkpoint_files(run.root / "step0004")
        older = pull(store, to, "v00000001")  # going back starts from that version's anchor
        assert older.started_from == "v00000001"
        assert checkpoint_files(to / "current") == checkpoint_files(run.root / "step0000")
    assert os.readlink(to / "current") == "versions/v00000001"


def test_tensors_added_removed_and_reshaped_between_versions(tmp_path):
    from composer.sync.checkpoint import write_safetensors

    store = tmp_path / "store"
    shapes = [{"a": (100,), "b": (10, 10)}, {"a": (100,), "c": (5,)}, {"a": (50, 2), "c": (5,)}]
    for step, spec in enumerate(shapes):
        ck = tmp_path / f"ck{step}"
        ck.mkdir()
        write_safetensors(ck / "m.safetensors", {n: ("F32", np.full(shape, step, np.float32)) for n, shape in spec.items()})
        push_version(ck, sync_section(store), cache_dir=tmp_path / "cache")
        with Store.open(str(store)) as s:
            pull(s, tmp_path / "recv")
        assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(ck)


def test_apply_version_yields_only_changed_tensors_and_refuses_a_wrong_base(tmp_path):
    from composer.sync.checkpoint import Checkpoint

    run = TrainingRun(tmp_path / "train")
    section = sync_section(tmp_path / "store")
    run.save()
    push_version(run.root / "step0000", section, cache_dir=tmp_path / "cache")
    run.step()
    run.master["model.norm.weight"][:] = 1.0  # unchanged this step
    run.save()
    push_version(run.root / "step0001", section, cache_dir=tmp_path / "cache")

    def arrays(directory):
        with Checkpoint(directory) as ck:
            return {
                name: ck.read(info, 0, info.numel, np.empty(info.numel, info.uint)).copy().reshape(info.shape)
                for name, info in ck.tensors.items()
            }

    v1, v2 = arrays(run.root / "step0000"), arrays(run.root / "step0001")
    with Store.open(section.store) as store:
        full = dict(apply_version(store, "v00000001", {}))  # an anchor needs no base and yields everything
        assert set(full) == set(v1) and all(np.array_equal(full[n].view(v1[n].dtype), v1[n]) for n in v1)
        updated = dict(apply_version(store, "v00000002", v1))
        assert set(updated) == {"model.embed.weight", "model.layers.0.mlp.weight", "model.step"}
        for name, array in updated.items():
            assert np.array_equal(array.view(v2[name].dtype), v2[name]), name
        wrong = dict(v1)
        wrong["model.embed.weight"] = v2["model.embed.weight"]  # already at v2: not the parent
        from composer.sync.rebuild import WrongBaseError

        with pytest.raises(WrongBaseError, match="does not match version v00000001"):
            list(apply_version(store, "v00000002", wrong))


def test_block_scaled_fp8_checkpoints_sync_bit_exactly_as_small_deltas(tmp_path):
    """The DeepSeek-V3/Kimi serving layout: e4m3 weights plus an fp32 `weight_scale_inv` per 128x128 block,
    re-quantized from fp32 master weights after a small optimizer step (every block scale moves a little)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    master = torch.randn(512, 1024, generator=g) * 0.02

    def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
        blocks = w.reshape(4, 128, 8, 128)
        scale_inv = blocks.abs().amax(dim=(1, 3)) / 448.0
        fp8 = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn).reshape(512, 1024)
        return {"model.layers.0.mlp.down_proj.weight": fp8, "model.layers.0.mlp.down_proj.weight_scale_inv": scale_inv}

    store, checkpoints = tmp_path / "store", []
    for step in range(3):
        ck = tmp_path / f"ck{step}"
        ck.mkdir()
        save_file(quantize(master), ck / "model.safetensors", metadata={"format": "pt"})
        info = push_version(ck, sync_section(store), cache_dir=tmp_path / "cache")
        checkpoints.append(ck)
        master = master + torch.randn(master.shape, generator=g) * master.abs() * 0.002  # ~2% of e4m3 values move
    assert not info.is_anchor and 0.005 < info.changed_elements / info.total_elements < 0.05
    assert info.ratio > 5
    with Store.open(str(store)) as s:
        for step, ck in enumerate(checkpoints):
            pull(s, tmp_path / "recv", f"v{step + 1:08d}")
            assert checkpoint_files(tmp_path / "recv" / "current") == checkpoint_files(ck)


@pytest.mark.parametrize(
    "dtype,density", [("bfloat16", 0.01), ("bfloat16", 0.2), ("float32", 0.7), ("float8_e4m3fn", 0.02), ("bfloat16", 0.0)]
)
def test_device_encoder_writes_the_bytes_of_the_host_encoder(dtype, density):
    """The torch path (on the GPU where there is one; here on CPU tensors) chooses and encodes pieces exactly as
    the numpy path does, anchors included."""
    torch = pytest.importorskip("torch")
    from composer.sync.device import DeviceDeltaEncoder

    g = torch.Generator().manual_seed(0)
    pairs = []
    for n in (1, 1000, 70_001):
        old = torch.randn(n, generator=g).to(getattr(torch, dtype))
        new = old.clone()
        changed = torch.rand(n, generator=g) < density
        new[changed] = torch.randn(int(changed.sum()), generator=g).to(new.dtype)
        pairs += [(new, old), (new, None)]
    cctx = zstandard.ZstdCompressor(level=3, write_checksum=True)

    def bits(t):
        signed = {1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]
        return t.view(signed).numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32}[t.element_size()])

    expected = [encode_piece(bits(new), None if old is None else bits(old), cctx) for new, old in pairs]
    got = list(DeviceDeltaEncoder("cpu", threads=2, in_flight=3).encode(pairs))
    assert got == expected
