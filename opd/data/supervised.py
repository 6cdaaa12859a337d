"""Supervised batches: prompt + completion, teacher-forced, with the loss on the completion only (pretraining)."""
import torch

from opd.data.task import Example
from opd.models.tokenizer import TextTokenizer

IGNORE = -100


def sft_batch(tok: TextTokenizer, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced batch, right-padded: inputs [B, T] and targets [B, T] (IGNORE outside the completion)."""
    seqs, starts = [], []
    for ex in examples:
        prompt = tok.encode_prompt(ex.prompt)
        seqs.append(prompt + tok.encode(ex.completion) + [tok.eos_id])
        starts.append(len(prompt))
    T = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), T), tok.pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        inputs[i, :len(s) - 1] = torch.tensor(s[:-1])
        targets[i, start - 1:len(s) - 1] = torch.tensor(s[start:])
    return inputs, targets
