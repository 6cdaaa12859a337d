"""Stress inputs for a rollout plan and the admission check: models that compute the same function at full precision
but store very different numbers in their KV cache.

`add_outlier_keys(model, alpha)` multiplies one RoPE channel pair (channels c and c + head_dim/2) of every key by
`alpha` and the same pair of every query of that KV group by `1/alpha`, in every layer. Rotate-half RoPE turns
each such pair as a 2-d vector, and a rotation commutes with scaling that vector, so every attention score
q.k is unchanged and the full-precision model computes the same logits (up to float rounding). What changes is
what the cache stores: keys with an outlier channel `alpha` times larger, as in models whose key bias or
QK-norm weights grew large (the Qwen2.5 case of ../shared/MISSION.md). Without QK-norm the pair's rows of
`k_proj` (and bias) and `q_proj` are scaled; with QK-norm, the pair's entries of the shared `k_norm` and `q_norm`
weights, which the norms apply after normalizing.

A KV format with a fixed scale then saturates (FP8 e4m3 keeps at most 448 with vLLM's default scale 1.0), and a
uniform grid calibrated on the outlier (int8) has too coarse a step for the other channels. The admission check
has to see both (docs/tolerance.md, outlier keys; tests/test_admission.py).

A stressed *checkpoint* is for inference only: the model computes the same function, but it does not *train* the
same. AdamW's steps are about the same size for every parameter, so the query rows scaled by 1/alpha change alpha
times faster relative to their size. Even with BF16 rollouts, 60 OPD steps of the llama student at alpha 300
diverged (dev/LOG.md). To train under outlier keys, use the plan setting
`key_outlier=alpha` instead: the rollout engine applies the same transform to its copy of the weights each time
they are published (weight_quant.apply_weight_precision), so the learner trains the original parametrization while
the engine's KV cache holds the outlier keys, which is what a real outlier model's engine would store.
"""
import torch

from opd.io.errors import require
from opd.models.model import Transformer


@torch.no_grad()
def add_outlier_keys(model: Transformer, alpha: float, pair: int = 0) -> Transformer:
    """Scale key channel pair (pair, pair + head_dim/2) by alpha and the matching query channels by 1/alpha, in
    place, in every layer and head. Returns the model."""
    for layer in model.layers:
        add_outlier_keys_to_layer(layer, model.cfg, alpha, pair)
    return model


@torch.no_grad()
def add_outlier_keys_to_layer(layer: torch.nn.Module, cfg, alpha: float, pair: int = 0) -> None:
    """The same, in one decoder layer (cfg: the model's ModelConfig)."""
    d, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    require(alpha > 0, f"outlier scale must be positive, got {alpha}")
    require(0 <= pair < d // 2, f"outlier channel pair {pair} is outside 0..{d // 2 - 1}")
    channels = [pair, pair + d // 2]
    attn = layer.self_attn
    if cfg.qk_norm:  # the norms' weights act after normalizing, shared by every head
        attn.k_norm.weight[channels] *= alpha
        attn.q_norm.weight[channels] /= alpha
        return
    for kv_head in range(cfg.num_kv_heads):
        _scale_rows(attn.k_proj, [kv_head * d + c for c in channels], alpha)
        for head in range(kv_head * group, (kv_head + 1) * group):
            _scale_rows(attn.q_proj, [head * d + c for c in channels], 1 / alpha)


def _scale_rows(linear: torch.nn.Linear, rows: list[int], factor: float) -> None:
    linear.weight[rows] *= factor
    if linear.bias is not None:
        linear.bias[rows] *= factor
