"""The teacher's side of the mismatch: one interface for whoever scores the student's tokens for the teacher, and the
check of a served teacher against the trainer's full-precision one.

In most OPD systems the teacher runs in an inference server, not in the trainer: it scores the student's sequences
by prefill (vLLM's prompt log-probs), often returns only its top-k log-probs, often at lower precision. A `Teacher`
scores a micro-batch (`source`: its distributions over the packed completion tokens, computed a chunk at a time),
names the trainer's full-precision teacher behind it (`trainer`: evaluation and the check use it), and has a state
for a resume. The implementations, by the config's `teacher.engine` (config.TeacherConfig):
- `trainer`: `LocalTeacher`, the teacher's own forward in the learner, whole distributions; or, with `ray.teacher`,
  ray_backend.RemoteTeacher (its body on a Ray actor, its output layer here).
- `builtin`: `BuiltinTeacher`, the built-in engine (engine.py) on the teacher's weights under `teacher.plan` (the
  plan grammar: KV cache and weight precision, noise): each micro-batch's sequences prefilled through its KV cache
  (`Engine.prefill_hidden`), the output layer of the engine's copy applied a chunk of tokens at a time. Its state:
  the calibrated KV scales.
- `vllm`: `VllmTeacher`, vLLM's prompt log-probs (`VllmEngine.score`): per position the top-k and the sampled
  token's log-prob; with `teacher.topk` 0, every token's (k = V; only sensible at a small vocabulary).
Two wrappers: `TopKTeacher` cuts a whole-rows teacher to its top k (`teacher.topk` on the trainer's or the built-in
teacher; which isolates what top-k costs from any precision), and `CheckedTeacher` checks any teacher that is not the
trainer's own against it. `make_teacher` builds the run's teacher from the config; nothing else asks which kind a
teacher is.

A top-k teacher is a distribution known on its k most likely tokens and the sampled one. It is handed to the losses
as log-probs [c, V] that are -inf elsewhere, built one chunk at a time (chunked.py never holds [tokens, V]):
losses.py's top-k losses read only the top k (the tail bucket's mass is what their k log-probs leave) and the
sampled-token loss only the sampled token's; config.py refuses the losses that need whole rows.

**Teacher-side metrics** (`teacher_mismatch/`, metrics.teacher_mismatch_metrics) compare the served teacher's log-prob
of each sampled token with the trainer's teacher's on the first ceil(teacher.check x B) rollouts of every batch, which
the trainer's teacher also scores (the rest of the batch never runs it). With whole rows from the engine they include
the exact per-position KL(p_engine || p_trainer); with top-k, the tail mass the engine's k tokens leave. The check
runs micro-batch by micro-batch as the served teacher answers (`CheckedTeacher.source`, `TeacherCheck`), on that
answer.
"""
import math
import time
from typing import Callable, Protocol

import torch

from opd.training.chunked import Source, Student, output_layer, score
from opd.io.errors import require
from opd.numerics.kv_cache import scales_fit
from opd.training.learner import Batch, completion_hidden, unpack
from opd.models.model import Transformer
from opd.numerics.plan import Plan


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


class Teacher(Protocol):
    """Who scores the student's tokens for the teacher. `source(mb)` -> the micro-batch's teacher distributions over
    its packed completion tokens: a chunked.Source (whole rows), or the same interface (`rows`, `seconds`, and for a
    top-k answer `tails`). `trainer`: the full-precision teacher of the trainer behind it (itself when it is that one),
    which evaluation and the teacher-side check use. state_dict: what must survive a resume."""
    whole_rows: bool  # source() gives whole distributions (not only the top k)

    @property
    def trainer(self) -> "Teacher": ...
    def source(self, mb: Batch): ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict, where: str) -> None: ...
    def close(self) -> None: ...


def timed_source(hidden_of: Callable[[Batch], torch.Tensor], lm_head_owner, mb: Batch) -> Source:
    """A whole-rows Source of a micro-batch: the final hidden states at its completion positions now (hidden_of), the
    output layer of `lm_head_owner` chunk by chunk later; the time in both is the source's `seconds`."""
    start = time.perf_counter()
    with torch.no_grad():
        source = Source(hidden_of(mb), output_layer(lm_head_owner))
    source.seconds = time.perf_counter() - start
    return source


