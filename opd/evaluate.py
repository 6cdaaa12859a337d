"""Held-out quality: exact-match accuracy of greedy completions."""
from opd.data import encode_prompt
from opd.generate import greedy_generate
from opd.model import Transformer
from opd.task import Example, is_correct
from opd.tokenizer import TextTokenizer


def greedy_accuracy(model: Transformer, tok: TextTokenizer, examples: list[Example], max_new_tokens: int,
                    batch_size: int = 250) -> dict:
    """{"eval/accuracy", "eval/n", "eval/completion_tokens", "eval/truncated"} over the scored examples."""
    scored = [ex for ex in examples if ex.answer is not None]
    assert scored, "no example has an answer to score against"
    correct = tokens = truncated = 0
    for i in range(0, len(scored), batch_size):
        chunk = scored[i:i + batch_size]
        outs = greedy_generate(model, [encode_prompt(tok, ex.prompt) for ex in chunk], max_new_tokens,
                               tok.eos_id, tok.pad_id)
        for ex, out in zip(chunk, outs):
            correct += is_correct(tok.decode(out), ex.answer)
            tokens += len(out)
            truncated += not out or out[-1] != tok.eos_id
    n = len(scored)
    return {"eval/accuracy": correct / n, "eval/n": n, "eval/completion_tokens": tokens / n,
            "eval/truncated": truncated / n}
