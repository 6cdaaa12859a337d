"""Quantized (or perturbed) weights for the rollout copy of the student, emulated in float.

Quantization lives outside the model: `rollout_copy` swaps the `nn.Linear` modules of the chosen transformer layers
(attention and MLP projections; embeddings and lm_head stay full precision) for modules that compute what a
low-precision kernel would, in float32:
- `bf16`      weights and GEMM inputs rounded to bfloat16, float32 accumulation: what a bf16 engine's matmuls
              compute (with `kv=bf16`, the "BF16 rollouts" reference against a float32 trainer).
- `fp8`       W8A8, per-tensor: weight scale amax/448 (static), activation scale amax/448 per call (dynamic).
- `fp8_block` W8A8 in DeepSeek-V3 style: a scale per 128x128 weight block, and a dynamic scale per token and
              group of 128 input channels for the activations.
- `int8`      weight-only, a symmetric scale per output channel (amax/127).
- `int4`      weight-only, asymmetric groups of 128 input channels (AWQ-style scale and zero point); 64 or 32 where
              128 does not divide the inputs (SmolLM2's 576), as AWQ/GPTQ checkpoints of such models do.
- `noise:s`   the continuous dial: W + s * rms(W) * N(0, 1), seeded, per tensor (drawn on the CPU, so the same
              noise on every device).
Weight-only schemes are applied once (the dequantized weight is what the kernel multiplies by); W8A8 also
quantizes each input. Numerics of the casts are in quant.py.

**Memory.** The copy holds weights as the format stores them (bf16, fp8 codes, int8 codes, packed int4, with their
scales), and only for the layers the plan changes; every other module (embeddings, norms, lm_head, untouched layers)
is the published model's own, by reference. `refresh` re-quantizes the changed layers in place after new weights
are published, building one layer at full precision at a time.
"""
import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from opd.io.errors import require
from opd.models.model import Transformer, empty_model
from opd.numerics.quant import WEIGHT_SCHEMES, dequantize_fp8, dequantize_int4, fp8_max, quantize_fp8, quantize_int4, safe_scale
from opd.numerics.stress import add_outlier_keys_to_layer

E4M3 = torch.float8_e4m3fn
BLOCK = 128


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def fake_quant_fp8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = safe_scale(x.abs().amax(), fp8_max(E4M3))
    return dequantize_fp8(quantize_fp8(x, scale, E4M3), scale)


