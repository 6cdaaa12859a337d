"""Full-vocabulary work a chunk of tokens at a time: peak memory O(chunk x vocab), never O(batch x tokens x vocab).

Everything OPD reads from a whole distribution is a sum over generated tokens of something computed from that
token's rows alone: the full-vocabulary losses (losses.token_losses), the exact KL between the rollout engine's and
the trainer's distributions, the held-out reverse KL to the teacher. So the output layers run on the final hidden
states of one chunk of tokens at a time, logits [c, V] -> log-softmax -> per-token values, and nothing of size
[tokens, V] outlives its chunk. For scale: one float32 [64, 1024, 151936] tensor is 40 GB; a chunk of 110 tokens at
that vocabulary is 67 MB, and a chunk's work holds about ten such tensors at once.

The inputs are the hidden states of the generated tokens only, packed: [M, d] for the M real tokens of a batch
(learner.completion_hidden), so prompt and padding positions never reach an output layer. Each distribution is a
`Source`: hidden states plus the function that turns rows of them into log-probs (a model's output layer at a
temperature, or the rollout engine's sampling transform), evaluated one chunk at a time, on the learner's device.

**Gradients** (`score` with a student that needs them): a custom autograd function computes, for each chunk, the
weighted sum of the per-token losses and at once its gradients with respect to the chunk's hidden states and the
output weight, then frees the chunk; backward only scales the stored gradients ([M, d] and [V, d]) by the incoming
gradient. The logits are thus computed once and never stored: the same three matmuls as the unchunked path (one
projection, two for the gradients), where checkpointing each chunk would project it twice. The gradient with respect
to the logits is losses.logit_gradient's closed form for full_rkl, fkl and sampled_rkl, and autograd on the chunk's
small graph for the others. (Liger-Kernel's fused linear cross-entropy also computes gradients in forward, for
supervised training; TRL's chunked divergence recomputes its tiles in backward instead.)

The default chunk (`compute.chunk_tokens` 0) is as many tokens as make one [chunk, V] float32 tensor CHUNK_FLOATS floats:
110 tokens at V = 151,936; at the built-in vocabulary of 100, a whole batch is one chunk.
"""
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from opd.training.losses import CLOSED_FORM, LossConfig, kl, logit_gradient, token_losses

CHUNK_FLOATS = 2 ** 24  # 64 MiB of float32 per [chunk, V] tensor


def chunk_size(vocab: int, chunk_tokens: int = 0) -> int:
    return chunk_tokens or max(1, CHUNK_FLOATS // vocab)


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) in float32 at least (float64 stays float64: the oracle tests use it)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return (logits if temperature == 1 else logits / temperature).log_softmax(-1)


def output_layer(model: torch.nn.Module, temperature: float = 1.0) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden rows [c, d] -> the model's log-probs [c, V] at a temperature."""
    return lambda h: log_probs(model.lm_head(h), temperature)


def as_multiplied(weight: torch.Tensor) -> torch.Tensor:
    """The output weight as the chunks' matmuls take it: under autocast, cast once here to autocast's dtype (what
    autocast would do to it in every matmul, bit for bit: one [V, d] copy a call instead of two a chunk; on the Qwen
    student these copies were 19% of a bf16 learner's micro-batch), detached; otherwise itself, detached."""
    kind = weight.device.type
    if torch.is_autocast_enabled(kind) and weight.is_floating_point() and weight.dtype != torch.float64:
        return weight.detach().to(torch.get_autocast_dtype(kind))
    return weight.detach()


@dataclass
class Source:
    """A per-token distribution, computed on demand one chunk at a time: hidden states [M, d] and the function that
    maps rows of them to log-probs [c, V]. `seconds` accumulates the time spent in it (the teacher's scoring time)."""
    hidden: torch.Tensor
    logprobs: Callable[[torch.Tensor], torch.Tensor]
    seconds: float = field(default=0.0)

    def rows(self, rows: slice, device: torch.device) -> torch.Tensor:
        start = time.perf_counter()
        with torch.no_grad():
            out = self.logprobs(self.hidden[rows]).to(device)
        self.seconds += time.perf_counter() - start
        return out


