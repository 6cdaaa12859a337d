"""Held-out quality: exact-match accuracy of greedy completions, at full precision or under a precision plan, and the
reverse KL to the teacher on the student's own samples. Prompts go through the engine `batch_size` at a time, and the
KL is computed a micro-batch and a chunk of tokens at a time (learner.score_batch): memory does not grow with the
number of examples."""
import importlib
import os
import sys
from dataclasses import replace
from typing import Callable

import torch

from opd.training.chunked import chunk_size
from opd.engines.builtin import Engine
from opd.data import humaneval
from opd.io.errors import OpdError, require
from opd.training.learner import Scoring, collate, score_batch
from opd.health.metrics import masked_mean
from opd.models.model import Transformer
from opd.numerics.plan import Plan
from opd.engines.sampling import SamplingParams
from opd.data.sandbox import require_sandbox
from opd.data.scoring import EXTRACT, Verdict, reference, same_answer
from opd.data.task import Example
from opd.models.tokenizer import TextTokenizer


def greedy_accuracy(model: Transformer, tok: TextTokenizer, examples: list[Example], max_new_tokens: int,
                    batch_size: int = 0, plan: Plan | str = "", scoring: str = "last_hash",
                    records: list | None = None, engine=None) -> dict:
    """{"eval/accuracy" and "eval/scored" (over the examples with an answer; absent under scoring "none"), "eval/n",
    "eval/completion_tokens", "eval/truncated"}, with the completions decoded greedily under a precision plan
    (plan.py; "" is full precision); batch_size 0: chunked.chunk_size. records, if given, gets one dict per example
    (index, completion, finish reason, credit; with scoring humaneval, the outcome and its reason). engine: a
    rollout engine of the model's to decode with (engines.make_engine) instead of the built-in one under `plan`."""
    require(bool(examples), "no held-out examples to evaluate on", "give eval.prompts or raise eval.fraction")
    scorer = get_judge(scoring)
    batch_size = batch_size or chunk_size(model.cfg.vocab_size)
    engine = engine or Engine(model, tok.stop_ids, tok.pad_id, plan)
    params = SamplingParams(max_new_tokens, temperature=0.0)
    credit, scored, tokens, truncated = 0.0, 0, 0, 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        rollouts = engine.generate([tok.encode_prompt(ex.prompt) for ex in chunk], params, 0)
        for j, (ex, r) in enumerate(zip(chunk, rollouts)):
            text, got = tok.decode(r.completion_ids), None
            if scorer is not None and ex.answer is not None:
                got = scorer(text, ex.answer)
                credit += got.credit
                scored += 1
            tokens += len(r.completion_ids)
            truncated += r.finish_reason == "length"
            if records is not None:
                records.append({"index": i + j, "completion": text, "finish_reason": r.finish_reason,
                                "credit": None if got is None else got.credit} | _why(got))
    n = len(examples)
    out = {"eval/n": n, "eval/completion_tokens": tokens / n, "eval/truncated": truncated / n}
    return out | ({"eval/accuracy": credit / scored, "eval/scored": scored} if scored else {})


def _why(verdict: Verdict | None) -> dict:
    return {"outcome": verdict.outcome, "detail": verdict.detail} if verdict and verdict.outcome else {}


