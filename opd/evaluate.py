"""Held-out quality: exact-match accuracy of greedy completions, at full precision or under a precision plan, and the
reverse KL to the teacher on the student's own samples. Prompts go through the engine `batch_size` at a time, and the
KL is computed a micro-batch and a chunk of tokens at a time (learner.score_batch): memory does not grow with the
number of examples."""
import torch

from opd.chunked import chunk_size
from opd.data import encode_prompt
from opd.engine import Engine
from opd.learner import collate, score_batch
from opd.losses import masked_mean
from opd.model import Transformer
from opd.plan import Plan
from opd.sampling import SamplingParams
from opd.task import Example, is_correct
from opd.tokenizer import TextTokenizer


def greedy_accuracy(model: Transformer, tok: TextTokenizer, examples: list[Example], max_new_tokens: int,
                    batch_size: int = 0, plan: Plan | str = "") -> dict:
    """{"eval/accuracy", "eval/n", "eval/completion_tokens", "eval/truncated"} over the scored examples, with the
    completions decoded under a precision plan (plan.py; "" is full precision); batch_size 0: chunked.chunk_size."""
    scored = [ex for ex in examples if ex.answer is not None]
    assert scored, "no example has an answer to score against"
    batch_size = batch_size or chunk_size(model.cfg.vocab_size)
    engine, params = Engine(model, tok.eos_id, tok.pad_id, plan), SamplingParams(max_new_tokens, temperature=0.0)
    correct = tokens = truncated = 0
    for i in range(0, len(scored), batch_size):
        chunk = scored[i:i + batch_size]
        rollouts = engine.generate([encode_prompt(tok, ex.prompt) for ex in chunk], params, 0)
        for ex, r in zip(chunk, rollouts):
            correct += is_correct(tok.decode(r.completion_ids), ex.answer)
            tokens += len(r.completion_ids)
            truncated += r.finish_reason == "length"
    n = len(scored)
    return {"eval/accuracy": correct / n, "eval/n": n, "eval/completion_tokens": tokens / n,
            "eval/truncated": truncated / n}


@torch.no_grad()
def sampled_quality(student: Transformer, teacher: Transformer, tok: TextTokenizer, examples: list[Example],
                    max_new_tokens: int, seed: int, temperature: float = 1.0, batch_size: int = 0,
                    micro_batch_size: int = 0, chunk_tokens: int = 0) -> dict:
    """Sampled-completion accuracy and the mean per-token reverse KL(student || teacher) on the student's own samples
    (full precision, the training temperature): {"eval/sampled_accuracy", "eval/rkl"}."""
    engine = Engine(student, tok.eos_id, tok.pad_id)
    generator = torch.Generator(device=engine.device).manual_seed(seed)  # one stream across the batches
    batch_size = batch_size or chunk_size(student.cfg.vocab_size)
    params = SamplingParams(max_new_tokens, temperature=temperature)
    correct = scored = tokens = 0
    rkl_sum = 0.0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        rollouts = engine.generate([encode_prompt(tok, ex.prompt) for ex in chunk], params, generator)
        batch = collate(rollouts, tok.pad_id)
        rkl = score_batch(student, batch, teacher, temperature=temperature, micro_batch_size=micro_batch_size,
                          chunk_tokens=chunk_tokens).rkl
        rkl_sum += masked_mean(rkl.double(), batch.mask).item() * batch.num_tokens
        tokens += batch.num_tokens
        for ex, r in zip(chunk, rollouts):
            if ex.answer is not None:
                scored += 1
                correct += is_correct(tok.decode(r.completion_ids), ex.answer)
    return {"eval/sampled_accuracy": correct / max(1, scored), "eval/rkl": rkl_sum / max(1, tokens)}
