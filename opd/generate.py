"""Greedy decoding: a batched KV-cached path, and the naive uncached loop that is its oracle.

Ragged prompts are left-padded. A pad position may not be attended to by any real token, and attends only to
itself (a fully masked softmax row would give NaN, and NaN values times a zero weight still poison the sum).
Positions count real tokens only, so a sequence's RoPE phases do not depend on how much padding it got.
Token ids in, token ids out: no tokenizer here.
"""
import torch

from opd.kv_cache import KVCache
from opd.model import Transformer


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
    causal = torch.ones(P, P, dtype=torch.bool).tril()
    return ((causal & valid[:, None, :]) | torch.eye(P, dtype=torch.bool))[:, None]


@torch.no_grad()
def greedy_generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                    pad_id: int) -> list[list[int]]:
    """Batched greedy decoding with a KV cache. Each completion stops after (and includes) its first eos."""
    ids, valid = left_pad(prompts, pad_id)  # [B, P]
    B, P = ids.shape
    cache = KVCache(model.cfg, B, P + max_new_tokens, dtype=next(model.parameters()).dtype)
    positions = (valid.cumsum(1) - 1).clamp(min=0)  # [B, P]
    logits = model(ids, positions, prefill_mask(valid), cache)[:, -1]  # [B, V]
    next_pos = valid.sum(1, keepdim=True)  # [B, 1]
    key_valid = torch.cat([valid, torch.ones(B, max_new_tokens, dtype=torch.bool)], 1)
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long)
    done = torch.zeros(B, dtype=torch.bool)
    for t in range(max_new_tokens):
        tok = logits.argmax(-1)  # [B]
        out[:, t] = torch.where(done, pad_id, tok)
        done |= tok == eos_id
        if done.all() or t == max_new_tokens - 1:
            break
        mask = key_valid[:, None, None, :P + t + 1]  # [B, 1, 1, S]
        logits = model(tok[:, None], next_pos + t, mask, cache)[:, -1]
    # the loop only ends early once every row has its eos, so a row without one used all max_new_tokens
    return [row[:row.index(eos_id) + 1] if eos_id in row else row for row in out.tolist()]


@torch.no_grad()
def naive_greedy(model: Transformer, prompt: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """The oracle: one sequence, the whole context re-run through the model for every new token."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        tok = int(model(torch.tensor([ids]))[0, -1].argmax())
        ids.append(tok)
        if tok == eos_id:
            break
    return ids[len(prompt):]
