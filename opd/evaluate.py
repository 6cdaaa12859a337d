"""Held-out quality: exact-match accuracy of greedy completions, at full precision or under a precision plan."""
import torch

from opd.data import encode_prompt
from opd.engine import Engine
from opd.learner import collate, completion_logprobs
from opd.losses import kl, masked_mean
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


@torch.no_grad()
def sampled_quality(student: Transformer, teacher: Transformer, tok: TextTokenizer, examples: list[Example],
                    max_new_tokens: int, seed: int, temperature: float = 1.0) -> dict:
    """Sampled-completion accuracy and the mean per-token reverse KL(student || teacher) on the student's own samples
    (full precision, the training temperature): {"eval/sampled_accuracy", "eval/rkl"}."""
    engine = Engine(student, tok.eos_id, tok.pad_id)
    rollouts = engine.generate([encode_prompt(tok, ex.prompt) for ex in examples],
                               SamplingParams(max_new_tokens, temperature=temperature),
                               torch.Generator().manual_seed(seed))
    batch = collate(rollouts, tok.pad_id)
    rkl = kl(completion_logprobs(student, batch, temperature), completion_logprobs(teacher, batch))
    scored = [(ex, r) for ex, r in zip(examples, rollouts) if ex.answer is not None]
    accuracy = sum(is_correct(tok.decode(r.completion_ids), ex.answer) for ex, r in scored) / max(1, len(scored))
    return {"eval/sampled_accuracy": accuracy, "eval/rkl": masked_mean(rkl, batch.mask).item()}