def fake_quant_fp8_groups(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """FP8 with one scale per (rows x cols) tile of a 2-D view of x; edge tiles may be smaller."""
    shape, tiles = x.shape, _tiles(x, rows, cols)
    scale = safe_scale(tiles.abs().amax(dim=(1, 3), keepdim=True), fp8_max(E4M3))
    deq = dequantize_fp8(quantize_fp8(tiles, scale, E4M3), scale)
    return deq.reshape(tiles.shape[0] * rows, -1)[:shape[:-1].numel(), :shape[-1]].reshape(shape)


def fake_quant(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """w as the scheme's weight storage represents it, in float32."""
    return dequantize_weight(quantize_weight(w, scheme), scheme, w.shape)


def _tiles(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A 2-D view of x, zero-padded to whole (rows x cols) tiles: [R/rows, rows, C/cols, cols]."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    R, C = x2.shape
    pad_r, pad_c = (-R) % rows, (-C) % cols
    return F.pad(x2, (0, pad_c, 0, pad_r)).reshape((R + pad_r) // rows, rows, (C + pad_c) // cols, cols)


def int4_group(in_features: int) -> int:
    """The int4 group size for a layer of in_features inputs: 128, else 64 or 32 (the largest that divides it)."""
    for group in (128, 64, 32):
        if in_features % group == 0:
            return group
    require(in_features < 128 and in_features % 2 == 0, f"int4 weights: in_features {in_features} is not a multiple "
            "of 32", "use w=int8 or w=fp8 for this model")
    return in_features


def quantize_weight(w: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    """A float weight [out, in] as the scheme stores it: bf16 values, fp8 codes and a scale (per tensor or per
    128x128 block), int8 codes and a scale per output channel, or packed int4 codes with a scale and zero per group
    of 128 inputs ("none": the float32 weight itself). `dequantize_weight` gives back the fake-quantized weight."""
    w = w.detach().float()
    if scheme == "none":
        return {"values": w.clone()}
    if scheme == "bf16":
        return {"values": w.to(torch.bfloat16)}
    if scheme == "fp8":
        scale = safe_scale(w.abs().amax(), fp8_max(E4M3))
        return {"codes": quantize_fp8(w, scale, E4M3), "scale": scale}
    if scheme == "fp8_block":
        tiles = _tiles(w, BLOCK, BLOCK)
        scale = safe_scale(tiles.abs().amax(dim=(1, 3), keepdim=True), fp8_max(E4M3))
        return {"codes": quantize_fp8(tiles, scale, E4M3), "scale": scale}
    if scheme == "int8":
        scale = safe_scale(w.abs().amax(dim=1, keepdim=True), 127.0)
        return {"codes": torch.round(w / scale).clamp(-127, 127).to(torch.int8), "scale": scale}
    if scheme == "int4":
        group = int4_group(w.shape[1])
        codes, scale, zero = quantize_int4(w, group)
        return {"codes": codes, "scale": scale, "zero": zero}
    raise AssertionError(scheme)


def dequantize_weight(stored: dict[str, torch.Tensor], scheme: str, shape: torch.Size) -> torch.Tensor:
    """The float32 weight [out, in] that `quantize_weight`'s storage represents (the fake-quantized weight, exactly)."""
    if scheme in ("none", "bf16"):
        return stored["values"].float()
    if scheme == "fp8":
        return dequantize_fp8(stored["codes"], stored["scale"])
    if scheme == "fp8_block":
        tiles = dequantize_fp8(stored["codes"], stored["scale"])
        return tiles.reshape(tiles.shape[0] * tiles.shape[1], -1)[:shape[0], :shape[1]]
    if scheme == "int8":
        return stored["codes"].float() * stored["scale"]
    return dequantize_int4(stored["codes"], stored["scale"], stored["zero"], int4_group(shape[1]))


ACT_QUANT = {"bf16": round_bf16, "fp8": fake_quant_fp8_per_tensor,
             "fp8_block": lambda x: fake_quant_fp8_groups(x, 1, BLOCK)}  # W8A8 schemes also quantize each input


class QuantLinear(nn.Module):
    """y = act_quant(x) @ W_q^T + b, W_q held as the scheme stores it (buffers, see quantize_weight).

    The float32 weight a matmul needs is dequantized for each call on CUDA. On the CPU it is also kept dequantized
    (`cache`): the CPU has no fast float8 conversion (converting a weight costs more than its matmul; dev/LOG.md). That cache is one float32 copy of the quantized layers' linear weights, never of the embeddings
    or output layer, and it is the emulation's only weight shadow.

    native (a bf16 forward on native bf16 GEMMs, engine.bf16_gemm): the dequantized weight is rounded to bf16 (the
    cache is kept so) and a bf16 input multiplies it in a bf16 GEMM (float32 accumulation, bf16 output), as a
    weight-only low-bit kernel does (it dequantizes to 16 bits, then runs a 16-bit GEMM); without it a bf16 input is
    upcast and multiplied in float32, outside the CPU's bf16 units (2x the step of a BF16 plan on the close pair,
    dev/LOG.md 2026-12-06). The two agree to well under the quantization's own error (tests/test_devices.py)."""

    def __init__(self, scheme: str, weight: torch.Tensor, bias: torch.Tensor | None, cache: bool,
                 native: bool = False):
        super().__init__()
        self.scheme, self.shape, self.native = scheme, weight.shape, native
        self.names = []
        for name, tensor in quantize_weight(weight, scheme).items():
            self.register_buffer(name, tensor)
            self.names.append(name)
        # a native copy keeps its bias in bf16 too: the decode loop casts nothing per call
        self.register_buffer("bias", None if bias is None else
                             bias.detach().to(torch.bfloat16 if native else torch.float32).clone())
        self.act_quant = ACT_QUANT.get(scheme)
        self.register_buffer("dequantized", self._dequantized() if cache else None, persistent=False)

    def stored(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names}

    def _dequantized(self) -> torch.Tensor:
        weight = dequantize_weight(self.stored(), self.scheme, self.shape)
        return weight.to(torch.bfloat16) if self.native else weight

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (what the matmul uses): float32, or bf16 where native."""
        if self.dequantized is not None:
            return self.dequantized
        return self._dequantized()

    @torch.no_grad()
    def load_(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize new weights into the same buffers (their addresses stay: a compiled engine keeps its graphs)."""
        for name, tensor in quantize_weight(weight, self.scheme).items():
            getattr(self, name).copy_(tensor)
        if bias is not None:
            self.bias.copy_(bias)
        if self.dequantized is not None:
            self.dequantized.copy_(self._dequantized())

    def forward(self, x):
        if self.act_quant is not None:
            x = self.act_quant(x).to(x.dtype)
        if self.native and x.dtype == torch.bfloat16:  # a bf16 GEMM: float32 accumulation, bf16 output
            return F.linear(x, self.weight, self.bias)
        if x.dtype != torch.float32:  # a bf16 forward: float32 accumulation, the output rounded to bf16
            return F.linear(x.float(), self.weight.float(), self.bias).to(x.dtype)
        return F.linear(x, self.weight.float(), self.bias)


def quantize_linear(linear: nn.Linear, scheme: str, cache: bool = True, native: bool = False) -> QuantLinear:
    return QuantLinear(scheme, linear.weight, linear.bias, cache, native)


def add_noise(linear: nn.Linear, scale: float, generator: torch.Generator) -> None:
    with torch.no_grad():
        w = linear.weight
        rms = w.float().pow(2).mean().sqrt()
        # drawn on the CPU generator, so every device adds the same noise
        w.add_((torch.randn(w.shape, generator=generator).to(w.device) * scale * rms).to(w.dtype))


def linears(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every nn.Linear (or QuantLinear) in a transformer block, in registration order."""
    return [(parent, name) for parent in block.modules() for name, child in parent.named_children()
            if isinstance(child, (nn.Linear, QuantLinear))]


@dataclass(frozen=True)
class LayerWeights:
    """What the rollout copy does to one layer's weights: a scheme, relative noise, outlier keys (stress.py)."""
    scheme: str = "none"
    noise: float = 0.0
    key_outlier: float = 1.0

    def __post_init__(self):
        require(self.scheme in WEIGHT_SCHEMES, f"unknown weight scheme {self.scheme!r}",
                f"use one of {', '.join(WEIGHT_SCHEMES)}")
        require(self.noise >= 0, f"weight noise must be >= 0, got {self.noise}")

    @property
    def changes(self) -> bool:
        return self.scheme != "none" or self.noise > 0 or self.key_outlier != 1


def rollout_copy(model: Transformer, layers: list[LayerWeights], seed: int = 0, cache: bool | None = None,
                 forward: str = "fp32", native: bool = False) -> Transformer:
    """A model that computes with `model`'s modules, except that every layer `layers` changes is its own copy with
    the noise, outlier keys and weight scheme applied (in that order: the noise is relative to the model's weights,
    and the quantizer sees the weights of the model with outliers, as it would a real one). `model` itself when no
    layer changes. cache: keep quantized weights dequantized too (QuantLinear; default: on the CPU).
    forward "bf16": a bf16 engine's copy instead: every module its own bf16 copy (a changed layer's projections
    compute from their stored weights in float32 and round their outputs to bf16, as a low-precision GEMM with
    a bf16 output does; native: from their weights dequantized to bf16, in bf16 GEMMs: QuantLinear)."""
    n = model.cfg.num_layers
    require(len(layers) == n, f"weight plan must name {n} layers")
    if forward == "fp32" and not any(layer.changes for layer in layers):
        return model
    device = model.embed_tokens.weight.device
    cache = device.type == "cpu" if cache is None else cache
    source = bf16_copy(model) if forward == "bf16" else model
    out = empty_model(model.cfg)
    out.embed_tokens, out.norm, out.lm_head = source.embed_tokens, source.norm, source.lm_head
    native = native and forward == "bf16"
    out.layers = nn.ModuleList(_changed_layer(block, plan, cache, native) if plan.changes else block
                               for block, plan in zip(source.layers, layers))
    refresh(out, model, layers, seed)
    return out.eval()


def bf16_copy(model: Transformer) -> Transformer:
    """model's structure and weights in bf16 (tied weights stay tied), without grad."""
    out = empty_model(model.cfg)
    out.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, assign=True)
    if model.cfg.tie_word_embeddings:
        out.lm_head.weight = out.embed_tokens.weight
    return out.requires_grad_(False).eval()


def _changed_layer(block: nn.Module, plan: LayerWeights, cache: bool, native: bool = False) -> nn.Module:
    """The structure of a changed layer: its own norms, QuantLinear storage for its projections (filled by refresh)."""
    with torch.no_grad():
        copy_ = copy.deepcopy(block)
        for parent, name in linears(copy_):
            setattr(parent, name, quantize_linear(getattr(parent, name), plan.scheme, cache, native))
    return copy_.requires_grad_(False)


@torch.no_grad()
def refresh(out: Transformer, model: Transformer, layers: list[LayerWeights], seed: int = 0) -> None:
    """Re-make the changed layers of rollout copy `out` from `model`'s current weights (after an update), in place.
    The noise generator restarts from `seed`, so the same weights always get the same noise."""
    generator = torch.Generator().manual_seed(seed)
    if out.embed_tokens.weight.dtype != model.embed_tokens.weight.dtype:  # a bf16 copy: every unchanged tensor too
        unchanged = {f"layers.{i}." for i, plan in enumerate(layers) if not plan.changes}
        mine = out.state_dict()
        for name, tensor in model.state_dict().items():
            if not name.startswith("layers.") or name[:name.index(".", 7) + 1] in unchanged:
                mine[name].copy_(tensor)
    for i, plan in enumerate(layers):
        if not plan.changes:
            continue
        block = copy.deepcopy(model.layers[i]).requires_grad_(False)  # one layer at full precision, transient
        if plan.noise > 0:
            for parent, name in linears(block):
                add_noise(getattr(parent, name), plan.noise, generator)
        if plan.key_outlier != 1:
            add_outlier_keys_to_layer(block, model.cfg, plan.key_outlier)
        target = out.layers[i]
        for (parent, name), (dest, _) in zip(linears(block), linears(target)):
            source = getattr(parent, name)
            getattr(dest, name).load_(source.weight, source.bias)
        for name, param in block.named_parameters():  # norms (and outlier-scaled QK-norm weights)
            if "_proj." not in name:
                target.get_parameter(name).copy_(param)


def apply_weight_precision(model: Transformer, schemes: list[str], noise: list[float], seed: int = 0,
                           key_outliers: list[float] | None = None) -> Transformer:
    """rollout_copy with the plan given as lists (one entry per layer)."""
    key_outliers = key_outliers or [1.0] * len(schemes)
    require(len(schemes) == len(noise) == len(key_outliers), "weight plan lists must have one entry per layer")
    return rollout_copy(model, [LayerWeights(*t) for t in zip(schemes, noise, key_outliers)], seed)
