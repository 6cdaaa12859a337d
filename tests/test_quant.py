"""Quantizers: round-trip bounds on Gaussian data, saturation, NaN, and hand-computed codes."""
import pytest
import torch

from opd.numerics.quant import (FP8_DTYPES, dequantize_fp8, dequantize_int4, dequantize_int8, fp8_max, quantize_fp8,
                       quantize_int4, quantize_int8, safe_scale, truncate_to_fp8_grid)

GAUSS = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3.0

# mantissa bits m -> relative rounding error <= 2^-(m+1) for normals; subnormal spacing 2^(1-bias-m), half of it
FP8_BOUNDS = {"fp8_e4m3": (2 ** -4, 2 ** -10), "fp8_e5m2": (2 ** -3, 2 ** -17)}


@pytest.mark.parametrize("name", list(FP8_DTYPES))
@pytest.mark.parametrize("divisor", ["amax", 1.0])
def test_fp8_round_trip_within_format_precision(name, divisor):
    dtype = FP8_DTYPES[name]
    scale = safe_scale(GAUSS.abs().amax(), fp8_max(dtype)) if divisor == "amax" else torch.tensor(1.0)
    q = quantize_fp8(GAUSS, scale, dtype)
    assert q.dtype == dtype
    err = (dequantize_fp8(q, scale) - GAUSS).abs()
    rel, sub = FP8_BOUNDS[name]
    assert (err <= torch.maximum(rel * GAUSS.abs(), sub * scale) + 1e-7).all()
    assert err.max() > 0  # it really quantized


@pytest.mark.parametrize("name", list(FP8_DTYPES))
def test_fp8_saturates_instead_of_overflowing_and_keeps_nan(name):
    dtype = FP8_DTYPES[name]
    x = torch.tensor([1e9, -1e9, float("nan"), 2.0])
    out = dequantize_fp8(quantize_fp8(x, 1.0, dtype), 1.0)
    assert out[0] == fp8_max(dtype) and out[1] == -fp8_max(dtype)
    assert torch.isnan(out[2]) and out[3] == 2.0


def test_int8_round_trip_and_hand_values():
    scale = safe_scale(GAUSS.abs().amax(), 127.0)
    err = (dequantize_int8(quantize_int8(GAUSS, scale), scale) - GAUSS).abs()
    assert err.max() <= scale / 2 + 1e-6
    x = torch.tensor([-1.27, 0.0, 0.005, 0.015, 1.27, 5.0])
    assert quantize_int8(x, 0.01).tolist() == [-127, 0, 0, 2, 127, 127]  # half to even; saturated


def test_int4_hand_computed():
    x = torch.tensor([[0.0, 1.5, 3.0, 0.75]])  # one group of 4: min 0, max 3 -> scale 0.2, zero 0
    packed, scale, zero = quantize_int4(x, group=4)
    assert scale.tolist() == [[pytest.approx(0.2)]] and zero.tolist() == [[0.0]]
    # codes 0, 7.5->8 (half to even), 15, 3.75->4; packed low nibble first
    assert packed.tolist() == [[0 | (8 << 4), 15 | (4 << 4)]]
    assert dequantize_int4(packed, scale, zero, 4).tolist() == [[0.0, pytest.approx(1.6), pytest.approx(3.0),
                                                                  pytest.approx(0.8)]]


def test_int4_round_trip_bound_and_zero_tensor():
    packed, scale, zero = quantize_int4(GAUSS, group=32)
    assert packed.shape == (64, 128) and scale.shape == zero.shape == (64, 8)
    err = (dequantize_int4(packed, scale, zero, 32) - GAUSS).abs().reshape(64, 8, 32)
    assert (err <= scale[..., None] / 2 + 1e-5).all()
    zeros = torch.zeros(2, 8)
    assert dequantize_int4(*quantize_int4(zeros, 8), 8).eq(0).all()
    assert dequantize_int8(quantize_int8(zeros, safe_scale(zeros.abs().amax(), 127)), 1.0).eq(0).all()


@pytest.mark.parametrize("name", list(FP8_DTYPES))
def test_fp8_truncation_is_the_grid_point_at_or_below_the_magnitude(name):
    """Reference: every finite value of the format (all 256 codes), and a search for the largest one <= |x|, on
    the grid points, points between them (subnormals included), just below each, negatives, out of range."""
    dtype = FP8_DTYPES[name]
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique().sort().values
    between = torch.cat([(grid[:-1] + grid[1:]) / 2, grid[:-1] + (grid[1:] - grid[:-1]) * 0.999, grid])
    x = torch.cat([between, -between, torch.tensor([1e9, -1e9])])
    want = grid[torch.searchsorted(grid, x.abs().clamp(max=fp8_max(dtype)), right=True) - 1] * x.sign()
    assert torch.equal(dequantize_fp8(quantize_fp8(x, 1.0, dtype, "zero"), 1.0), want)
    assert torch.equal(truncate_to_fp8_grid(grid, dtype), grid)  # representable values stay
    assert torch.isnan(truncate_to_fp8_grid(torch.tensor([float("nan")]), dtype)).all()
    assert not torch.equal(quantize_fp8(GAUSS, 1.0, dtype, "zero"), quantize_fp8(GAUSS, 1.0, dtype))


@pytest.mark.parametrize("name, shrink", [("fp8_e4m3", 0.046), ("fp8_e5m2", 0.085)])
def test_fp8_truncation_shrinks_magnitudes_nearest_does_not(name, shrink):
    """The mean relative shrink of |x| on standard normal values (quoted in quant.py), +-0.005; nearest: < 0.005."""
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(2))
    for rounding, want in (("zero", shrink), ("nearest", 0.0)):
        got = 1 - (dequantize_fp8(quantize_fp8(x, 1.0, FP8_DTYPES[name], rounding), 1.0).abs() / x.abs()).mean()
        assert abs(got - want) < 0.005, (rounding, float(got))
