"""Padding helpers, and the naive generation loops that are the engine's oracles.

Ragged prompts are left-padded. A pad position may not be attended to by any real token, and attends only to
itself (a fully masked softmax row would give NaN, and NaN values times a zero weight still poison the sum).
Positions count real tokens only, so a sequence's RoPE phases do not depend on how much padding it got.

The naive loops re-run the whole context through the model for every new token, with no KV cache: slow, and
obviously right. engine.py must match them token for token.
"""
import torch

from opd.models.model import Transformer
from opd.engines.sampling import SamplingParams, process_logits, sample


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, P], valid [B, P] bool."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), P), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, P - len(p):] = True
    return ids, valid


def prefill_mask(valid: torch.Tensor) -> torch.Tensor:
    """valid [B, P] -> [B, 1, P, P]: causal, no attention to pads, pads attend to themselves."""
    P = valid.shape[1]
    causal = torch.ones(P, P, dtype=torch.bool, device=valid.device).tril()
    return ((causal & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=valid.device))[:, None]


@torch.no_grad()
def naive_greedy(model: Transformer, prompt: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """One sequence, the whole context re-run through the model for every new token."""
    ids, device = list(prompt), next(model.parameters()).device
    for _ in range(max_new_tokens):
        tok = int(model(torch.tensor([ids], device=device))[0, -1].argmax())
        ids.append(tok)
        if tok == eos_id:
            break
    return ids[len(prompt):]


@torch.no_grad()
def naive_sample(model: Transformer, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator,
                 pad_id: int) -> torch.Tensor:
    """The batch sampled one token at a time without a cache: [B, max_new_tokens] ids, nothing cut at stops
    (the engine decodes finished rows too and discards them, so the two draw the same randomness)."""
    ids, valid = (t.to(next(model.parameters()).device) for t in left_pad(prompts, pad_id))
    for _ in range(params.max_new_tokens):
        positions = (valid.cumsum(1) - 1).clamp(min=0)
        logits = model(ids, positions, prefill_mask(valid))[:, -1]
        tok = sample(process_logits(logits, params), params, generator)
        ids = torch.cat([ids, tok[:, None]], 1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], 1)
    return ids[:, -params.max_new_tokens:]
