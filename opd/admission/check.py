"""The admission check `opd admit` runs (opd.admit), from a config to a verdict: which thresholds apply, the probe
of the initial student (or of the student after a few BF16 steps: `--warmup`), the decision with its reasons, and
when it does not admit, a plan that would be (`propose_plan`: the same plan with calibrated FP8 KV scales if it had
fixed ones, else the most sensitive layers kept at BF16, one more at a time, until the probe is admitted).
probe.py measures, admission.py decides on numbers, thresholds.py reads the calibration; this module runs them in
order, and stands above the trainer (a warm-up is a short training run).
"""
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from opd.health.rules import (AUTO_WARMUP, ESCALATE_CLASSES, FAR_STUDENT_RKL, FLOOR_PLAN, KEEP, METRIC, calibrated,
                           class_limits, decide_numbers, decide_teacher, distance, drift_budget_for, estimator_class,
                           safe_staleness, staleness)
from opd.models.checkpoint import load_checkpoint
from opd.config.run import GuardConfig, TrainConfig
from opd.config.sections import CanaryConfig
from opd.models.devices import restored_threads
from opd.engines.kinds import require_installed
from opd.engines.vllm import vllm_settings
from opd.io.errors import OpdError
from opd.health.metrics import TeacherHealth
from opd.numerics.plan import Plan, describe_layer
from opd.admission import bias
from opd.health import drift
from opd.admission.probe import measure, probe
from opd.training.setup import ProbeSetup, probe_setup
from opd.health.thresholds import load_thresholds, warm_thresholds
from opd.training.trainer import Interrupted, train


def check(cfg: TrainConfig, rollouts: int = 16, thresholds: str | Path = "", limit: float = 0.0,
          propose: bool = True, warmup: int | str = "auto") -> dict:
    """opd.admit's check on a checked config (opd.admit says what each argument means)."""
    escalate = warmup == "auto" and not thresholds and warm_thresholds(AUTO_WARMUP).is_file()
    if warmup == "auto":
        warmup = load_thresholds(thresholds).get("probe_warmup", 0) if thresholds else 0
    if warmup and not thresholds and warm_thresholds(warmup).is_file():
        thresholds = warm_thresholds(warmup)
    limits = load_thresholds(thresholds)
    require_installed(cfg.engine.name)
    with restored_threads():  # the probe sets the run's thread count; the caller's comes back
        result = probe_at(cfg, rollouts, warmup,
                          lambda setup, plan: decide_plan(setup, plan, limits, limit, propose, warmup, escalate))
        if not result.get("far_student"):
            return result
        # the initial student is far from its teacher and not admitted: decide on it after AUTO_WARMUP BF16 steps
        warm = probe_at(cfg, rollouts, AUTO_WARMUP, lambda setup, plan: decide_plan(
            setup, plan, load_thresholds(warm_thresholds(AUTO_WARMUP)), limit, propose, AUTO_WARMUP))
    initial = {key: result[key] for key in ("decision", "nsr", "limit", "reasons", "seconds")}
    warm["reasons"].insert(0, f"the initial student's probe said {result['decision']} (nsr {result['nsr']:.3g}), but "
                              f"its student is far from its teacher (probe reverse KL {result['probe']['rkl']:.2f} > "
                              f"{FAR_STUDENT_RKL:g} nats/token), where such probes overstated runs' mismatch 4-12x "
                              "(docs/admission-results.md, \"Across models\"): decided on the student after "
                              f"{AUTO_WARMUP} BF16 steps of the run's recipe (--warmup 0 keeps the initial "
                              "student's verdict)")
    return warm | {"initial_probe": initial | {"rkl": result["probe"]["rkl"]},
                   "seconds": result["seconds"] + warm["seconds"]}


def probe_at(cfg, rollouts: int, warmup: int, decide) -> dict:
    """decide(setup, plan) on cfg's probe set-up, its student after `warmup` BF16 steps; "warmup_seconds" added. The
    warm-up trains before the set-up loads, so that the pair is never in memory twice."""
    start = time.perf_counter()
    weights = warm_weights(cfg, warmup) if warmup else None
    warmup_seconds = time.perf_counter() - start
    setup, plan = probe_setup(cfg, rollouts)
    try:
        if weights is not None:
            setup.student.load_state_dict(weights)
        return decide(setup, plan) | {"warmup_seconds": warmup_seconds}
    finally:
        setup.teacher.close()


def warm_weights(cfg, steps: int) -> dict:
    """The student's weights after `steps` OPD steps of cfg's own recipe with BF16 rollouts (the floor plan,
    synchronous, no guard, no canary), trained in a temporary folder: the student a run has become once a large first move
    (a pruned or far-off student closing most of its gap in a few steps) is behind it. `opd admit --warmup`. The
    run's checkpoint, optimizer state included, passes through the system's temporary folder."""
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder) / "warmup"
        try:
            train(replace(cfg, steps=steps, plan=FLOOR_PLAN, schedule="sync", save_every=0, guard=GuardConfig(),
                          canary=CanaryConfig(), eval=replace(cfg.eval, examples=1)), run_dir, progress=False)
        except Interrupted as e:  # nothing to resume: the folder goes with this function
            raise Interrupted(e.signum, at_boundary=False) from None
        return load_checkpoint(run_dir / "checkpoint", torch.float32)[0].state_dict()


