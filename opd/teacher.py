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
exact per-position KL(p_engine || p_trainer); with top-k, the tail mass the engine's k tokens leave. The check runs
micro-batch by micro-batch inside the learner's pass (`TeacherCheck`), on the engine's own answer.
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

    def rows(self, rows: slice, device: torch.device) -> torch.Tensor:
        out, tail = keep_topk(self.base.rows(rows, device), self.tokens[rows].to(device), self.k)
        self.tails.append(tail)
        return out


class Sparse:
    """Log-probs known on a few tokens per position (an inference server's answer): indices, values [M, K] -> rows
    [c, V] with -inf elsewhere. `tails`: the mass the top k leave, [M]."""

    def __init__(self, indices: torch.Tensor, values: torch.Tensor, vocab: int, tails: torch.Tensor | None = None):
        self.indices, self.values, self.vocab, self.seconds = indices, values, vocab, 0.0
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
        return TopK(out, batch.tokens[batch.mask], self.topk) if self.topk and isinstance(out, Source) else out

    def _source(self, batch: Batch):
        """The engine's answer: a Source of whole rows (cut to the top k by `source`), or a Sparse one."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class TrainerTeacher(TeacherEngine):
    """The trainer's teacher, cut to its top k (teacher_engine trainer with teacher_topk)."""

    def __init__(self, model: Transformer, topk: int):
        super().__init__(topk)
        self.model = model

    def _source(self, batch: Batch):
        return Source(completion_hidden(self.model, batch), output_layer(self.model))


class BuiltinTeacher(TeacherEngine):
    """The teacher's weights in the built-in engine under a precision plan, scoring by prefill."""
    name = "builtin"

    def __init__(self, model: Transformer, plan: Plan, pad_id: int, topk: int = 0, noise_seed: int = 0):
        from opd.engine import Engine
        super().__init__(topk)
        self.engine = Engine(model, [-1], pad_id, plan, noise_seed=noise_seed)

    def _source(self, batch: Batch):
        hidden = torch.cat(self.engine.prefill_hidden(*sequences(batch)))  # [M, d], the mask's (row-major) order
        return Source(hidden, output_layer(self.engine.model))


class VllmTeacher(TeacherEngine):
    """The teacher in vLLM, scoring by its prompt log-probs."""
    name = "vllm"

    def __init__(self, model_dir, plan: Plan, pad_id: int, vocab: int, size, topk: int = 0, seed: int = 0,
                 tied: bool = True):
        """size: vllm_engine.EngineSize, the sequences it scores at once."""
        from opd.vllm_engine import VllmEngine
        super().__init__(topk)
        self.vocab, self.k = vocab, topk or vocab
        self.engine = VllmEngine(model_dir, [-1], pad_id, plan, size, seed=seed, tied=tied, max_logprobs=self.k)

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


def make_teacher_engine(cfg, teacher: Transformer, pad_id: int, teacher_dir=None, context: int = 0,
                        max_seqs: int = 1) -> TeacherEngine | None:
    """The config's teacher engine; None for the trainer's teacher with whole rows (learner.py's own path). A vLLM
    teacher is sized for max_seqs sequences of context tokens (rollouts.make_engine)."""
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
        from opd.vllm_engine import EngineSize
        return VllmTeacher(teacher_dir, plan, pad_id, teacher.cfg.vocab_size,
                           EngineSize.of(teacher.cfg, context, max_seqs), cfg.teacher_topk, cfg.seed,
                           teacher.cfg.tie_word_embeddings)
    return TrainerTeacher(teacher, cfg.teacher_topk) if cfg.teacher_topk else None


def check_rows(batch_size: int, share: float) -> int:
    """How many rollouts of a batch the trainer's teacher also scores (the first ones): ceil(share x B)."""
    return min(batch_size, math.ceil(share * batch_size - 1e-9))


class TeacherCheck:
    """The trainer's teacher on the first `rows` rollouts of a batch, for teacher_mismatch/*: score_batch hands it each
    micro-batch with the teacher engine's source (`on_teacher_source`), whose first packed rows are those rollouts'
    tokens, so the exact KL(p_engine || p_trainer) (whole rows only) reuses the engine's answer: the engine never
    scores a rollout twice, and nothing outlives its micro-batch but [rows, N] results."""

    def __init__(self, teacher: Transformer, rows: int, whole_rows: bool, chunk_tokens: int = 0):
        self.teacher, self.rows, self.whole_rows, self.chunk_tokens = teacher, rows, whole_rows, chunk_tokens
        self.seen, self.seconds, self.trainer, self.kl = 0, 0.0, [], []

    def __call__(self, mb: Batch, source) -> None:
        k = min(self.rows - self.seen, mb.tokens.shape[0])
        self.seen += mb.tokens.shape[0]
        if k <= 0:
            return
        start = time.perf_counter()
        checked = mb.rows(slice(0, k))
        with torch.no_grad():
            hidden = completion_hidden(self.teacher, checked)
            _, terms = score(Student(hidden, self.teacher.lm_head.weight), checked.tokens[checked.mask].to(hidden.device),
                             rollout=source if self.whole_rows else None, chunk_tokens=self.chunk_tokens)
        self.trainer.append(unpack(terms["s_y"], checked.mask))
        if "kl_exact" in terms:
            self.kl.append(unpack(terms["kl_exact"], checked.mask))
        self.seconds += time.perf_counter() - start

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The trainer's teacher's log-prob of each sampled token of the checked rollouts [rows, N], and with whole
        rows the exact KL(p_engine || p_trainer) per position [rows, N]."""
        return torch.cat(self.trainer), torch.cat(self.kl) if self.kl else None
