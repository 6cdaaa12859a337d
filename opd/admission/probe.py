"""The admission check's probe: the candidate rollout engine samples a small batch of the run's own prompts, the
trainer's full-precision forward and the teacher score the same tokens (`measure`), with the BF16 floor beside them
(`probe`). admission.py judges the numbers; check.py is the check `opd admit` runs with them.
"""
import functools
import math
import time

import torch

from opd.health.rules import FLOOR_PLAN, METRIC
from opd.engines.kinds import kind
from opd.training.learner import Scoring, collate, numerics_mu, score_batch
from opd.health.metrics import masked_mean
from opd.health.metrics import exact_kl_metric, rollout_health, teacher_mismatch_metrics, truncation_metrics
from opd.numerics.plan import Plan
from opd.training.rollouts import sampler_seed
from opd.engines.sampling import SamplingParams
from opd.training.setup import ProbeSetup

def probe(setup: ProbeSetup, plan: Plan, floor: dict | None = None) -> dict:
    """The candidate plan's mismatch on the probe batch (+ the BF16 floor, measured unless given)."""
    start = time.perf_counter()
    numbers = measure(setup, plan, teacher_side=True)
    if floor is None:
        floor_plan = Plan.parse(FLOOR_PLAN, len(plan.layers))
        floor = numbers if str(floor_plan) == str(plan) else measure(setup, floor_plan)
    numbers |= {"floor_kl_k3": floor["kl_k3"], "floor_nsr": floor[METRIC]}
    numbers["seconds"] = time.perf_counter() - start
    return numbers


@torch.no_grad()
def measure(setup: ProbeSetup, plan: Plan, teacher_side: bool = False) -> dict:
    """The probe's metrics for one plan: the engine samples the probe prompts; the student (as the learner computes:
    its dtype, the training temperature) and the teacher score the tokens, a micro-batch and a chunk at a time; the
    built-in engine also gives its hidden states (for the exact KL) and KV saturation counts. teacher_side, with a
    teacher engine: the engine also scores the tokens, against the trainer's teacher (`teacher_nsr`, ...)."""
    cfg = setup.cfg
    engine = setup.make_engine(plan)
    if kind(cfg.engine.name).own_copy:  # it loaded the checkpoint folder: send it the student as it is (a warm one)
        engine.update_weights(setup.student.state_dict(), 0)
    full = engine.hidden_states  # the built-in engine: hidden states (exact KL) and KV saturation counts
    params = SamplingParams(cfg.new_tokens, **cfg.sampling.params())
    clipped = {}
    try:
        rollouts = engine.generate(setup.prompts, params, sampler_seed(cfg.seed, 0), return_hidden=full,
                                   stats=clipped)
        batch = collate(rollouts, setup.tok.pad_id)
        scores = score_batch(setup.student, batch, setup.teacher.trainer, Scoring.of(cfg, loss=False),
                             rollout=functools.partial(engine.logprobs, params=params) if full else None)
    finally:
        engine.close()
    q, t_y, mask = scores.pi, scores.teacher, batch.mask
    mu = numerics_mu(batch, params.truncates)  # the numerics only: a truncation's own shift is reported apart
    out = {**rollout_health(t_y, mu, q, mask, cfg.loss.cap), "nsr_se": nsr_standard_error(t_y, mu, q, mask)}
    if params.truncates:
        out |= {k.replace("sampling/", "truncation_"): v for k, v in truncation_metrics(batch.mu, batch.raw,
                                                                                       mask).items()}
    if scores.kl_exact is not None:
        out |= exact_kl_metric(scores.kl_exact, mask)
    if scores.rkl is not None:  # the student's distance to its teacher: exact KL(q || T) per token, the probe's mean
        out["rkl"] = masked_mean(scores.rkl.double(), mask).item()
    out |= clipped  # kv_clipped_k, kv_clipped_v (the built-in engine)
    if teacher_side and setup.teacher is not setup.teacher.trainer:  # a served teacher
        out |= teacher_side_numbers(setup, batch, scores)
    return {k.replace("teacher_mismatch/", "teacher_").split("/")[-1]: v for k, v in out.items()}


def nsr_standard_error(teacher: torch.Tensor, mu: torch.Tensor, q: torch.Tensor, mask: torch.Tensor,
                       draws: int = 1000) -> float:
    """The probe's statistical error: the bootstrap standard error of nsr = sum |q - mu| / sum |T - q| over the
    probe's tokens, its rollouts resampled with replacement (tokens of one rollout are not independent)."""
    m = mask.to(q.dtype)
    noise, signal = ((q - mu).abs() * m).sum(1), ((teacher - q).abs() * m).sum(1)
    rows = torch.randint(0, len(noise), (draws, len(noise)), generator=torch.Generator().manual_seed(0))
    return (noise[rows].sum(1) / signal[rows].sum(1).clamp(min=1e-30)).std().item() if len(noise) > 1 else math.inf


def teacher_side_numbers(setup: ProbeSetup, batch, scores) -> dict:
    """The teacher engine on the probe's tokens against the trainer's teacher (scores.teacher): teacher_mismatch/*
    over the whole probe batch."""
    check = setup.teacher.begin(len(batch.versions), rows=len(batch.versions))  # every rollout of the probe
    engine_scores = score_batch(setup.student, batch, setup.teacher, Scoring.of(setup.cfg, loss=False))
    return teacher_mismatch_metrics(engine_scores.teacher, scores.teacher, scores.pi, batch.mask, check.result()[1],
                                    engine_scores.teacher_tails)
