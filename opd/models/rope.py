"""Rotary position embeddings: the inverse frequencies of each RoPE type, as transformers computes them.

Rotate-half RoPE turns channel pair (i, i + D/2) of every query and key by the angle `position * inv_freq[i]`, with
`inv_freq[i] = theta^(-2i/D)` by default. Scaled RoPE changes these frequencies (and, for YaRN, the size of cos/sin)
so that a model reaches beyond the context it was trained on (`original_max_position_embeddings`, or
`max_position_embeddings`). The types, with the parameters a config's `rope_parameters` (transformers 5) or
`rope_scaling` (earlier) names:

- `default`: no scaling.
- `linear` (`factor`): every frequency divided by the factor, i.e. positions interpolated.
- `dynamic` (`factor`; NTK-aware): for a sequence of length L > max_position_embeddings, theta grows to
  `theta * (factor * L / max_pos - (factor - 1))^(D / (D - 2))`; at or below max_pos it is the default. L is the
  longest position of the current forward, plus one. transformers keeps the longest L seen (until a forward falls
  back under max_pos); within one generation, whose positions only grow, the two are the same.
- `yarn` (`factor` (default: max_position_embeddings / original), `original_max_position_embeddings`, `beta_fast` 32, `beta_slow` 1, `mscale`,
  `mscale_all_dim`, `attention_factor`, `truncate` True): frequencies that turn fewer than `beta_slow` times over the
  original context are interpolated (divided by the factor), those turning more than `beta_fast` times are kept, and a
  linear ramp over the dimensions between blends the two; cos and sin are multiplied by the attention factor
  (`0.1 ln(factor) + 1` unless given, or the ratio of two such terms with `mscale`/`mscale_all_dim`).
- `llama3` (`factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`): wavelengths
  longer than `original / low_freq_factor` are divided by the factor, shorter than `original / high_freq_factor`
  kept, and those between smoothly interpolated.

Any other type (`longrope`, ...) or a `partial_rotary_factor` other than 1 is refused by name when a config is read.
"""
import math

import torch

from opd.io.errors import OpdError, require

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
KNOWN = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
         "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
         "partial_rotary_factor"}


def check_scaling(scaling: dict, where: str) -> None:
    """Refuse, by name, a RoPE type or parameter this module does not compute."""
    kind = scaling.get("rope_type", "default")
    require(kind in ROPE_TYPES, f"{where}: rope type {kind!r} is not supported", f"opd computes {', '.join(ROPE_TYPES)}")
    missing = [key for key in REQUIRED.get(kind, ()) if scaling.get(key) is None]
    require(not missing, f"{where}: rope type {kind!r} needs {', '.join(missing)}", "add it to rope_parameters")
    for key in sorted(set(scaling) - KNOWN):
        raise OpdError(f"{where}: rope parameter {key!r} is not supported", "remove it, or use transformers")
    require(float(scaling.get("partial_rotary_factor", 1.0)) == 1.0,
            f"{where}: partial_rotary_factor {scaling.get('partial_rotary_factor')} is not supported",
            "opd rotates every channel of the head")


def default_frequencies(dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))


def frequencies(dim: int, theta: float, scaling: dict, max_positions: int, seq_len: int | None = None,
                device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2], the factor that multiplies cos and sin) for a RoPE type. seq_len: the current sequence
    length (used by `dynamic` only)."""
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return default_frequencies(dim, theta, device), 1.0
    original = int(scaling.get("original_max_position_embeddings") or max_positions)
    factor = float(scaling["factor"]) if scaling.get("factor") is not None else max_positions / original  # yarn
    if kind == "linear":
        return default_frequencies(dim, theta, device) / factor, 1.0
    if kind == "dynamic":
        length = max(seq_len or max_positions, max_positions)
        theta = theta * ((factor * length / max_positions) - (factor - 1)) ** (dim / (dim - 2))
        return default_frequencies(dim, theta, device), 1.0
    if kind == "llama3":
        return _llama3(default_frequencies(dim, theta, device), factor, float(scaling["low_freq_factor"]),
                       float(scaling["high_freq_factor"]), original), 1.0
    return _yarn(dim, theta, factor, scaling, original, device)


def _llama3(inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq
    long_waves = wavelength > original / low
    short_waves = wavelength < original / high
    scaled = torch.where(long_waves, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short end
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~long_waves & ~short_waves, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, factor: float, scaling: dict, original: int, device) -> tuple[torch.Tensor, float]:
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all \
            else _yarn_mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension whose wave turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    base = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by the factor)
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep, float(attention)