@dataclass
class Student:
    """The distribution being trained: hidden states [M, d], the output weight [V, d] and the training temperature.
    Gradients flow to both when they require them."""
    hidden: torch.Tensor
    weight: torch.Tensor
    temperature: float = 1.0

    def logprobs(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return log_probs(F.linear(h, w), self.temperature)


@dataclass
class Job:
    """One pass over the chunks of M tokens: what to compute per chunk, and the per-token results, gathered."""
    student: Student
    tokens: torch.Tensor  # [M] sampled tokens
    mu: torch.Tensor  # [M] the sampler's log-probs
    weights: torch.Tensor  # [M] each token's weight in the loss (1 / tokens in the whole batch)
    loss: LossConfig | None  # None: no loss, only the log-probs of the sampled tokens (and the sources' terms)
    teacher: Source | None
    rollout: Source | None  # the engine's distributions: kl_exact = KL(rollout || student) per token
    chunk: int
    terms: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def slices(self) -> list[slice]:
        M = self.tokens.shape[0]
        return [slice(i, min(i + self.chunk, M)) for i in range(0, M, self.chunk)]

    def run(self, rows: slice, h: torch.Tensor, w: torch.Tensor, need_h: bool = False, need_w: bool = False) \
            -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The chunk's weighted loss and, as asked, its gradients with respect to h [c, d] and w [V, d]; records the
        chunk's per-token terms. Closed-form gradients where losses.py has them, else autograd on the chunk."""
        t = self.teacher.rows(rows, h.device) if self.teacher is not None else None
        if self.loss is not None and (need_h or need_w) and self.loss.name not in CLOSED_FORM:
            return self._autograd(rows, h, w, t, need_h, need_w)
        with torch.no_grad():
            s = self.student.logprobs(h, w)  # [c, V]
            tokens, weights = self.tokens[rows], self.weights[rows]
            grad_h = grad_w = None
            if self.loss is None:
                terms, value = {"s_y": s.gather(-1, tokens[:, None])[:, 0]}, s.new_zeros(())
                terms["entropy"] = -torch.where(s > float("-inf"), s.exp() * s, torch.zeros_like(s)).sum(-1)
                if t is not None:
                    terms |= {"t_y": t.gather(-1, tokens[:, None])[:, 0], "rkl": kl(s, t)}
            elif need_h or need_w:
                terms, grad = logit_gradient(self.loss, s, t, tokens, self.mu[rows], self.student.temperature)
                grad.mul_(weights[:, None])  # dL/dz of the weighted sum
                grad_h = grad @ w if need_h else None
                grad_w = grad.T @ h if need_w else None
            else:
                terms = token_losses(self.loss, s, t, tokens, self.mu[rows])
            if self.loss is not None:
                value = (terms["loss"] * weights).sum()
            self._record(rows, s, terms)
        return value, grad_h, grad_w

    def _autograd(self, rows: slice, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, need_h: bool, need_w: bool):
        with torch.enable_grad():
            h, w = h.detach().requires_grad_(need_h), w.detach().requires_grad_(need_w)
            s = self.student.logprobs(h, w)
            terms = token_losses(self.loss, s, t, self.tokens[rows], self.mu[rows])
            value = (terms["loss"] * self.weights[rows]).sum()
            grads = iter(torch.autograd.grad(value, [x for x in (h, w) if x.requires_grad]))
        self._record(rows, s.detach(), terms)
        return value.detach(), next(grads) if need_h else None, next(grads) if need_w else None

    def _record(self, rows: slice, s: torch.Tensor, terms: dict[str, torch.Tensor]) -> None:
        if self.rollout is not None:  # float32: float64's result to float32 rounding (dev/LOG.md), at half the cost
            terms["kl_exact"] = kl(self.rollout.rows(rows, s.device), s)
        for name, x in terms.items():
            self.terms.setdefault(name, []).append(x.detach())

    def gathered(self) -> dict[str, torch.Tensor]:
        return {name: torch.cat(parts) for name, parts in self.terms.items()}


class _ChunkedLoss(torch.autograd.Function):
    """loss = sum over chunks of job.run(chunk); gradients computed chunk by chunk in forward (module docstring)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, job: Job) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        w = as_multiplied(weight)
        for rows in job.slices():
            value, gh, gw = job.run(rows, hidden[rows].detach(), w, need_h, need_w)
            if need_h:
                grad_h[rows] = gh
            if need_w:
                grad_w = gw.to(weight.dtype) if grad_w is None else grad_w.add_(gw)
            total += value
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        if grad.item() == 1:  # loss.backward(): the stored gradients as they are (a [V, d] product by 1 saved)
            return grad_h, grad_w, None
        return (None if grad_h is None else grad_h * grad.to(grad_h.dtype),
                None if grad_w is None else grad_w * grad.to(grad_w.dtype), None)


def score(student: Student, tokens: torch.Tensor, mu: torch.Tensor | None = None, weights: torch.Tensor | None = None,
          loss: LossConfig | None = None, teacher: Source | None = None, rollout: Source | None = None,
          chunk_tokens: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token terms over M tokens, a chunk at a time -> (the weighted loss, a scalar that backpropagates into the
    student's hidden states and output weight when they require it; {name: [M] tensor}).

    Terms: "s_y" (the student's log-prob of each token); with a loss, token_losses' ("loss" per token, "t_y", and
    "advantage", "coef" for sampled_rkl); without one but with a teacher, "t_y" and "rkl" (KL(student || teacher) per
    token); with a rollout source, "kl_exact". weights: each token's weight in the loss (default 1 / M)."""
    M = tokens.shape[0]
    assert student.hidden.shape[0] == M, f"{student.hidden.shape[0]} hidden rows for {M} tokens"
    assert loss is None or teacher is not None, "a loss needs the teacher"
    device, dtype = student.hidden.device, torch.promote_types(student.hidden.dtype, torch.float32)
    mu = torch.zeros(M, device=device, dtype=dtype) if mu is None else mu
    weights = torch.full((M,), 1 / max(M, 1), device=device, dtype=dtype) if weights is None else weights
    job = Job(student, tokens, mu, weights, loss, teacher, rollout, chunk_size(student.weight.shape[0], chunk_tokens))
    if torch.is_grad_enabled() and (student.hidden.requires_grad or student.weight.requires_grad):
        value = _ChunkedLoss.apply(student.hidden, student.weight, job)
    else:
        value = sum((job.run(rows, student.hidden[rows], student.weight)[0] for rows in job.slices()),
                    student.hidden.new_zeros(()))
    return value, job.gathered() if M else {}
