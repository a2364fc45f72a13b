"""`rollout.dtype: auto`: bf16 only where the CPU computes it natively (emulated bf16 is slower than fp32)."""

from composer.recipes.schema import RolloutSection
from composer.rollout.engines.vllm_engine import cpu_has_native_bf16, resolved_dtype, with_resolved_dtype

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert not cpu_has_native_bf16(AVX2_ONLY)
    assert cpu_has_native_bf16(AVX512_BF16) and cpu_has_native_bf16(AMX)
    assert not cpu_has_native_bf16("processor\t: 0\nflags\t\t: fpu avx512f avx512bw\n")  # AVX-512 without BF16


def test_auto_is_the_faster_dtype_of_this_machine_and_explicit_dtypes_stay():
    import torch

    native = torch.cuda.is_available() or cpu_has_native_bf16()
    assert RolloutSection().dtype == "auto"
    assert with_resolved_dtype(RolloutSection()).dtype == ("bfloat16" if native else "float32")
    assert resolved_dtype("float32") == "float32" and resolved_dtype("bfloat16") == "bfloat16"