@torch.no_grad()
def sampled_quality(student: Transformer, teacher, tok: TextTokenizer, examples: list[Example],
                    max_new_tokens: int, seed: int, params: SamplingParams | None = None, batch_size: int = 0,
                    micro_batch_size: int = 0, chunk_tokens: int = 0, scoring: str = "last_hash",
                    autocast: torch.dtype | None = None, keep: list | None = None, sums: "Sums | None" = None) -> dict:
    """Sampled-completion accuracy (absent under scoring "none") and the mean per-token reverse KL(student || teacher)
    on the student's own samples at the learner's compute precision (autocast None: float32; bf16: the samples from a
    bf16 forward on native bf16 GEMMs where the CPU has them, the scoring under autocast, as the learner computes)
    (teacher: a teacher.Teacher with whole rows), sampled as the rollouts are (params: temperature, top-k, top-p):
    {"eval/sampled_accuracy", "eval/rkl", "eval/entropy"}. keep: a list the samples (sampling.Rollout) are appended to;
    sums: a Sums that gets the samples' per-token sums (its exact entropy too: context_quality's on these samples).
    eval/entropy is the mean of -log p_student(token) over the same samples (at the sampling temperature): a Monte
    Carlo estimate of the student's per-token entropy (of the cross-entropy of the truncated sampler's tokens under
    the student, with top-k or top-p). It is what the reverse KL cannot show: KL(student || teacher) = cross-entropy
    to the teacher - entropy, and a student collapsed onto a string the teacher finds likely (one token repeated:
    entropy 0) scores a low reverse KL (tolerance.label calls such a run degraded)."""
    scorer, params = get_scorer(scoring), replace(params or SamplingParams(), max_new_tokens=max_new_tokens)
    credit, scored, sums = 0.0, 0, sums if sums is not None else Sums()
    for chunk, rollouts in sample_batches(student, tok, examples, params, seed, batch_size, autocast):
        sums.add(student, teacher, rollouts, tok.pad_id, params.temperature or 1.0, micro_batch_size, chunk_tokens,
                 autocast)
        if keep is not None:
            keep += rollouts
        for ex, r in zip(chunk, rollouts):
            if scorer is not None and ex.answer is not None:
                scored += 1
                credit += scorer(tok.decode(r.completion_ids), ex.answer)
    quality = {"eval/rkl": sums.rkl / max(1, sums.tokens), "eval/entropy": sums.surprise / max(1, sums.tokens)}
    return quality | ({"eval/sampled_accuracy": credit / scored} if scored else {})


@torch.no_grad()
def sample_batches(student: Transformer, tok: TextTokenizer, examples: list[Example], params: SamplingParams, seed: int,
                   batch_size: int = 0, autocast: torch.dtype | None = None):
    """(examples, their samples) `batch_size` prompts at a time (0: chunked.chunk_size), all from one generator
    stream seeded by `seed`, by the built-in engine at the learner's precision (autocast bf16: a bf16 forward on
    native bf16 GEMMs where the CPU has them): sampled_quality's samples, unscored."""
    plan = "forward=bf16 kv=bf16" if autocast == torch.bfloat16 else ""
    engine = Engine(student, tok.stop_ids, tok.pad_id, plan, bf16_gemm="auto")
    generator = torch.Generator(device=engine.device).manual_seed(seed)  # one stream across the batches
    batch_size = batch_size or chunk_size(student.cfg.vocab_size)
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        yield chunk, engine.generate([tok.encode_prompt(ex.prompt) for ex in chunk], params, generator)


def sampled_contexts(model: Transformer, tok: TextTokenizer, examples: list[Example], params: SamplingParams,
                     seed: int, batch_size: int = 0, autocast: torch.dtype | None = None) -> list:
    """sample_batches' samples in one list (sampling.Rollout, the examples' order): the contexts a model's own
    completions make (the teacher's under eval.contexts "teacher")."""
    return [r for _, batch in sample_batches(model, tok, examples, params, seed, batch_size, autocast) for r in batch]


@torch.no_grad()
def context_quality(student: Transformer, teacher, rollouts: list, pad_id: int, temperature: float = 1.0,
                    batch_size: int = 0, micro_batch_size: int = 0, chunk_tokens: int = 0,
                    autocast: torch.dtype | None = None) -> dict:
    """The student on fixed contexts (completions sampled once: eval.contexts "fixed"): {"eval/rkl": the mean over
    the completions' positions of the exact KL(student || teacher) of the next-token distributions, "eval/entropy":
    the mean of the student's exact entropy there}. A function of the weights alone: two evaluations, or two runs, on
    the same contexts differ only by their weights. At the weights that sampled the contexts, eval/rkl is
    sampled_quality's exactly; eval/entropy is the exact mean of what sampled_quality estimates by -log p(token)."""
    batch_size = batch_size or chunk_size(student.cfg.vocab_size)
    sums = Sums()
    for i in range(0, len(rollouts), batch_size):
        sums.add(student, teacher, rollouts[i:i + batch_size], pad_id, temperature, micro_batch_size, chunk_tokens,
                 autocast)
    return sums.exact()