class NoState:
    """A teacher with nothing to save for a resume and nothing to release: the last three methods of `Teacher`."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, where: str) -> None:
        pass

    def close(self) -> None:
        pass


class Wrapper:
    """A teacher around another one (`inner`): the same trainer's teacher behind it, the same state and lifetime."""

    def __init__(self, inner: "Teacher"):
        self.inner = inner

    @property
    def trainer(self) -> "Teacher":
        return self.inner.trainer

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict, where: str) -> None:
        self.inner.load_state_dict(state, where)

    def close(self) -> None:
        self.inner.close()


class LocalTeacher(NoState):
    """The trainer's teacher: its forward in this process, whole distributions (teacher.engine trainer)."""
    whole_rows = True

    def __init__(self, model: Transformer):
        self.model = model

    @property
    def trainer(self) -> "LocalTeacher":
        return self

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.lm_head

    def source(self, mb: Batch) -> Source:
        return timed_source(lambda b: completion_hidden(self.model, b), self.model, mb)


class EngineTeacher(NoState):
    """A teacher scored by an inference engine (`_source`), timed; `trainer` is the trainer's own teacher, which the
    check (CheckedTeacher) and evaluation use."""
    whole_rows = True

    def __init__(self, trainer: "Teacher"):
        self._trainer = trainer

    @property
    def trainer(self) -> "Teacher":
        return self._trainer

    def source(self, mb: Batch):
        start = time.perf_counter()
        with torch.no_grad():
            out = self._source(mb)
        out.seconds += time.perf_counter() - start
        return out

    def _source(self, mb: Batch):
        raise NotImplementedError


class BuiltinTeacher(EngineTeacher):
    """The teacher's weights in the built-in engine under a precision plan, scoring by prefill; its calibrated KV
    scales (kept for the engine's lifetime, as vLLM keeps them) are its state."""

    def __init__(self, trainer: "Teacher", model: Transformer, plan: Plan, pad_id: int, noise_seed: int = 0):
        from opd.engines.builtin import Engine
        super().__init__(trainer)
        self.engine = Engine(model, [-1], pad_id, plan, noise_seed=noise_seed)

    def _source(self, mb: Batch):
        hidden = torch.cat(self.engine.prefill_hidden(*sequences(mb)))  # [M, d], the mask's (row-major) order
        return Source(hidden, output_layer(self.engine.model))

    def state_dict(self) -> dict:
        return {"teacher_scales": dict(self.engine.scales)}

    def load_state_dict(self, state: dict, where: str) -> None:
        scales, t = state.get("teacher_scales", {}), self.engine.model.cfg
        require(scales_fit(scales, t.num_layers, t.num_kv_heads),
            f"{where}: its teacher engine's KV scales do not fit the teacher",
            "the checkpoint is damaged or was not written by opd: start the run again with --overwrite")
        self.engine.scales.update(scales)


class VllmTeacher(EngineTeacher):
    """The teacher in vLLM, scoring by its prompt log-probs: per position the sampled token's and the top k's (k = V
    for whole rows)."""

    def __init__(self, trainer: "Teacher", model_dir, plan: Plan, pad_id: int, vocab: int, size, topk: int = 0,
                 seed: int = 0, tied: bool = True):
        """size: vllm_engine.EngineSize, the sequences it scores at once."""
        from opd.engines.vllm import VllmEngine
        super().__init__(trainer)
        self.vocab, self.topk, self.k = vocab, topk, topk or vocab
        self.whole_rows = topk == 0
        self.engine = VllmEngine(model_dir, [-1], pad_id, plan, size, seed=seed, tied=tied, max_logprobs=self.k)

    def _source(self, mb: Batch):
        # per sequence: the sampled tokens' log-probs [n], the top-k ids and log-probs [n, k]
        scored = self.engine.score(*sequences(mb), self.k)
        tokens = mb.tokens[mb.mask]
        sampled = torch.cat([s for s, _, _ in scored])
        top_ids, top = torch.cat([i for _, i, _ in scored]), torch.cat([v for _, _, v in scored])
        # the sampled token first: where it is also in the top k, both entries hold vLLM's one number for it
        return Sparse(torch.cat([tokens[:, None], top_ids], 1), torch.cat([sampled[:, None], top], 1), self.vocab,
                      (1 - top.exp().sum(-1)).clamp(min=0) if self.topk else None)

    def close(self) -> None:
        self.engine.close()


class TopKTeacher(Wrapper):
    """A whole-rows teacher cut to its k most likely tokens and the sampled one, a chunk at a time (teacher.topk on a
    teacher that returns whole rows)."""
    whole_rows = False

    def __init__(self, base: "Teacher", k: int):
        super().__init__(base)
        self.k = k

    def source(self, mb: Batch) -> TopK:
        return TopK(self.inner.source(mb), mb.tokens[mb.mask], self.k)


class CheckedTeacher(Wrapper):
    """A served teacher (an engine, or top-k) checked against the trainer's full-precision one: on the first
    ceil(share x B) rollouts of every batch the trainer's teacher also scores the tokens (TeacherCheck), for
    teacher_mismatch/*. `begin(B)` before each batch, `check` after it."""

    def __init__(self, served: "Teacher", share: float, chunk_tokens: int = 0):
        super().__init__(served)
        self.share, self.chunk_tokens = share, chunk_tokens
        self.whole_rows = served.whole_rows
        self.check: TeacherCheck | None = None

    def begin(self, batch_size: int, rows: int | None = None) -> "TeacherCheck":
        """A new check for a batch of batch_size rollouts (rows: how many to check; default the share's)."""
        rows = check_rows(batch_size, self.share) if rows is None else rows
        self.check = TeacherCheck(self.trainer, rows, self.whole_rows, self.chunk_tokens)
        return self.check

    def source(self, mb: Batch):
        answer = self.inner.source(mb)
        if self.check is not None:
            spent = answer.seconds
            self.check(mb, answer)
            if self.whole_rows:  # the check read the answer's rows: that is the check's time (time/teacher_check)
                answer.seconds = spent
        return answer


def make_teacher(settings, trainer: "Teacher", model: Transformer, pad_id: int, teacher_dir=None, *, seed: int = 0,
                 noise_seed: int = 0, chunk_tokens: int = 0, context: int = 0, max_seqs: int = 1) -> "Teacher":
    """The run's teacher from its `teacher` section (config.TeacherConfig): `trainer` (the trainer's teacher:
    LocalTeacher, or ray_backend.RemoteTeacher) itself, or an engine / top-k teacher checked against it
    (CheckedTeacher). A vLLM teacher is sized for max_seqs sequences of context tokens (engines.make_engine)."""
    if not settings.served:
        return trainer
    n = model.cfg.num_layers
    plan = Plan.from_mapping(settings.plan, n) if isinstance(settings.plan, dict) else Plan.parse(settings.plan, n)
    k = settings.topk
    if settings.engine == "vllm":
        require(teacher_dir is not None, "teacher.engine vllm needs the teacher's checkpoint folder")
        V = model.cfg.vocab_size
        require(k or V <= VLLM_WHOLE_ROWS, f"teacher.engine vllm with teacher.topk 0 would ask vLLM for all {V} "
                "log-probs of every position", "set teacher.topk (e.g. 20) with loss.name sampled_rkl, topk_fkl or "
                "topk_rkl_tail, or teacher.engine builtin for whole distributions")
        from opd.engines.vllm import EngineSize
        served = VllmTeacher(trainer, teacher_dir, plan, pad_id, V, EngineSize.of(model.cfg, context, max_seqs), k,
                             seed, model.cfg.tie_word_embeddings)  # asks vLLM for the top k itself
    else:
        served = BuiltinTeacher(trainer, model, plan, pad_id, noise_seed) if settings.engine == "builtin" else trainer
        served = TopKTeacher(served, k) if k else served
    return CheckedTeacher(served, settings.check, chunk_tokens)


def check_rows(batch_size: int, share: float) -> int:
    """How many rollouts of a batch the trainer's teacher also scores (the first ones): ceil(share x B)."""
    return min(batch_size, math.ceil(share * batch_size - 1e-9))


class TeacherCheck:
    """The trainer's teacher on the first `rows` rollouts of a batch, for teacher_mismatch/*: CheckedTeacher hands it
    each micro-batch with the served teacher's answer, whose first packed rows are those rollouts' tokens, so the
    exact KL(p_engine || p_trainer) (whole rows only) reuses the served answer: the engine never scores a rollout
    twice, and nothing outlives its micro-batch but [rows, N] results. teacher: the trainer's (a Teacher with whole
    rows and an `lm_head`)."""

    def __init__(self, teacher, rows: int, whole_rows: bool, chunk_tokens: int = 0):
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
            hidden = self.teacher.source(checked).hidden
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