def decide_plan(setup: ProbeSetup, plan: Plan, thresholds: dict, limit: float = 0.0, propose: bool = True,
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
                                  "runs that degraded on the smollm2 pair and rescued none (docs/admission-results.md, "
                                  "\"Across models\"): the initial student's verdict stands")
        elif escalate:
            return out | {"far_student": True, "seconds": time.perf_counter() - start}
        else:
            out["reasons"].append(f"the student is far from its teacher (probe reverse KL {numbers['rkl']:.2f} "
                                  "nats/token): its first steps will move it, and a probe of the initial student "
                                  "overstated such full_rkl runs' mismatch 4-12x (docs/admission-results.md, \"Across "
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
    if out["decision"] == "UNCERTAIN" and far is not None and far["far"] and not limit:
        steps = setup.cfg.steps
        out["reasons"].append("to decide from this model and recipe instead (its learning rate and horizon, which no "
                              "probe of the rollouts sees): opd admit --trial 4, 4 steps each of the candidate, its "
                              f"BF16 twin and 2 more BF16 seeds (16 steps, {16 / max(1, steps):.1%} of this run's "
                              f"{steps}; its measured standing: docs/admission-results.md, \"The paired trial\")")
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
                    "limit": decision.limit, "note": "calibrated KV scales instead of the fixed 1.0"} | \
                in_vllm_terms(scaled)
    sensitivity = layer_sensitivity(setup, plan)
    order = sorted(range(n), key=lambda i: -sensitivity[i])
    for j in range(1, n + 1):
        kept = sorted(order[:j])
        candidate = Plan.parse(f"{plan}; {','.join(map(str, kept))}: {KEEP}", n)
        numbers = probe(setup, candidate, floor)
        decision = decide_numbers(numbers, thresholds, cls, 0, limit)
        if decision.admit:
            return {"plan": str(candidate), "bf16_layers": kept, "layer_kl": sensitivity,
                    METRIC: decision.value, "limit": decision.limit} | in_vllm_terms(candidate)
    return {"plan": None, "layer_kl": sensitivity, "note": "even all-BF16 rollouts exceed the limit"}


def layer_sensitivity(setup: ProbeSetup, plan: Plan) -> list[float]:
    """Per layer, the probe's KL with the candidate setting on that layer alone, BF16 elsewhere (the exact KL where
    the engine allows: less noise): what orders the layers a proposal keeps in BF16."""
    n, out = len(plan.layers), []
    for i in range(n):
        numbers = measure(setup, Plan.parse(f"{plan.whole_model}; {KEEP}; {i}: {describe_layer(plan.layers[i])}", n))
        out.append(numbers.get("kl_exact", numbers["kl_k3"]))
    return out


def in_vllm_terms(plan: Plan) -> dict:
    """The plan as `vllm serve` flags ({"vllm_flags": ...}), or why vLLM cannot run it ({"vllm_refused": ...})."""
    try:
        return {"vllm_flags": vllm_settings(plan).flags()}
    except OpdError as e:
        return {"vllm_refused": str(e)}