class Sums:
    """Per-token sums over scored batches: reverse KL, exact entropy, -log p(sampled token), tokens."""

    def __init__(self):
        self.rkl = self.entropy = self.surprise = 0.0
        self.tokens = 0

    def add(self, student, teacher, rollouts, pad_id, temperature, micro_batch_size, chunk_tokens, autocast) -> None:
        batch = collate(rollouts, pad_id)
        how = Scoring(temperature=temperature, micro_batch_size=micro_batch_size, chunk_tokens=chunk_tokens,
                      autocast=autocast)
        scores = score_batch(student, batch, teacher, how)
        self.rkl += masked_mean(scores.rkl.double(), batch.mask).item() * batch.num_tokens
        self.surprise -= masked_mean(scores.pi.double(), batch.mask).item() * batch.num_tokens
        self.entropy += scores.terms["entropy"].double().sum().item()
        self.tokens += batch.num_tokens

    def exact(self) -> dict:
        """context_quality's numbers: the mean reverse KL and exact entropy per position."""
        return {"eval/rkl": self.rkl / max(1, self.tokens), "eval/entropy": self.entropy / max(1, self.tokens)}


def save_contexts(path, rollouts: list) -> None:
    """The fixed evaluation contexts, as JSON (token ids and the sampler's log-probs; no pickle)."""
    import json
    from opd.config.runlog import write_atomic
    write_atomic(path, json.dumps({"contexts": [
        {"prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids, "logprobs": r.logprobs,
         "raw_logprobs": r.raw_logprobs, "finish_reason": r.finish_reason} for r in rollouts]}) + "\n")


def load_contexts(path) -> list:
    """save_contexts' rollouts; a file that is not one is a one-line error."""
    import json
    from opd.engines.sampling import Rollout
    try:
        rows = json.loads(path.read_text())["contexts"]
        out = [Rollout([int(t) for t in r["prompt_ids"]], [int(t) for t in r["completion_ids"]],
                       [float(x) for x in r["logprobs"]], [float(x) for x in r["raw_logprobs"]],
                       str(r["finish_reason"]), 0) for r in rows]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise OpdError(f"{path}: not this run's evaluation contexts ({type(e).__name__}: {e})",
                       "remove the file to sample them anew at the next evaluation") from None
    require(bool(out) and all(len(r.completion_ids) == len(r.logprobs) for r in out),
            f"{path}: evaluation contexts without completions or with mismatched log-probs",
            "remove the file to sample them anew at the next evaluation")
    return out


# ---- scorers by name: completion, reference answer -> credit -----------------------------------------------------

def get_judge(name: str) -> Callable[[str, str], Verdict] | None:
    """completion, reference answer -> Verdict; None for `none`. humaneval's says why a completion failed."""
    if name == "humaneval":
        return humaneval.judge
    scorer = get_scorer(name)
    return None if scorer is None else lambda completion, answer: Verdict(scorer(completion, answer))


def get_scorer(name: str) -> Callable[[str, str], float] | None:
    """completion, reference answer -> credit in [0, 1]; None for `none`."""
    if name == "none":
        return None
    if name == "humaneval":
        return humaneval.score
    if name in EXTRACT:
        extract = EXTRACT[name]
        return lambda completion, answer: float(same_answer(extract(completion), reference(answer, name)))
    return _user_function(name)


def check_scorer(name: str, examples) -> None:
    """Before a run writes anything: the scoring imports, and a user function runs on the first example with an
    answer (that answer as the completion) and returns a valid credit. Errors are one line (OpdError)."""
    scorer = get_scorer(name)
    answered = [ex for ex in examples if ex.answer is not None]
    if scorer is not None and answered and ":" in name:
        scorer(answered[0].answer, answered[0].answer)
    if name == "humaneval":
        for ex in answered:
            humaneval.parse_answer(ex.answer)
        require_sandbox()  # before a run starts, not at its first evaluation


def _user_function(spec: str) -> Callable[[str, str], float]:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:  # a module next to the user's files, as `python -m` would find it
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # ImportError, AttributeError, or the module itself failing
        raise OpdError(f"scoring {spec!r} cannot be imported: {type(e).__name__}: {e}",
                       "check the module is on PYTHONPATH and defines the function") from None
    require(callable(fn), f"scoring {spec!r} is not a function", "point it at f(completion, answer) -> bool")

    def score(completion: str, answer: str) -> float:
        try:
            value = fn(completion, answer)
        except Exception as e:
            raise OpdError(f"scoring function {spec} raised {type(e).__name__}: {e}",
                           "fix the function; it gets the completion text and the reference answer") from None
        require(isinstance(value, (bool, int, float)) and 0 <= float(value) <= 1,
                f"scoring function {spec} returned {value!r}", "return a bool or a number in [0, 1]")
        return float(value)
    return score
