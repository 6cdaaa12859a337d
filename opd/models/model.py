"""A compact decoder-only transformer covering the Llama, Qwen2 and Qwen3 architectures.

The three differ only in small switches, all carried by `ModelConfig`:
- Llama: optional bias on q/k/v/o (`attention_bias`) and on the MLP (`mlp_bias`);
- Qwen2: bias on q/k/v, none on o;
- Qwen3: RMSNorm over each head's q and k before RoPE (QK-norm), which bounds the key magnitudes;
  this is why an FP8 KV cache is expected to hurt Qwen3-style models less than the others.
All use RMSNorm (computed in float32, as Hugging Face does), SwiGLU, rotate-half RoPE (optionally scaled: linear,
dynamic, YaRN, Llama 3; rope.py) and grouped-query attention. Layers listed as `sliding_attention` in `layer_types`
(Qwen2/Qwen3 with `use_sliding_window`, from `max_window_layers` on) attend only to the last `sliding_window`
positions, themselves included. Parameter names equal Hugging Face's minus the leading `model.`, so checkpoints map
1:1.

The model is a pure function of (tokens, positions, mask, cache): it never stores a KV cache. A cache is any
object with `update(layer_idx, k, v) -> (k_all, v_all)` and `advance(T)` (see kv_cache.py); keys arrive after
RoPE (vLLM's convention), so a quantizing cache sees exactly what a real engine would store.
"""
import itertools
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from opd.io.errors import OpdError, require
from opd.models.rope import check_scaling, frequencies

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    arch: str = "llama"
    vocab_size: int = 128
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    rope_scaling: dict = field(default_factory=dict)  # rope.py's parameters besides rope_theta; {}: default RoPE
    sliding_window: int = 0  # the window of the layers whose layer_types entry is "sliding_attention"
    layer_types: tuple = ()  # per layer "full_attention" or "sliding_attention"; (): all full

    def __post_init__(self):
        require(self.arch in ARCHITECTURES, f"unknown architecture {self.arch!r}",
                f"use one of {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            require(getattr(self, name) > 0, f"model config: {name} must be positive, got {getattr(self, name)}")
        require(self.num_heads % self.num_kv_heads == 0,
                f"model config: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}",
                "grouped-query attention needs num_heads divisible by num_kv_heads")
        require(self.head_dim % 2 == 0, f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        check_scaling(self.rope_scaling, "model config")
        self.layer_types = tuple(self.layer_types)
        require(not self.layer_types or len(self.layer_types) == self.num_layers,
                f"model config: layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}")
        for kind in sorted(set(self.layer_types) - {"full_attention", "sliding_attention"}):
            raise OpdError(f"model config: layer type {kind!r} is not supported",
                           "opd runs full_attention and sliding_attention layers")
        require("sliding_attention" not in self.layer_types or self.sliding_window > 0,
                "model config: sliding_attention layers need a positive sliding_window")

    @property
    def context(self) -> int:
        """The longest sequence the model runs: max_position_embeddings, unbounded for dynamic RoPE (whose scaling
        grows with the sequence: that is what it is for)."""
        return 1 << 40 if self.rope_scaling.get("rope_type") == "dynamic" else self.max_position_embeddings

    def sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def to_dict(self) -> dict:
        return asdict(self)


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32 if it is in a narrower float (bf16, fp16); float32 and float64 (the tests' oracles) as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics whatever the input dtype; the weight applied in float32 too and the result rounded
        # once to x's dtype (transformers rounds before the weight: the same in float32). In a bf16 forward the
        # two orders round differently in the last bit; the stored studies and fidelity numbers use this one
        # (dev/LOG.md compares them)
        xf = wide(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (wide(self.weight) * xf).to(x.dtype)


_INV_FREQ: dict[tuple, tuple] = {}  # (head_dim, theta, scaling, max positions, device) -> (inv_freq, scale), made once


def _inv_freq(cfg: ModelConfig, device: torch.device, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Cached for eager decoding (~20 us a forward otherwise). Inside torch.compile it is computed in the graph:
    a global cache there would be guarded on, and its first fill would cost a recompile. Dynamic RoPE depends on
    the sequence length and is not cached."""
    def compute():
        return frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, seq_len,
                           device)
    if torch.compiler.is_compiling() or cfg.rope_scaling.get("rope_type") == "dynamic":
        return compute()
    key = (cfg.head_dim, cfg.rope_theta, tuple(sorted(cfg.rope_scaling.items())), cfg.max_position_embeddings,
           str(device))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = compute()
    return _INV_FREQ[key]


def rope_cos_sin(positions: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B, T] -> cos, sin: [B, 1, T, head_dim] in float32."""
    dynamic = cfg.rope_scaling.get("rope_type") == "dynamic"
    inv_freq, scale = _inv_freq(cfg, positions.device, int(positions.max()) + 1 if dynamic else None)
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def window_mask(mask: torch.Tensor | None, T: int, S: int, window: int, device) -> torch.Tensor:
    """mask [B, 1, T, S] (None: causal over T = S) restricted to the last `window` keys of each query. The T queries
    are the last T of the S positions (a cache holds the S - T before them); a left pad shifts a row's queries and
    keys alike, so index distance is token distance."""
    q = torch.arange(S - T, S, device=device)[:, None]
    k = torch.arange(S, device=device)[None, :]
    allowed = (q - k < window) & (k <= q)  # [T, S]
    return allowed[None, None] if mask is None else mask & allowed


@dataclass(frozen=True)
class Segments:
    """Sequences packed one after another along a single row (`Transformer.hidden`'s mask argument): each attends
    causally to itself only, within `window` positions where a layer slides. The learner packs its right-padded
    batches so (learner.pack): no position of padding is computed, and each sequence's attention is its own causal
    attention, [n, n] instead of the batch's [L, L]."""
    lengths: tuple[int, ...]
    window: int = 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        """q [1, H, T, D], k/v [1, KV, T, D] -> [1, H, T, D]: one causal SDPA per run of equal-length sequences (a
        batch of g sequences of n tokens: [g, H, n, D]), so a batch without padding costs what the padded one did."""
        runs = [(n, len(list(group))) for n, group in itertools.groupby(self.lengths)]
        sizes = [n * g for n, g in runs]
        out = []  # split, not slices: its backward is one cat, where each slice's would fill a whole [1, H, T, D]
        for (n, g), q_, k_, v_ in zip(runs, *(x.split(sizes, dim=2) for x in (q, k, v))):
            q_, k_, v_ = (x[0].unflatten(1, (g, n)).transpose(0, 1) for x in (q_, k_, v_))  # [g, heads, n, D]
            mask = window_mask(None, n, n, self.window, q.device) if self.window else None
            y = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
            out.append(y.transpose(1, 2).reshape(1, n * g, y.shape[1], y.shape[3]))  # [1, tokens, H, D]: one copy
        return (out[0] if len(out) == 1 else torch.cat(out, dim=1)).transpose(1, 2)  # the caller transposes back


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one new token: q [B, H, 1, D], k/v [B, KV, S, D], mask [B, 1, 1, S] -> [B, H, 1, D].

    The query heads of a KV group are stacked as rows of one matmul against their shared keys. CPU SDPA kernels
    are slow for a single query (dev/LOG.md has the timings); results agree to float32 rounding."""
    B, H, _, D = q.shape
    KV = k.shape[1]
    scores = (q.view(B, KV, H // KV, D) @ k.transpose(-1, -2)) * D ** -0.5  # [B, KV, H/KV, S]
    scores = scores.masked_fill(~mask.view(B, 1, 1, -1), float("-inf"))
    return (scores.softmax(-1) @ v).view(B, H, 1, D)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.cfg = layer_idx, cfg
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, h * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * hd, d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache):
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(B, T, -1, hd)
        k = self.k_proj(x).view(B, T, -1, hd)
        v = self.v_proj(x).view(B, T, -1, hd).transpose(1, 2)  # [B, KV, T, D]
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rope(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = self.rope(k.transpose(1, 2), cos, sin)  # [B, KV, T, D]
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # [B, KV, S, D]
        y = self.attend(q, k, v, mask, cache is None)  # [B, H, T, D]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    # The two places a bf16 engine's kernels round their own way (numerics/kernels.EngineAttention overrides them).
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)

    def attend(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """softmax(q k^T / sqrt(D)) v in q's dtype. causal: no mask and no cache (the whole sequence at once)."""
        dtype = q.dtype  # a bf16 forward: the attention math in float32 (as engines do), its output rounded
        q, k, v = wide(q), wide(k), wide(v)
        gqa = self.cfg.num_heads != self.cfg.num_kv_heads
        if isinstance(mask, Segments):
            y = mask.attend(q, k, v, gqa)
        elif q.shape[2] == 1 and mask is not None:
            y = decode_attention(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and causal,
                                               enable_gqa=gqa)
        return y.to(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f, b), nn.Linear(d, f, b), nn.Linear(f, d, b)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj((F.silu(wide(gate)) * wide(up)).to(gate.dtype))  # one rounding, as fused kernels


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> "Transformer":
        """Hugging Face's initialisation: N(0, std) matrices, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """input_ids, positions: [B, T]; mask: [B, 1, T, S] bool (True = may attend), None for plain causal
        attention over input_ids alone, or `Segments` (B = 1, no cache) for packed sequences. Returns logits
        [B, T, V]: the output layer at every position, which only the oracles and pretraining want; the engine and
        the learner call `hidden` and run `lm_head` on the positions they use (at a vocabulary of 150k, [B, T, V] is
        what does not fit)."""
        return self.lm_head(self.hidden(input_ids, positions, mask, cache))

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
               mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """The final norm's output [B, T, hidden_size], the input of `lm_head`; arguments as `forward`."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        assert positions.shape == (B, T), f"positions {tuple(positions.shape)} != {(B, T)}"
        assert mask is not None or cache is None or T == 1, "a multi-token forward with a cache needs a mask"
        cos, sin = rope_cos_sin(positions, self.cfg)
        x = self.embed_tokens(input_ids)
        if x.dtype != torch.float32:  # engines keep their RoPE tables in the model's dtype (applied in float32)
            cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()
        windowed = None
        if "sliding_attention" in self.cfg.layer_types:
            S = T + (cache.length if cache is not None else 0)
            windowed = Segments(mask.lengths, self.cfg.sliding_window) if isinstance(mask, Segments) else \
                window_mask(mask, T, S, self.cfg.sliding_window, input_ids.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, windowed if self.cfg.sliding(i) else mask, cache)
        if cache is not None:
            cache.advance(T)
        return self.norm(x)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def empty_model(cfg: ModelConfig) -> Transformer:
    """A Transformer on the meta device, uninitialised: no memory, no random numbers, for loading tensors into with
    `load_state_dict(..., assign=True)`. (Initialising even meta tensors costs ~2 s on the first call: the first
    meta `normal_` imports PyTorch's reference decompositions.)"""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        with torch.device("meta"):
            return Transformer(cfg)
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved
