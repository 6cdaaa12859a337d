"""Prompt files and supervised batches.

Prompt file format (JSONL): one object per line, `{"prompt": "...", "answer": "..."}`; `answer` is optional (without
it a prompt can be rolled out and distilled on but not scored). Blank lines are skipped; anything else that is not
such an object is an error naming the file and line.
"""
import json
from pathlib import Path

import torch

from opd.errors import OpdError
from opd.task import Example
from opd.tokenizer import TextTokenizer

IGNORE = -100
LINE_FORMAT = 'each line must be {"prompt": ..., "answer": ...}'


def load_prompts(path) -> list[Example]:
    path = Path(path)
    if not path.is_file():
        raise OpdError(f"prompt file not found: {path}", "check the path")
    examples = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise OpdError(f"{path}:{lineno}: not valid JSON ({e.msg})", LINE_FORMAT) from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise OpdError(f"{path}:{lineno}: needs a non-empty string field \"prompt\"", LINE_FORMAT)
        answer = row.get("answer")
        if answer is not None and not isinstance(answer, (str, int)):
            raise OpdError(f"{path}:{lineno}: \"answer\" must be a string or an integer", "fix or drop the field")
        examples.append(Example(row["prompt"], "", None if answer is None else str(answer)))
    if not examples:
        raise OpdError(f"prompt file {path} has no prompts", "add one JSON object per line")
    return examples


def encode_prompt(tok: TextTokenizer, prompt: str) -> list[int]:
    return ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(prompt)


def sft_batch(tok: TextTokenizer, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced batch, right-padded: inputs [B, T] and targets [B, T] (IGNORE outside the completion)."""
    seqs, starts = [], []
    for ex in examples:
        prompt = encode_prompt(tok, ex.prompt)
        seqs.append(prompt + tok.encode(ex.completion) + [tok.eos_id])
        starts.append(len(prompt))
    T = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), T), tok.pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        inputs[i, :len(s) - 1] = torch.tensor(s[:-1])
        targets[i, start - 1:len(s) - 1] = torch.tensor(s[start:])
    return inputs, targets