def check_self(cfg: TrainConfig, batches: int = 8, cut: float | None = None, propose: bool = True,
               spill: str | Path | None = None) -> dict:
    """`opd admit --self`: decide from the user's own model and recipe (bias.py). The candidate (the config's plan
    and staleness) against BF16 synchronous rollouts of the same config, with common random numbers, on `batches`
    batches of the run's own prompts: its gradient bias in units of the recipe's own BF16 batch noise, carried over
    the run's steps (z), against drift.CUT, with the measurement's standard error (UNCERTAIN where it straddles
    the cut, with the batches that would decide). propose: on REJECT, search for what passes (`propose_passing`).
    spill: a folder for the statistic's sums as files (a student whose sums do not fit in memory)."""
    start = time.perf_counter()
    require_installed(cfg.engine.name)
    cut = drift.CUT if cut is None else cut
    stale = staleness(cfg)
    floor = replace(cfg, plan=FLOOR_PLAN, schedule="sync", guard=GuardConfig())
    with restored_threads():
        numbers = bias.measure(floor, replace(cfg, guard=GuardConfig()), stale, batches, spill=spill)
    out = drift.decide(numbers, cut)
    z, se, T = out["z"], out["z_se"], out["steps"]
    what = f"plan {cfg.plan or 'fp32'}" + (f" at staleness {stale}" if stale else "")
    reasons = [f"{what}: its rollouts bias the OPD gradient by {numbers['adam_bias']:.3g} (Adam's units, the "
               f"coupling noise taken out) against a BF16 batch-to-batch noise of {numbers['adam_noise']:.3g}, on "
               f"{batches} batches of this run's prompts (common random numbers)",
               f"over the run's {T} steps that bias drifts z = {z:.2f} +- {se:.2f} times the spread two BF16 seeds "
               f"of this recipe reach; the cut is {cut:g} (studies/gradient_bias.py, docs/admission-results.md)"]
    if "r" in numbers:  # the progress share (drift.py): reported beside z, not yet deciding (docs/admission-results.md)
        reasons.append(f"along the BF16 descent its rollouts change a step's progress by {-numbers['r']:+.1%} +- "
                       f"{numbers['r_se']:.1%} (the progress share r = {numbers['r']:.3g}; on the built-in pairs' "
                       f"full_rkl studies the degraded configurations lost 35% or more, the fine ones at most 23%)")
    if out["decision"] == "UNCERTAIN":
        more = out.get("batches_to_decide")
        reasons.append("the measurement straddles the cut" + (f": about {more} batches (--batches) would decide"
                                                               if more else ""))
    chance = drift.chance_other_side(z, se, cut)
    record = drift.RECORD if cut == drift.CUT else {}
    reasons.append(f"error rate: this measurement's noise puts z on the wrong side of the cut with chance "
                   f"{chance:.0%}" + (drift.record_text(record) if record else
                                      " (the rule's record is for the shipped cut only)"))
    out |= {"mode": "self", "error_rate": {"measurement": chance, "record": record}, "plan": str(cfg.plan),
            "estimator_class": estimator_class(cfg.loss), "staleness": stale, "numbers": numbers, "reasons": reasons,
            "cost_steps": 2 * batches + stale}
    if out["decision"] == "REJECT" and propose:
        out["proposal"] = propose_passing(cfg, stale,
                                          lambda cand, k: drift.decide(bias.measure(floor, cand, k, batches,
                                                                                spill=spill), cut))
    return out | {"seconds": time.perf_counter() - start}


def propose_passing(cfg: TrainConfig, stale: int, judge, tries: int = 3,
                    what: str = "opd admit --self") -> dict:
    """What passes the measurement where the candidate did not, at most `tries` more measurements: a stale candidate
    first at lower staleness (half of it, then 0); a plan, the same plan with its most sensitive layers kept in BF16
    (the probe's per-layer KL of the candidate setting on one layer alone orders them), one, two, then four of them.
    judge(candidate config, staleness) -> {"z", "decision"}: the measurement (`--self`'s gradient bias, `--trial`'s
    paired trial). Returns {"plan" or "max_staleness", "z", "note", "tried"} or, when none passed, {"plan": None,
    "note", "tried"}."""
    tried = []
    with restored_threads():
        if stale:
            for k in sorted({stale // 2, 0}, reverse=True)[:tries]:
                cand = replace(cfg, guard=GuardConfig(), async_=replace(cfg.async_, max_staleness=k, prefetch=-1),
                               schedule="async" if k else "sync")
                d = judge(cand, k)
                tried.append({"max_staleness": k, "z": d["z"], "decision": d["decision"]} | _gate(d))
                if d["decision"] == "ADMIT":
                    return {"plan": None, "max_staleness": k, "z": d["z"], "tried": tried,
                            "note": f"the same plan at async.max_staleness {k}" + (" (synchronous)" if not k else "")}
            return {"plan": None, "tried": tried, "note": "not even synchronous rollouts of this plan pass: a safer "
                    f"plan first ({what} on the synchronous config proposes one)"}
        setup, plan = probe_setup(cfg, 16)
        try:
            sensitivity = layer_sensitivity(setup, plan)
        finally:
            setup.teacher.close()
            del setup  # the pair leaves memory before the measurements load it again
        n = len(plan.layers)
        order = sorted(range(n), key=lambda i: -sensitivity[i])
        for j in sorted({1, 2, 4} & set(range(1, n)))[:tries]:
            kept = sorted(order[:j])
            candidate = Plan.parse(f"{plan}; {','.join(map(str, kept))}: {KEEP}", n)
            d = judge(replace(cfg, plan=str(candidate), guard=GuardConfig()), 0)
            tried.append({"plan": str(candidate), "bf16_layers": kept, "z": d["z"], "decision": d["decision"]}
                         | _gate(d))
            if d["decision"] == "ADMIT":
                return {"plan": str(candidate), "bf16_layers": kept, "z": d["z"], "layer_kl": sensitivity,
                        "tried": tried, "note": f"its {j} most sensitive layer(s) kept in BF16"} | \
                    in_vllm_terms(candidate)
    return {"plan": None, "layer_kl": sensitivity, "tried": tried,
            "note": f"none of {len(tried)} plans with the most sensitive layers in BF16 passed: BF16 rollouts"}


def _gate(judged: dict) -> dict:
    """A try's mismatch gate (the paired trial's: trial.mismatch), where its measurement has one."""
    gate = judged.get("mismatch")
    return {"nsr_ratio": gate["nsr_ratio"], "nsr_reject": gate["reject"]} if gate else {}
