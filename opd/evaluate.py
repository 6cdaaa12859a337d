"""Held-out quality: exact-match accuracy of greedy completions, at full precision or under a precision plan."""
import torch

from opd.data import encode_prompt
from opd.engine import Engine
from opd.model import Transformer
from opd.plan import Plan
from opd.sampling import SamplingParams
from opd.task import Example, is_correct
from opd.tokenizer import TextTokenizer


def greedy_accuracy(model: Transformer, tok: TextTokenizer, examples: list[Example], max_new_tokens: int,
                    batch_size: int = 250, plan: Plan | str = "") -> dict:
    """{"eval/accuracy", "eval/n", "eval/completion_tokens", "eval/truncated"} over the scored examples, with the
    completions decoded under a precision plan (plan.py; "" is full precision)."""
    scored = [ex for ex in examples if ex.answer is not None]
    assert scored, "no example has an answer to score against"
    engine, params = Engine(model, tok.eos_id, tok.pad_id, plan), SamplingParams(max_new_tokens, temperature=0.0)
    correct = tokens = truncated = 0
    for i in range(0, len(scored), batch_size):
        chunk = scored[i:i + batch_size]
        rollouts = engine.generate([encode_prompt(tok, ex.prompt) for ex in chunk], params, torch.Generator())
        for ex, r in zip(chunk, rollouts):
            correct += is_correct(tok.decode(r.completion_ids), ex.answer)
            tokens += len(r.completion_ids)
            truncated += r.finish_reason == "length"
    n = len(scored)
    return {"eval/accuracy": correct / n, "eval/n": n, "eval/completion_tokens": tokens / n,
            "eval/truncated": truncated / n}
