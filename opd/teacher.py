"""The teacher's side of the mismatch: who scores the student's tokens for the teacher, and how far that is from the
trainer's full-precision teacher.

In most OPD systems the teacher runs in an inference server, not in the trainer: it scores the student's sequences
by prefill (vLLM's prompt log-probs), often returns only its top-k log-probs, often at lower precision. The config's
`teacher_engine` picks who scores:
- `trainer`: the teacher's own forward in the learner (learner.py), whole distributions: no object here, unless
  `teacher_topk` asks for the top-k alone (`TrainerTeacher`, which isolates what top-k costs from any precision).
- `builtin`: the built-in engine (engine.py) on the teacher's weights under `teacher_plan` (the plan grammar: KV
  cache and weight precision, noise): each micro-batch's sequences prefilled through its KV cache
  (`Engine.prefill_hidden`), the output layer of the engine's copy applied a chunk of tokens at a time.
- `vllm`: vLLM's prompt log-probs (`VllmEngine.score`): per position the top-k and the sampled token's log-prob; with
  `teacher_topk` 0, every token's (k = V; only sensible at a small vocabulary).

A top-k teacher is a distribution known on its k most likely tokens and the sampled one. It is handed to the losses
as log-probs [c, V] that are -inf elsewhere, built one chunk at a time (chunked.py never holds [tokens, V]):
losses.py's top-k losses read only the top k (the tail bucket's mass is what their k log-probs leave) and the
sampled-token loss only the sampled token's; config.py refuses the losses that need whole rows.

**Teacher-side metrics** (`teacher_mismatch/`, metrics.teacher_mismatch_metrics) compare the engine's log-prob of each
sampled token with the trainer's teacher's on the first ceil(teacher_check x B) rollouts of every batch, which the
trainer's teacher also scores (the rest of the batch never runs it). With whole rows from the engine they include the
exact per-position KL(p_engine || p_trainer); with top-k, the tail mass the engine's k tokens leave.
"""
import math
import time

import torch

from opd.chunked import Source, Student, output_layer, score
from opd.errors import require
from opd.learner import Batch, completion_hidden, unpack
from opd.model import Transformer
from opd.plan import Plan


VLLM_WHOLE_ROWS = 4096  # the largest vocabulary a vLLM teacher is asked for whole rows (prompt_logprobs = V)


def sequences(batch: Batch) -> tuple[list[list[int]], list[list[int]]]:
    """The batch's prompts and completions as token lists (the learner's batch back to what an engine is sent)."""
    prompts, completions = [], []
    for b in range(batch.tokens.shape[0]):
        P, n = int(batch.positions[b, 0]) + 1, int(batch.mask[b].sum())
        prompts.append(batch.input_ids[b, :P].tolist())
        completions.append(batch.tokens[b, :n].tolist())
    return prompts, completions


