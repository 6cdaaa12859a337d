"""From rollout records to training tensors, and the learner's pass over them: the student's and teacher's scores of
every sampled token, the loss and its gradient, a micro-batch and a chunk of tokens at a time.

A batch is the rollouts' prompt + completion sequences, right-padded into one [B, L] tensor: under a causal mask
right padding never reaches a real token, so one plain forward gives every position's hidden state. The
distribution that predicts completion token t of row b sits at position `P_b - 1 + t` (P_b = prompt length);
`positions` [B, N] indexes those, and `mask` [B, N] marks the real completion tokens. Only the hidden states at
those M = mask.sum() positions go on, packed as [M, d], to the output layers (chunked.py); per-token results come
back as [B, N] (zero off the mask).

Micro-batches (`compute.micro_batch_size` rows) run the teacher's and the student's forward and the student's backward on a
slice of the rows at a time, with every token weighted by 1 / (tokens in the whole batch): the accumulated gradient
is the whole batch's. `completion_logprobs` is the unchunked oracle ([B, N, V]); tests and nothing else use it.
"""
import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from opd.training.chunked import Source, Student, log_probs, score
from opd.training.losses import LossConfig, loss_metrics
from opd.models.model import Segments, Transformer
from opd.engines.sampling import Rollout


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] prompt + completion, right-padded
    positions: torch.Tensor  # [B, N] index into L of the distribution predicting completion token t
    tokens: torch.Tensor  # [B, N] completion tokens (pad where mask is False)
    mask: torch.Tensor  # [B, N] bool
    mu: torch.Tensor  # [B, N] sampler log-probs
    versions: list[int]  # policy version of each rollout
    raw: torch.Tensor | None = None  # [B, N] the sampler's log-probs before top-k/top-p (sampling.py)
    rollout_hidden: torch.Tensor | None = None  # [B, N, d] the engine's final hidden states, when it returned them
    q: torch.Tensor | None = None  # [B, N] log-probs under the sampling weights, when rollouts carry them (async)
    kl_exact: torch.Tensor | None = None  # [B, N] exact KL(p_rollout || p_q) per token, likewise
    has_q: torch.Tensor | None = None  # [B] bool: the rows that carry them (async may recompute only some)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def rows(self, sl: slice) -> "Batch":
        """The rollouts sl of the batch (a micro-batch)."""
        cut = lambda x: None if x is None else x[sl]  # noqa: E731
        return replace(self, input_ids=self.input_ids[sl], positions=self.positions[sl], tokens=self.tokens[sl],
                       mask=self.mask[sl], mu=self.mu[sl], versions=self.versions[sl], raw=cut(self.raw),
                       rollout_hidden=cut(self.rollout_hidden), q=cut(self.q), kl_exact=cut(self.kl_exact),
                       has_q=cut(self.has_q))

    def micro_batches(self, size: int) -> list["Batch"]:
        """Slices of `size` rollouts (0: the whole batch)."""
        B = self.tokens.shape[0]
        size = size or B
        return [self.rows(slice(i, i + size)) for i in range(0, B, size)]


def collate(rollouts: list[Rollout], pad_id: int) -> Batch:
    B = len(rollouts)
    N = max(1, max(len(r.completion_ids) for r in rollouts))
    L = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    positions = torch.zeros(B, N, dtype=torch.long)
    tokens = torch.full((B, N), pad_id, dtype=torch.long)
    mask = torch.zeros(B, N, dtype=torch.bool)
    mu, raw = torch.zeros(B, N), torch.zeros(B, N)
    for b, r in enumerate(rollouts):
        P, n = len(r.prompt_ids), len(r.completion_ids)
        input_ids[b, :P + n] = torch.tensor(r.prompt_ids + r.completion_ids)
        positions[b] = (P - 1 + torch.arange(N)).clamp(max=L - 1)
        tokens[b, :n] = torch.tensor(r.completion_ids, dtype=torch.long)
        mask[b, :n] = True
        mu[b, :n] = torch.tensor(r.logprobs)
        raw[b, :n] = torch.tensor(r.raw_logprobs, dtype=raw.dtype)
    hidden = None
    if all(r.hidden is not None for r in rollouts):
        first = rollouts[0].hidden
        hidden = torch.zeros(B, N, first.shape[-1], dtype=first.dtype, device=first.device)
        for b, r in enumerate(rollouts):
            hidden[b, :len(r.completion_ids)] = r.hidden
    has_q = torch.tensor([r.q is not None for r in rollouts])
    return Batch(input_ids, positions, tokens, mask, mu, [r.policy_version for r in rollouts], raw, hidden,
                 _per_token(rollouts, "q", N), _per_token(rollouts, "kl_exact", N), has_q if has_q.any() else None)


def numerics_mu(batch: Batch, truncates: bool) -> torch.Tensor:
    """[B, N] the sampler's log-probs the numerics metrics compare with q: mu itself, or with top-k/top-p truncation
    on, the log-probs before it (the truncation's own shift is metrics.truncation_metrics')."""
    return batch.raw if truncates and batch.raw is not None else batch.mu


def _per_token(rollouts: list[Rollout], name: str, N: int) -> torch.Tensor | None:
    """[B, N] of a per-token list field (zeros on rows without it), or None if no row has it."""
    if all(getattr(r, name) is None for r in rollouts):
        return None
    out = torch.zeros(len(rollouts), N)
    for b, r in enumerate(rollouts):
        if getattr(r, name) is not None:
            out[b, :len(r.completion_ids)] = torch.tensor(getattr(r, name))
    return out


def completion_index(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, positions) [M] of the hidden states that predict the completion tokens, in packed order."""
    rows, cols = batch.mask.nonzero(as_tuple=True)
    return rows, batch.positions[rows, cols]


@dataclass
class Packed:
    """A batch's sequences without their padding, one after another: ids and positions [1, T] for T = the real
    tokens, the sequences' lengths (model.Segments), and `index` [M]: where in T the hidden states that predict the
    completion tokens sit, in packed order."""
    ids: torch.Tensor
    positions: torch.Tensor
    lengths: tuple[int, ...]
    index: torch.Tensor


def pack(batch: Batch) -> Packed:
    """Row b of the batch is P_b + n_b real tokens (positions[b, 0] = P_b - 1): those rows, concatenated."""
    lengths = (batch.positions[:, 0] + 1 + batch.mask.sum(1)).tolist()
    ids = torch.cat([row[:n] for row, n in zip(batch.input_ids, lengths)])
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in lengths])
    rows, cols = completion_index(batch)
    return Packed(ids[None], positions[None], tuple(lengths), starts[rows] + cols)


def packed_hidden(model: Transformer, packed: Packed) -> torch.Tensor:
    """The model's final hidden states at `packed.index`: [M, d]. Only real tokens are computed (a batch of HumanEval
    prompts is ~40% padding when right-padded to its longest row), each sequence attending to itself."""
    device = model.embed_tokens.weight.device
    h = model.hidden(packed.ids.to(device), packed.positions.to(device), Segments(packed.lengths))  # [1, T, d]
    return h[0, packed.index.to(device)]


def completion_hidden(model: Transformer, batch: Batch) -> torch.Tensor:
    """The model's final hidden states at the positions that predict the completion tokens, packed: [M, d]."""
    return packed_hidden(model, pack(batch))


def unpack(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[M] values of the masked tokens -> [B, N] (zero elsewhere), on the CPU."""
    out = torch.zeros(mask.shape, dtype=values.dtype)
    out[mask] = values.cpu()
    return out


@dataclass
class Scores:
    """One pass over a batch: per-token [B, N] results (zero off the mask) and, with a loss, its value and metrics."""
    pi: torch.Tensor  # the student's log-prob of each sampled token (before any update): q in the sync schedule
    teacher: torch.Tensor | None  # the teacher's
    kl_exact: torch.Tensor | None  # KL(p_rollout || p_student) per token, where the batch has rollout hidden states
    rkl: torch.Tensor | None  # KL(p_student || p_teacher) per token (without a loss)
    loss: float = float("nan")
    metrics: dict | None = None
    teacher_seconds: float = 0.0  # time in the teacher's forward and output layer
    teacher_tails: torch.Tensor | None = None  # [M] a top-k teacher's tail mass per token (teacher.py)
    terms: dict | None = None  # the loss's per-token terms over the masked positions, row by row (losses.py)


@dataclass(frozen=True)
class Scoring:
    """How a batch is scored, wherever it is (the learner's step, the probe, evaluation, the async worker's
    recompute): the loss (None: scores only), the training temperature, rollouts per forward (0: all) and tokens per
    chunk of full-vocabulary work (0: chunked.py's default), and the student's compute dtype (autocast; None:
    float32)."""
    loss: LossConfig | None = None
    temperature: float = 1.0
    micro_batch_size: int = 0
    chunk_tokens: int = 0
    autocast: torch.dtype | None = None

    @classmethod
    def of(cls, cfg, loss: bool = True) -> "Scoring":
        """A run config's (config.TrainConfig, resolved: its temperature set); loss=False: scores only."""
        from opd.models.devices import autocast_dtype
        return cls(cfg.loss if loss else None, cfg.sampling.temperature, cfg.compute.micro_batch_size,
                   cfg.compute.chunk_tokens, autocast_dtype(cfg.compute.dtype))


def score_batch(student: Transformer, batch: Batch, teacher=None, how: Scoring = Scoring(),
                rollout: Callable[[torch.Tensor], torch.Tensor] | None = None, backward: bool = False,
                total_tokens: float | None = None) -> Scores:
    """Score every sampled token of the batch with the student (at how.temperature), the teacher (teacher.Teacher:
    its `source` of each micro-batch) and, when the batch has the engine's hidden states, the rollout distributions
    (`rollout`: hidden rows -> the engine's log-probs). With a loss and backward=True, the loss's gradient is
    accumulated into the student's .grad, micro-batch by micro-batch. total_tokens: the tokens of the whole batch
    this one is part of (a sharded learner's sub-batch: training/sharded.py); default: this batch's."""
    weight = 1 / max(total_tokens or batch.num_tokens, 1)  # every token's share of the whole batch's mean
    value, parts, seconds, tails = 0.0, [], 0.0, []
    autocast = how.autocast
    for mb in batch.micro_batches(how.micro_batch_size):
        teacher_source = None if teacher is None else teacher.source(mb)
        with torch.set_grad_enabled(backward), torch.autocast(student.embed_tokens.weight.device.type,
                                                               autocast or torch.bfloat16, enabled=bool(autocast)):
            loss_value, terms = _score_rows(student, mb, teacher_source, how.loss, how.temperature, how.chunk_tokens,
                                            rollout, weight)
        if backward and loss_value.requires_grad:
            loss_value.backward()
        value += loss_value.item()
        seconds += teacher_source.seconds if teacher_source else 0.0
        tails += getattr(teacher_source, "tails", [])
        parts.append(terms)
    terms = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    field = lambda name: unpack(terms[name], batch.mask) if name in terms else None  # noqa: E731
    metrics = loss_metrics(terms, torch.ones_like(terms["s_y"], dtype=torch.bool)) if how.loss is not None else None
    return Scores(field("s_y"), field("t_y"), field("kl_exact"), field("rkl"), value, metrics, seconds,
                  torch.cat(tails).cpu() if tails else None, {k: v.detach() for k, v in terms.items()})


def _score_rows(student: Transformer, mb: Batch, teacher: Source | None, loss: LossConfig | None, temperature: float,
                chunk_tokens: int, rollout, weight: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    device = student.embed_tokens.weight.device
    tokens, mu = mb.tokens[mb.mask].to(device), mb.mu[mb.mask].to(device)
    rollout_source = None
    if rollout is not None and mb.rollout_hidden is not None:
        rollout_source = Source(mb.rollout_hidden[mb.mask].to(device), rollout)
    weights = torch.full_like(mu, weight, dtype=torch.promote_types(mu.dtype, torch.float32))
    return score(Student(completion_hidden(student, mb), student.lm_head.weight, temperature), tokens, mu, weights,
                 loss, teacher, rollout_source, chunk_tokens)


def completion_logprobs(model: Transformer, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) at every completion position: [B, N, V] (with gradient if enabled).
    The unchunked oracle of `score_batch`: it holds [B, L, V] logits."""
    device = model.embed_tokens.weight.device
    logits = model(batch.input_ids.to(device))  # [B, L, V]
    V = logits.shape[-1]
    picked = logits.gather(1, batch.positions.to(device)[..., None].expand(-1, -1, V))  # [B, N, V]
    return log_probs(picked, temperature)


def token_logprobs(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, N, V], [B, N] -> [B, N]: the log-prob of each sampled token."""
    return logp.gather(-1, tokens[..., None])[..., 0]


def flat_gradient(model: torch.nn.Module) -> torch.Tensor:
    """The model's gradients as one float32 vector (a parameter without one counts as zeros), parameters in order."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in model.parameters()])


GRAD_PIECE = 1 << 22  # elements per piece of a gradient's sum of squares


def sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """A tensor's sum of squares in float64, a piece of 4M elements at a time: exact where PyTorch's float32 norm on a
    CPU is not (its L2 kernel accumulates in float32: 0.75% low on a 39M-element embedding gradient in torch 2.13,
    pytorch/pytorch#169237), without a float64 copy of the whole tensor."""
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for piece in flat.split(GRAD_PIECE):
        total += torch.linalg.vector_norm(piece, dtype=torch.float64).square()
    return total


def clip_gradients(params, max_norm: float, squares=None) -> float:
    """torch.nn.utils.clip_grad_norm_ with the global L2 norm summed exactly (sum_of_squares) -> the norm before
    clipping (nan or inf where a gradient is not finite; then nothing is scaled). squares(grads) -> the float64 sum of
    their squares over the whole gradient (a sharded learner's sums its shards over the ranks); one host sync."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = squares(grads) if squares is not None else torch.stack([sum_of_squares(g) for g in grads]).sum()
    norm = math.sqrt(total.item())
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return norm
