"""Quantized (or perturbed) weights for the rollout copy of the student, emulated in float.

Quantization lives outside the model: `apply_weight_precision` swaps the `nn.Linear` modules of the chosen
transformer layers (attention and MLP projections; embeddings and lm_head stay full precision) for modules that
compute what a low-precision kernel would, in float32:
- `bf16`      weights and GEMM inputs rounded to bfloat16, float32 accumulation: what a bf16 engine's matmuls
              compute (with `kv=bf16`, the "BF16 rollouts" reference against a float32 trainer).
- `fp8`       W8A8, per-tensor: weight scale amax/448 (static), activation scale amax/448 per call (dynamic).
- `fp8_block` W8A8 in DeepSeek-V3 style: a scale per 128x128 weight block, and a dynamic scale per token and
              group of 128 input channels for the activations.
- `int8`      weight-only, a symmetric scale per output channel (amax/127).
- `int4`      weight-only, asymmetric groups of 128 input channels (AWQ-style scale and zero point).
- `noise:s`   the continuous dial: W + s * rms(W) * N(0, 1), seeded, per tensor.
Weight-only schemes are applied once (the dequantized weight is what the kernel multiplies by); W8A8 also
quantizes each input. Numerics of the casts are in quant.py.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from opd.errors import require
from opd.model import Transformer
from opd.quant import dequantize_fp8, dequantize_int4, fp8_max, quantize_fp8, quantize_int4, safe_scale
from opd.stress import add_outlier_keys_to_layer

WEIGHT_SCHEMES = ("none", "bf16", "fp8", "fp8_block", "int8", "int4")
E4M3 = torch.float8_e4m3fn
BLOCK = 128


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def fake_quant_fp8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = safe_scale(x.abs().amax(), fp8_max(E4M3))
    return dequantize_fp8(quantize_fp8(x, scale, E4M3), scale)


def fake_quant_fp8_groups(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """FP8 with one scale per (rows x cols) tile of a 2-D view of x; edge tiles may be smaller."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    R, C = x2.shape
    pad_r, pad_c = (-R) % rows, (-C) % cols
    tiles = F.pad(x2, (0, pad_c, 0, pad_r)).reshape((R + pad_r) // rows, rows, (C + pad_c) // cols, cols)
    scale = safe_scale(tiles.abs().amax(dim=(1, 3), keepdim=True), fp8_max(E4M3))
    deq = dequantize_fp8(quantize_fp8(tiles, scale, E4M3), scale)
    return deq.reshape(R + pad_r, C + pad_c)[:R, :C].reshape(shape)


def fake_quant_int8_per_channel(w: torch.Tensor) -> torch.Tensor:
    scale = safe_scale(w.abs().amax(dim=1, keepdim=True), 127.0)
    return torch.round(w / scale).clamp(-127, 127) * scale


def fake_quant_int4_groups(w: torch.Tensor, group: int = 128) -> torch.Tensor:
    group = min(group, w.shape[1])
    require(w.shape[1] % group == 0, f"int4 weights: in_features {w.shape[1]} not a multiple of group {group}")
    return dequantize_int4(*quantize_int4(w, group), group)


class QuantLinear(nn.Module):
    """y = act_quant(x) @ W_q^T + b, with W_q the (fixed) dequantized weight."""

    def __init__(self, linear: nn.Linear, weight: torch.Tensor, act_quant=None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.act_quant = act_quant

    def forward(self, x):
        if self.act_quant is not None:
            x = self.act_quant(x).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def quantize_linear(linear: nn.Linear, scheme: str) -> nn.Module:
    w = linear.weight.detach().float()
    if scheme == "bf16":
        return QuantLinear(linear, round_bf16(w), round_bf16)
    if scheme == "fp8":
        return QuantLinear(linear, fake_quant_fp8_per_tensor(w), fake_quant_fp8_per_tensor)
    if scheme == "fp8_block":
        return QuantLinear(linear, fake_quant_fp8_groups(w, BLOCK, BLOCK),
                           lambda x: fake_quant_fp8_groups(x, 1, BLOCK))
    if scheme == "int8":
        return QuantLinear(linear, fake_quant_int8_per_channel(w))
    if scheme == "int4":
        return QuantLinear(linear, fake_quant_int4_groups(w))
    raise AssertionError(scheme)


def add_noise(linear: nn.Linear, scale: float, generator: torch.Generator) -> None:
    with torch.no_grad():
        w = linear.weight
        rms = w.float().pow(2).mean().sqrt()
        w.add_((torch.randn(w.shape, generator=generator) * scale * rms).to(w.dtype))


def linears(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every nn.Linear in a transformer block."""
    return [(parent, name) for parent in block.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]


def apply_weight_precision(model: Transformer, schemes: list[str], noise: list[float], seed: int = 0,
                           key_outliers: list[float] | None = None) -> Transformer:
    """A copy of model whose layer i uses weight scheme schemes[i] after relative noise noise[i] and, between the
    two, outlier keys of factor key_outliers[i] (stress.py; 1: none): the noise is relative to the model's weights,
    and the quantizer sees the weights of the model with outliers, as it would a real one."""
    n = model.cfg.num_layers
    key_outliers = key_outliers or [1.0] * n
    require(len(schemes) == n and len(noise) == n and len(key_outliers) == n, f"weight plan must name {n} layers")
    out = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    for block, scheme, sigma, alpha in zip(out.layers, schemes, noise, key_outliers):
        require(scheme in WEIGHT_SCHEMES, f"unknown weight scheme {scheme!r}", f"use one of {', '.join(WEIGHT_SCHEMES)}")
        require(sigma >= 0, f"weight noise must be >= 0, got {sigma}")
        if sigma > 0:
            for parent, name in linears(block):
                add_noise(getattr(parent, name), sigma, generator)
        if alpha != 1:
            add_outlier_keys_to_layer(block, model.cfg, alpha)
        if scheme != "none":
            for parent, name in linears(block):
                setattr(parent, name, quantize_linear(getattr(parent, name), scheme))
    return out.eval()
