"""The admission check's probe: the candidate rollout engine samples a small batch of the run's own prompts, the
trainer's full-precision forward and the teacher score the same tokens, and admission.decide judges the numbers
(admission.py explains the statistic, the calibration and the decision; this module runs the models).

`admit` is the check `opd admit` runs: the candidate plan and the BF16 floor measured, the decision with its reasons
and, when it does not admit, the plan `propose_plan` finds: the same plan with calibrated FP8 KV scales if it had
fixed ones, else the most sensitive layers kept at BF16, one more at a time, until the probe is admitted.
"""
import functools
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from opd.admission import (ESCALATE_CLASSES, FAR_STUDENT_RKL, FLOOR_PLAN, KEEP, METRIC, calibrated, class_limits,
                            decide_numbers, decide_teacher, distance, drift_budget_for, estimator_class,
                            safe_staleness, staleness)
from opd.engines import kind
from opd.learner import Scoring, collate, numerics_mu, score_batch
from opd.losses import masked_mean
from opd.metrics import (TeacherHealth, exact_kl_metric, rollout_health, teacher_mismatch_metrics,
                         truncation_metrics)
from opd.plan import Plan, describe_layer
from opd.rollouts import sampler_seed
from opd.sampling import SamplingParams

# The probe's completions are the run's max_new_tokens long, at most this: its statistics are per-token means, and at
# real size sampling is most of its cost (benchmarks/realspeed.py: 16 x 128 tokens on the smollm2 pair, the candidate
# and the BF16 floor, 94-111 s, where the run's 512 would take ~4x that). The statistical error this leaves is
# nsr_se, a bootstrap over the rollouts (5% there).
PROBE_TOKENS = 128


@dataclass
class ProbeSetup:
    """What a probe needs from a training run: the config, the student, the run's teacher and an engine factory."""
    cfg: object  # TrainConfig
    student: torch.nn.Module
    teacher: object  # teacher.Teacher: the run's (a served one is checked against its `trainer`)
    tok: object
    make_engine: object  # (plan) -> engine
    prompts: list[list[int]] = field(default_factory=list)


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


# ---- the check, and the plan it proposes --------------------------------------------------------------------------

def warm_weights(cfg, steps: int) -> dict:
    """The student's weights after `steps` OPD steps of cfg's own recipe with BF16 rollouts (the floor plan,
    synchronous, no guard), trained in a temporary folder: the student a run has become once a large first move
    (a pruned or far-off student closing most of its gap in a few steps) is behind it. `opd admit --warmup`. The
    run's checkpoint, optimizer state included, passes through the system's temporary folder."""
    import tempfile
    from opd.checkpoint import load_checkpoint
    from opd.config import GuardConfig
    from opd.trainer import Interrupted, train
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder) / "warmup"
        try:
            train(replace(cfg, steps=steps, plan=FLOOR_PLAN, schedule="sync", save_every=0, guard=GuardConfig(),
                          eval=replace(cfg.eval, examples=1)), run_dir, progress=False)
        except Interrupted as e:  # nothing to resume: the folder goes with this function
            raise Interrupted(e.signum, at_boundary=False) from None
        return load_checkpoint(run_dir / "checkpoint", torch.float32)[0].state_dict()