def keep_topk(logp: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log-probs [c, V] -> (the same on the k most likely tokens and the sampled token, -inf elsewhere; the mass the
    k leave, [c])."""
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    out = torch.full_like(logp, -math.inf).scatter_(-1, top.indices, top.values)
    out.scatter_(-1, tokens[:, None], logp.gather(-1, tokens[:, None]))
    return out, (1 - top.values.exp().sum(-1)).clamp(min=0)


class TopK:
    """A Source cut to its top k (and the sampled token) one chunk at a time; `tails` collects the tail masses."""

    def __init__(self, base: Source, tokens: torch.Tensor, k: int):
        self.base, self.tokens, self.k, self.tails = base, tokens, k, []

    @property
    def seconds(self) -> float:
        return self.base.seconds

    @seconds.setter
    def seconds(self, value: float) -> None:
        self.base.seconds = value

    def rows(self, rows: slice, device: torch.device) -> torch.Tensor:
        out, tail = keep_topk(self.base.rows(rows, device), self.tokens[rows].to(device), self.k)
        self.tails.append(tail)
        return out


class Sparse:
    """Log-probs known on a few tokens per position (an inference server's answer): indices, values [M, K] -> rows
    [c, V] with -inf elsewhere. `tails`: the mass the top k leave, [M]."""

    def __init__(self, indices: torch.Tensor, values: torch.Tensor, vocab: int, tails: torch.Tensor | None = None,
                 seconds: float = 0.0):
        self.indices, self.values, self.vocab, self.seconds = indices, values, vocab, seconds
        self.tails = [] if tails is None else [tails]

    def rows(self, rows: slice, device: torch.device) -> torch.Tensor:
        idx, val = self.indices[rows].to(device), self.values[rows].to(device)
        return torch.full((idx.shape[0], self.vocab), -math.inf, device=device).scatter_(-1, idx, val)


class TeacherEngine:
    """Scores a micro-batch for the teacher: `source(batch)` -> its distributions (a chunked.Source or the same
    interface). whole_rows: they are whole distributions (teacher_topk 0)."""
    name = "trainer"

    def __init__(self, topk: int):
        self.topk = topk
        self.whole_rows = topk == 0

    def source(self, batch: Batch):
        start = time.perf_counter()
        with torch.no_grad():
            out = self._source(batch)
        out.seconds += time.perf_counter() - start
        return out

    def _source(self, batch: Batch):
        raise NotImplementedError

    def _cut(self, source: Source, batch: Batch):
        return TopK(source, batch.tokens[batch.mask], self.topk) if self.topk else source

    def close(self) -> None:
        pass


class TrainerTeacher(TeacherEngine):
    """The trainer's teacher, cut to its top k (teacher_engine trainer with teacher_topk)."""

    def __init__(self, model: Transformer, topk: int):
        super().__init__(topk)
        self.model = model

    def _source(self, batch: Batch):
        return self._cut(Source(completion_hidden(self.model, batch), output_layer(self.model)), batch)


class BuiltinTeacher(TeacherEngine):
    """The teacher's weights in the built-in engine under a precision plan, scoring by prefill."""
    name = "builtin"

    def __init__(self, model: Transformer, plan: Plan, pad_id: int, topk: int = 0, noise_seed: int = 0):
        from opd.engine import Engine
        super().__init__(topk)
        self.engine = Engine(model, [-1], pad_id, plan, noise_seed=noise_seed)

    def _source(self, batch: Batch):
        hidden = torch.cat(self.engine.prefill_hidden(*sequences(batch)))  # [M, d], the mask's (row-major) order
        return self._cut(Source(hidden, output_layer(self.engine.model)), batch)


class VllmTeacher(TeacherEngine):
    """The teacher in vLLM, scoring by its prompt log-probs."""
    name = "vllm"

    def __init__(self, model_dir, plan: Plan, pad_id: int, vocab: int, topk: int = 0, seed: int = 0,
                 max_model_len: int = 512, tied: bool = True):
        from opd.vllm_engine import VllmEngine
        super().__init__(topk)
        self.vocab, self.k = vocab, topk or vocab
        self.engine = VllmEngine(model_dir, [-1], pad_id, plan, seed=seed, max_model_len=max_model_len, tied=tied,
                                 max_logprobs=self.k)

    def _source(self, batch: Batch):
        # per sequence: the sampled tokens' log-probs [n], the top-k ids and log-probs [n, k]
        scored = self.engine.score(*sequences(batch), self.k)
        tokens = batch.tokens[batch.mask]
        sampled = torch.cat([s for s, _, _ in scored])
        top_ids, top = torch.cat([i for _, i, _ in scored]), torch.cat([v for _, _, v in scored])
        # the sampled token first: where it is also in the top k, both entries hold vLLM's one number for it
        return Sparse(torch.cat([tokens[:, None], top_ids], 1), torch.cat([sampled[:, None], top], 1), self.vocab,
                      (1 - top.exp().sum(-1)).clamp(min=0) if self.topk else None)

    def close(self) -> None:
        self.engine.close()


def make_teacher_engine(cfg, teacher: Transformer, pad_id: int, teacher_dir=None) -> TeacherEngine | None:
    """The config's teacher engine; None for the trainer's teacher with whole rows (learner.py's own path)."""
    n = teacher.cfg.num_layers
    plan = Plan.from_mapping(cfg.teacher_plan, n) if isinstance(cfg.teacher_plan, dict) else \
        Plan.parse(cfg.teacher_plan, n)
    if cfg.teacher_engine == "builtin":
        return BuiltinTeacher(teacher, plan, pad_id, cfg.teacher_topk, cfg.noise_seed)
    if cfg.teacher_engine == "vllm":
        require(teacher_dir is not None, "teacher_engine vllm needs the teacher's checkpoint folder")
        V = teacher.cfg.vocab_size
        require(cfg.teacher_topk or V <= VLLM_WHOLE_ROWS, f"teacher_engine vllm with teacher_topk 0 would ask vLLM for "
                f"all {V} log-probs of every position", "set teacher_topk (e.g. 20) with loss.name sampled_rkl, "
                "topk_fkl or topk_rkl_tail, or teacher_engine builtin for whole distributions")
        return VllmTeacher(teacher_dir, plan, pad_id, teacher.cfg.vocab_size, cfg.teacher_topk, cfg.seed,
                           teacher.cfg.context, teacher.cfg.tie_word_embeddings)
    return TrainerTeacher(teacher, cfg.teacher_topk) if cfg.teacher_topk else None


def check_rows(batch_size: int, share: float) -> int:
    """How many rollouts of a batch the trainer's teacher also scores (the first ones): ceil(share x B)."""
    return min(batch_size, math.ceil(share * batch_size - 1e-9))


def trainer_scores(teacher: Transformer, engine: TeacherEngine, batch: Batch,
                   chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The trainer's teacher on a batch: its log-prob of each sampled token [B, N] and, when the engine gives whole
    rows, the exact KL(p_engine || p_trainer) per position [B, N] (the engine scores the rows again for it)."""
    with torch.no_grad():
        hidden = completion_hidden(teacher, batch)
        rollout = engine.source(batch) if engine.whole_rows else None
        _, terms = score(Student(hidden, teacher.lm_head.weight), batch.tokens[batch.mask].to(hidden.device),
                         rollout=rollout, chunk_tokens=chunk_tokens)
    kl = unpack(terms["kl_exact"], batch.mask) if "kl_exact" in terms else None
    return unpack(terms["s_y"], batch.mask), kl
