"""From rollout records to training tensors, and the full-precision log-probs a trainer recomputes on them.

A batch is the rollouts' prompt + completion sequences, right-padded into one [B, L] tensor: under a causal mask
right padding never reaches a real token, so one plain forward gives every position's distribution. The
distribution that predicts completion token t of row b sits at position `P_b - 1 + t` (P_b = prompt length);
`positions` [B, N] indexes those, and `mask` [B, N] marks the real completion tokens.
"""
from dataclasses import dataclass

import torch

from opd.engine import Rollout
from opd.model import Transformer


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + completion, right-padded
    positions: torch.Tensor  # [B, N] index into L of the distribution predicting completion token t
    tokens: torch.Tensor  # [B, N] completion tokens (pad where mask is False)
    mask: torch.Tensor  # [B, N] bool
    mu: torch.Tensor  # [B, N] sampler log-probs
    versions: list[int]  # policy version of each rollout
    rollout_logp: torch.Tensor | None = None  # [B, N, V] the engine's full distributions, when it returned them
    q: torch.Tensor | None = None  # [B, N] log-probs under the sampling weights, when rollouts carry them (async)
    kl_exact: torch.Tensor | None = None  # [B, N] exact KL(p_rollout || p_q) per token, likewise
    has_q: torch.Tensor | None = None  # [B] bool: the rows that carry them (async may recompute only some)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())


def collate(rollouts: list[Rollout], pad_id: int) -> Batch:
    B = len(rollouts)
    N = max(1, max(len(r.completion_ids) for r in rollouts))
    L = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    positions = torch.zeros(B, N, dtype=torch.long)
    tokens = torch.full((B, N), pad_id, dtype=torch.long)
    mask = torch.zeros(B, N, dtype=torch.bool)
    mu = torch.zeros(B, N)
    for b, r in enumerate(rollouts):
        P, n = len(r.prompt_ids), len(r.completion_ids)
        input_ids[b, :P + n] = torch.tensor(r.prompt_ids + r.completion_ids)
        positions[b] = (P - 1 + torch.arange(N)).clamp(max=L - 1)
        tokens[b, :n] = torch.tensor(r.completion_ids, dtype=torch.long)
        mask[b, :n] = True
        mu[b, :n] = torch.tensor(r.logprobs)
    dists = None
    if all(r.dists is not None for r in rollouts):
        V = rollouts[0].dists.shape[-1]
        dists = torch.zeros(B, N, V)
        for b, r in enumerate(rollouts):
            dists[b, :len(r.completion_ids)] = r.dists
    has_q = torch.tensor([r.q is not None for r in rollouts])
    return Batch(input_ids, positions, tokens, mask, mu, [r.policy_version for r in rollouts], dists,
                 _per_token(rollouts, "q", N), _per_token(rollouts, "kl_exact", N), has_q if has_q.any() else None)


def _per_token(rollouts: list[Rollout], name: str, N: int) -> torch.Tensor | None:
    """[B, N] of a per-token list field (zeros on rows without it), or None if no row has it."""
    if all(getattr(r, name) is None for r in rollouts):
        return None
    out = torch.zeros(len(rollouts), N)
    for b, r in enumerate(rollouts):
        if getattr(r, name) is not None:
            out[b, :len(r.completion_ids)] = torch.tensor(getattr(r, name))
    return out


def completion_logprobs(model: Transformer, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) at every completion position: [B, N, V] (with gradient if enabled)."""
    logits = model(batch.input_ids)  # [B, L, V]
    V = logits.shape[-1]
    picked = logits.gather(1, batch.positions[..., None].expand(-1, -1, V))  # [B, N, V]
    return (picked.float() / temperature).log_softmax(-1)


def token_logprobs(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, N, V], [B, N] -> [B, N]: the log-prob of each sampled token."""
    return logp.gather(-1, tokens[..., None])[..., 0]