def admit(setup: ProbeSetup, plan: Plan, thresholds: dict, limit: float = 0.0, propose: bool = True,
          warmup: int = 0, escalate: bool = False) -> dict:
    """ADMIT/REJECT with reasons for the run's rollout configuration; a per-layer plan that passes when rejected.
    warmup: the setup's student has had that many BF16 steps (warm_weights); the thresholds should have been
    calibrated on probes taken so, else a reason says so. escalate: an initial student far from its teacher that is not
    admitted returns at once with "far_student" (no proposal): the caller decides on a warmed student instead."""
    start = time.perf_counter()
    cls = estimator_class(setup.cfg.loss)
    numbers = probe(setup, plan)
    decision = decide_numbers(numbers, thresholds, cls, staleness(setup.cfg), limit, setup.cfg.optim.lr)
    out = {**decision.to_dict(), "plan": str(plan), "estimator_class": cls, "staleness": staleness(setup.cfg),
           "probe": numbers, "probe_rollouts": len(setup.prompts), "probe_new_tokens": setup.cfg.new_tokens,
           "warmup_steps": warmup}
    if not warmup and not decision.admit and numbers.get("rkl", 0.0) > FAR_STUDENT_RKL:
        if cls not in ESCALATE_CLASSES:
            out["reasons"].append(f"the student is far from its teacher (probe reverse KL {numbers['rkl']:.2f} "
                                  f"nats/token), but for the '{cls}' estimators a probe after the first steps admitted "
                                  "runs that degraded on the smollm2 pair and rescued none (docs/admission.md, "
                                  "\"Across models\"): the initial student's verdict stands")
        elif escalate:
            return out | {"far_student": True, "seconds": time.perf_counter() - start}
        else:
            out["reasons"].append(f"the student is far from its teacher (probe reverse KL {numbers['rkl']:.2f} "
                                  "nats/token): its first steps will move it, and a probe of the initial student "
                                  "overstated such full_rkl runs' mismatch 4-12x (docs/admission.md, \"Across "
                                  "models\"): probe with --warmup 4")
    calibrated_at = (thresholds or {}).get("probe_warmup", 0)
    if thresholds and calibrated_at != warmup:
        out["reasons"].append(f"the thresholds were calibrated on probes after {calibrated_at} BF16 steps, this probe "
                              f"came after {warmup}: its numbers sit on another scale (use thresholds calibrated "
                              f"with --warmup {warmup}, or probe with --warmup {calibrated_at})")
    among = class_limits(thresholds, cls)[0].get("models") if thresholds else None
    if (far := distance(numbers["floor_nsr"], thresholds, among)) is not None and not limit:
        out["calibration_distance"] = {k: v for k, v in far.items() if k != "line"}
        out["reasons"].append(far["line"])
    health = TeacherHealth.of(numbers)
    teacher = decide_teacher(health, thresholds, cls, limit) if health is not None else None
    if not decision.admit and propose and math.isfinite(decision.value):
        if far is not None and far["far"] and not limit:  # no plan can be admitted on a model the limits never saw
            out["proposal"] = {"plan": None, "layer_kl": [], "note": "no plan is admitted on a model this far from "
                               "the calibration's: calibrate on this model (opd sweep, then opd calibrate), or pass "
                               "--limit"}
        elif teacher is not None and not teacher.admit and decision.value <= decision.limit:
            out["proposal"] = {"plan": None, "layer_kl": [], "note": "the rollout plan passes; the teacher engine "
                               "does not: score the teacher at a higher precision (teacher.plan), or in the trainer "
                               "(teacher.engine=trainer)"}
        elif decision.value > decision.limit:
            floor = {"kl_k3": numbers["floor_kl_k3"], METRIC: numbers["floor_nsr"]}
            out["proposal"] = propose_plan(setup, plan, thresholds, cls, limit, floor)
        else:  # the plan passes; the staleness does not
            budget = drift_budget_for(class_limits(thresholds, cls)[0], numbers.get("floor_nsr"),
                                      thresholds.get("models"))[0] if thresholds else None
            lr = setup.cfg.optim.lr
            safe = f" to {safe_staleness(budget, lr)} at lr {lr:g}" if budget and lr else ""
            out["proposal"] = {"plan": None, "layer_kl": [], "note": f"the plan passes: lower async.max_staleness{safe}, "
                               "lower the lr, or use another estimator"}
    out["seconds"] = time.perf_counter() - start
    return out


def propose_plan(setup: ProbeSetup, plan: Plan, thresholds: dict, cls: str, limit: float, floor: dict) -> dict:
    """First the same plan with calibrated FP8 KV scales, if it has fixed ones; then keep the most sensitive layers
    at BF16, one more at a time, until the probe passes."""
    n = len(plan.layers)
    if (scaled := calibrated(plan)) is not None:
        decision = decide_numbers(probe(setup, scaled, floor), thresholds, cls, 0, limit)
        if decision.admit:
            return {"plan": str(scaled), "bf16_layers": [], "layer_kl": [], METRIC: decision.value,
                    "limit": decision.limit, "note": "calibrated KV scales instead of the fixed 1.0"}
    sensitivity = []
    for i in range(n):  # the candidate setting on layer i alone, BF16 elsewhere
        alone = Plan.parse(f"{plan.whole_model}; {KEEP}; {i}: {describe_layer(plan.layers[i])}", n)
        numbers = measure(setup, alone)
        sensitivity.append(numbers.get("kl_exact", numbers["kl_k3"]))  # exact where the engine allows: less noise
    order = sorted(range(n), key=lambda i: -sensitivity[i])
    for j in range(1, n + 1):
        kept = sorted(order[:j])
        candidate = Plan.parse(f"{plan}; {','.join(map(str, kept))}: {KEEP}", n)
        numbers = probe(setup, candidate, floor)
        decision = decide_numbers(numbers, thresholds, cls, 0, limit)
        if decision.admit:
            return {"plan": str(candidate), "bf16_layers": kept, "layer_kl": sensitivity,
                    METRIC: decision.value, "limit": decision.limit}
    return {"plan": None, "layer_kl": sensitivity, "note": "even all-BF16 rollouts exceed the limit"}
