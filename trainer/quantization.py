"""The published checkpoints' quantized weight formats, one tensor at a time, through compressed-tensors.

- Block fp8 (DeepSeek-V3, Kimi-K2): e4m3 weights and one fp32 `weight_scale_inv` per block (128 x 128), a
  weight = fp8 value x its block's scale. It is compressed-tensors' block strategy (FP8_BLOCK) under DeepSeek's
  tensor names; the library pads the blocks that overhang the tensor (DeepSeek-V3's kv_a_proj_with_mqa has 576
  rows: 4.5 blocks), which transformers' FineGrainedFP8 conversion refuses.
- INT4 (Kimi-K2-Thinking, K2.5): compressed-tensors pack-quantized, symmetric groups along the input channels;
  eight 4-bit codes per int32 (`weight_packed`), a `weight_scale` per group, the unpacked `weight_shape`.

Scales: a fresh one is the library's min-max rule (largest magnitude over the code range's half-width: amax / 448
for fp8, amax / 7.5 for INT4). Given the scales the checkpoint was published with, a block or group keeps its
published scale while its values still fit it (no value clamped by more than half a step), and only the others
get fresh ones: a dequantized master (fp32 or bf16) then re-quantizes to exactly the published bytes, and a block
training leaves in place keeps its bytes, which is what the delta sync ships. That choice, the amax of a block
and the fit test are the code written here; the library has no notion of a published scale to keep.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn


def _fp8_args(block: tuple[int, int]):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=list(block))


def _int4_args(group_size: int):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def int4_parts_shapes(shape: tuple[int, ...], group_size: int) -> dict[str, tuple[int, ...]]:
    """The stored shapes of a [rows, columns] weight: packed codes, scales, and the weight_shape vector."""
    return {"weight_packed": (shape[0], math.ceil(shape[1] / 8)), "weight_scale": (shape[0], shape[1] // group_size), "weight_shape": (2,)}


def fp8_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 weight (exactly fp8 value x fp32 scale) of a block-fp8 tensor."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    return dequantize(weight, scale_inv.float(), None, args=_fp8_args(block), dtype=torch.float32)


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 weight (exactly code x scale) of a pack-quantized INT4 tensor."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    codes = unpack_from_int32(packed, 4, torch.Size(shape.tolist()))
    return dequantize(codes, scale.float(), None, args=_int4_args(group_size), dtype=torch.float32)


def _block_extremes(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block (min, max) of a 2-D tensor, overhanging blocks padded with zeros (which the library's min-max
    rule counts anyway: 0 must be representable)."""
    rows, cols = fp8_scale_shape(w.shape, block)
    padded = torch.nn.functional.pad(w, (0, cols * block[1] - w.shape[1], 0, rows * block[0] - w.shape[0]))
    blocks = padded.view(rows, block[0], cols, block[1])
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


FP8_FIT = (-464.0, 464.0)
"""Values (in units of the scale) e4m3 quantizes within half a step: 448 and half its last step (32)."""
INT4_FIT = (-8.5, 7.5)
"""The same for INT4 codes -8..7."""


def _scales(
    low: torch.Tensor, high: torch.Tensor, args, published: torch.Tensor | None, fit: tuple[float, float], dtype: torch.dtype
) -> torch.Tensor:
    """Fresh min-max scales in `dtype`, except where the published scale still fits (see the module docstring)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    fresh, _ = calculate_qparams(low, high, args)
    fresh = fresh.to(dtype)
    if published is None:
        return fresh
    ref = published.to(torch.float32)
    # half a step beyond the codes at either end still quantizes as well as a fresh scale would
    fits = (ref > 0) & (low >= fit[0] * ref) & (high <= fit[1] * ref)
    return torch.where(fits, published.to(dtype), fresh)


def power_of_two_above(scale: torch.Tensor) -> torch.Tensor:
    """Each positive scale rounded up to a power of two (ue8m0: an 8-bit exponent, no mantissa), so the values its
    block was sized for still fit; a power of two stays as it is."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa x 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))


def is_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    mantissa, _ = torch.frexp(scale)
    return (scale > 0) & (mantissa == 0.5)


def fp8_quantize(
    w: torch.Tensor, block: tuple[int, int], published_scale_inv: torch.Tensor | None = None, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 weight_scale_inv) of a 2-D weight; with `power_of_two` (scale_fmt ue8m0, DeepSeek-V3.1)
    fresh scales are rounded up to powers of two, as DeepSeek's own quantizer does (a published one is one already)."""
    from compressed_tensors.quantization.lifecycle.forward import quantize

    w = w.float()
    low, high = _block_extremes(w, block)
    magnitude = torch.maximum(low.abs(), high.abs())
    scale = _scales(-magnitude, magnitude, _fp8_args(block), published_scale_inv, FP8_FIT, torch.float32)
    if power_of_two:
        scale = power_of_two_above(scale)
    return quantize(w, scale, None, args=_fp8_args(block), dtype=FP8_DTYPE), scale


def int4_quantize(
    w: torch.Tensor,
    group_size: int,
    published_scale: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.bfloat16,
    shape_dtype: torch.dtype = torch.int32,
) -> dict[str, torch.Tensor]:
    """{weight_packed, weight_scale, weight_shape} of a 2-D weight whose columns group_size divides."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import quantize

    w = w.float()
    groups = w.view(w.shape[0], -1, group_size)
    args = _int4_args(group_size)
    scale = _scales(groups.amin(-1), groups.amax(-1), args, published_scale, INT4_FIT, scale_dtype)
    # codes from the scale as stored (what every engine dequantizes with)
    codes = quantize(w, scale.float(), None, args=args, dtype=torch.int8)
    return {"weight_packed": pack_to_int32(codes, 4), "weight_scale": scale, "weight_shape": torch.tensor(w.shape, dtype=shape_dtype)}
