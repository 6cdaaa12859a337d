"""The KV cache the model writes into: one preallocated buffer per layer, filled left to right.

This is the full-precision cache (float32 or bfloat16). Every cache speaks the same two calls, so a quantizing
cache can replace it without touching the model:
- `update(layer_idx, k, v)` stores the new keys/values ([B, KV, T, D], keys after RoPE) at the current length
  and returns everything stored so far for that layer ([B, KV, S, D]);
- `advance(T)` moves the length on once every layer has stored its T new positions (the model calls it).
"""
import torch

from opd.model import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, dtype=torch.float32, device="cpu"):
        shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.length, self.max_len = 0, max_len

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        assert end <= self.max_len, f"KV cache overflow: {end} > {self.max_len}"
        self.k[layer_idx][:, :, self.length:end] = k
        self.v[layer_idx][:, :, self.length:end] = v
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def bytes_per_token(self) -> int:
        per_layer = sum(t[0, :, 0].numel() * t.element_size() for t in (self.k[0], self.v[0]))
        return per_layer * len(self.k)
