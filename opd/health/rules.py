"""The admission check: is a rollout configuration safe for OPD? A cheap probe, calibrated thresholds, a decision.

**What is measured** (`probe`). The candidate engine (the training config's engine and precision plan) samples a small
batch of the run's own training prompts with the student; the trainer's full-precision forward recomputes the same
tokens and the teacher scores them. From these come the metrics of metrics.py (`kl_k3`, `kl_exact`, `prob_err`,
importance weights, `adv_sign_flip`). The same probe with BF16 rollouts (`forward=bf16 kv=bf16`) is the noise floor: the
mismatch that an ordinary BF16 engine already has, reported beside the candidate's.

**The decision statistic is the noise-to-signal ratio** `nsr = mean |q - mu| / mean |T - q|`: the rollout mismatch
next to the OPD learning signal it perturbs (the sampled-token advantage). The same KL hurts a student that is
already close to its teacher (small signal) more than one far from it. Held out one mismatch source at a time on the
stored studies (studies/admission.py, docs/admission-results.md), nsr decided better than kl_k3, kl_exact, abs_dlogp,
ESS, gradient-space ratios, per-kind (KV / weights) cuts and nsr divided by the student's distance to its teacher
(`rkl`, the probe's mean exact KL(q || T) per token, which the probe reports beside it; dev/LOG.md has the numbers).
The runtime guard compares the trainer's live `opd/nsr` and `is/ess_frac` (the same numbers on each training
batch: q vs mu, the numerics alone) with the class's band and the same ESS floor (below); the staleness drift it
reports beside them decides nothing (guard.py). Staleness cannot be probed before training: an optimizer step
on a probe batch from a fresh optimizer is a sign step of size lr on every weight, and overstated the real per-step
drift 20-100x (dev/LOG.md). It is judged by its drift budget `max_staleness x lr` (Adam moves every weight by about
lr a step, so that is about how far behind the policy of a stale rollout can be), against the largest budget the
calibration runs trained fine at with the estimator on the nearest calibration model by the BF16 floor's nsr
(`max_drift_by_model`: how far a policy moves per step at a given lr is the model's own; the smollm2 pair's
full_rkl degraded at staleness 1 x lr 3e-5 where the toys' trained fine at 8 x 1e-3).

**What is safe depends on the estimator**, so thresholds are kept per estimator class (`estimator_class`):
    full       full-distribution losses (full_rkl, topk_rkl, fkl, jsd): mu never enters the gradient; the mismatch
               only changes which prefixes are visited
    sampler    sampled_rkl with the sampler's log-prob as the student term and no correction: A = T - mu, so every
               bit of mismatch is added to the advantage
    learner    sampled_rkl with the student term recomputed at learner time
    corrected  sampled_rkl with TIS or MIS
**Thresholds are calibrated** from sweep results (`calibrate`): per class, the cut on each synchronous run's
nsr that best separates the runs that trained fine from the degraded ones (tolerance.py defines "degraded"),
over the runs the ESS floor does not already reject; where no run of a class degraded, the cut is the largest
mismatch seen to train fine, so the check never extrapolates past what was observed. Above the cut, up to `reject`
(between the largest nsr that trained fine and the next run above it, which degraded), runs of the class both
trained fine and degraded: the verdict there is **UNCERTAIN** (not admitted; run it only under the runtime guard,
which acts above `reject`). `max_drift` comes from the same best-cut rule applied to staleness x lr of the runs
whose only mismatch was staleness; a class without such runs is judged by its form (`UNCALIBRATED_STALENESS`).
A candidate whose nsr is within 2x of the BF16 floor always passes the mismatch test, on a model like the
calibration's: a probe whose BF16 floor nsr is more than FAR (3x) from that of every calibration model (`distance`)
is UNCERTAIN where it would be ADMIT (the toy pairs' limits admitted 8 degraded smollm2 runs from warm probes).
A probe whose effective sample size fraction (`ess_frac`, importance weights q/mu) is under 0.5 is rejected
whatever its nsr. For rollouts that broken, the teacher also rejects the sampled tokens, which inflates nsr's
denominator, so nsr understates them: an FP8 cache saturating outlier keys has a large kl_k3 and a collapsed ESS
but a modest nsr (docs/admission.md). The floor sits well below the ess_frac of every stored run that trained fine.
The verdict is the worst of the mismatch's, the staleness's and the ESS floor's. The result is a small JSON file
(`opd calibrate`) that states what it was calibrated on; the package ships one calibrated on the built-in pairs'
stored studies (thresholds.json, written by studies/admission.py), and users can pass their own or override the
limit.

**When it rejects**, `propose_plan` first tries the same plan with calibrated FP8 KV scales if it had fixed ones
(they keep all of the memory saving). Otherwise it measures the candidate setting on one layer at a time (the
sensitivity map) and keeps the most sensitive layers in BF16, one more at a time, until the probe is admitted: the
cheapest per-layer plan that passes, in layers kept at BF16. `decide` is a pure predicate; the runtime guard
(guard.py) applies it to the live training metrics every `guard.every` steps. The probe itself, which runs the
models, is probe.py; this module only decides and calibrates.
"""
import math
from dataclasses import dataclass, replace

from opd.io.errors import require
from opd.config.sections import LossConfig
from opd.health.metrics import RolloutHealth, TeacherHealth
from opd.numerics.plan import LayerPrecision, Plan
from opd.numerics.quant import FP8_DTYPES

FLOOR_PLAN = "forward=bf16 kv=bf16"  # a bf16 engine (vLLM dtype bfloat16), studies/fidelity.py
CLASSES = ("full", "sampler", "learner", "corrected")
METRIC = "nsr"  # the decision statistic: the probe's noise-to-signal ratio
KEEP = "kv=bf16 w=bf16 noise=0"  # what a layer kept "in BF16" by a proposed plan runs at
FLOOR_FACTOR = 2.0  # a candidate within this factor of the BF16 engine's own mismatch is at the floor: admitted
MIN_ESS_FRAC = 0.5  # below this effective sample size fraction the rollouts are not the student's: rejected
# A student whose probe reverse KL to its teacher is above this (nats/token) is far from it: its first steps move it,
# and the initial student's probe overstated such runs' mismatch 4-12x on the smollm2 pair (the toys: 0.1-0.55).
# When such a probe is not admitted, `opd admit` (--warmup auto, the default, with the shipped thresholds) decides on
# the student after AUTO_WARMUP BF16 steps instead, with the thresholds calibrated so; --warmup 0 keeps the initial
# student's verdict and adds a hint.
FAR_STUDENT_RKL = 1.0
AUTO_WARMUP = 4
# The estimator classes auto escalates. On the smollm2 pair (61 runs at lr 1e-4 and 3e-5), the warm probe turned 13
# rejected full_rkl runs that trained fine into ADMITs and 3 degraded ones; for the sampled estimators it turned 5
# degraded runs into ADMITs and rescued none (docs/admission-results.md, "Across models"): they keep the initial
# verdict.
ESCALATE_CLASSES = ("full",)


def estimator_class(loss: LossConfig) -> str:
    """The class the loss declares (sections.LOSS_FAMILIES): each class has limits of its own."""
    return loss.estimator_class


@dataclass
class Decision:
    verdict: str  # ADMIT, UNCERTAIN (inside the calibration's band: run it only under the guard) or REJECT
    reasons: list[str]
    limit: float  # the limit on nsr that applied (ADMIT at or below it)
    value: float  # the measured nsr (live: the window mean of opd/nsr)
    reject_at: float = math.inf  # the band's upper edge: REJECT above it

    @property
    def admit(self) -> bool:
        return self.verdict == "ADMIT"

    @property
    def reject(self) -> bool:
        return self.verdict == "REJECT"

    def to_dict(self) -> dict:
        return {"decision": self.verdict, "reasons": self.reasons, "limit": self.limit, "reject_at": self.reject_at,
                METRIC: self.value}


def class_limits(thresholds: dict, cls: str) -> tuple[dict, str]:
    """-> (the class's entry: max (the limit on nsr), reject (the band's upper edge), max_drift; how it was obtained,
    for the reasons)."""
    classes = thresholds["classes"]
    if cls in classes:
        entry = classes[cls]
        how = (f"calibrated knee of the '{cls}' estimators" if entry.get("knee") else
               f"largest mismatch seen to train fine with '{cls}' estimators; no degradation was observed")
        return entry, how
    strictest = min(classes, key=lambda c: classes[c]["max"])
    return {k: v for k, v in classes[strictest].items() if k in ("max", "knee")}, (
        f"no calibration for '{cls}' estimators: the strictest calibrated limit ('{strictest}') applies")


# Staleness no run of the class has measured: what the estimator's form implies (admission docstring).
UNCALIBRATED_STALENESS = {
    "full": ("UNCERTAIN", "mu never enters a full-distribution loss's gradient, but the prefixes a stale policy "
                          "visits do: full_rkl trained fine at staleness 8 on the toy pairs and degraded at staleness "
                          "1 on the smollm2 pair at lr 3e-5 (docs/admission.md)"),
    "corrected": ("UNCERTAIN", "the importance correction bounds what stale mu can do, but no staleness run of this "
                               "class was measured"),
    "sampler": ("REJECT", "a stale mu lags the learner in the direction of its own updates and enters the advantage "
                          "uncorrected"),
    "learner": ("REJECT", "stale rollouts are sampled from an older policy and nothing corrects for it"),
}
ORDER = {"ADMIT": 0, "UNCERTAIN": 1, "REJECT": 2}


def decide_numbers(numbers: dict, thresholds: dict | None, cls: str, staleness: int = 0, limit: float = 0.0,
                   lr: float = 0.0) -> Decision:
    """`decide` on a probe's numbers as they are stored (results lines, `opd admit --json`): the rollouts' health,
    the BF16 floor's and the teacher side's where measured."""
    return decide(RolloutHealth.of(numbers) or RolloutHealth(), thresholds, cls, staleness, limit, lr,
                  RolloutHealth.floor_of(numbers), TeacherHealth.of(numbers))


def decide(health: RolloutHealth, thresholds: dict | None, cls: str, staleness: int = 0, limit: float = 0.0,
           lr: float = 0.0, floor: RolloutHealth | None = None, teacher: TeacherHealth | None = None) -> Decision:
    """The admission predicate on the rollouts' health (metrics.RolloutHealth: the probe's, or the guard's window
    mean); floor: the BF16 engine's on the same prompts, when measured; teacher: a served teacher's health (judged
    by decide_teacher, its verdict joins). staleness: the run's max_staleness (0 when sync) and lr its learning rate
    (staleness x lr is the drift budget the calibration judges); limit > 0 overrides the calibrated limit and removes
    the band (thresholds may then be None). A candidate within FLOOR_FACTOR of the BF16 floor passes the mismatch
    test whatever the limit: the reference cannot be degraded relative to itself. The verdict is the worst of the
    numerics' (ADMIT up to the limit, UNCERTAIN in the band up to `reject`, REJECT above), the staleness's, the ESS
    floor's and the teacher's; `admit` is True only for ADMIT."""
    require(thresholds is not None or limit > 0, "no admission thresholds and no limit", "pass one of them")
    entry, how = class_limits(thresholds, cls) if thresholds else ({}, "")
    limit, reject_at, how = band(entry, how, limit)
    value = health.nsr
    if not math.isfinite(value):
        return Decision("REJECT", ["the rollouts' log-probs are not finite (NaN/Inf): the engine is broken, not "
                                   "merely mismatched"], limit, value, reject_at)
    floor_nsr = None if floor is None else floor.nsr
    at_floor = floor_nsr is not None and value <= FLOOR_FACTOR * floor_nsr
    verdicts = ["ADMIT" if at_floor else in_band(value, limit, reject_at)]
    reasons = [f"noise-to-signal {METRIC} {value:.3g} {'<=' if value <= limit else '>'} limit {limit:.3g} ({how})"]
    if at_floor and value > limit:
        reasons.append(f"but within {FLOOR_FACTOR:g}x of the BF16 engine's own {floor_nsr:.3g}: BF16 rollouts are "
                       "the reference, not a risk")
    elif verdicts[0] == "UNCERTAIN":
        reasons.append(f"uncertain: {METRIC} <= {reject_at:.3g}, where runs of these estimators both trained fine and "
                       "degraded; run it only under the runtime guard (guard.every > 0, guard.action=fallback)")
    elif verdicts[0] == "REJECT" and reject_at > limit:
        reasons.append(f"{METRIC} > {reject_at:.3g}, above every run of these estimators that trained fine")
    far = (distance(floor_nsr, thresholds, entry.get("models")) if floor_nsr is not None and how != "user-set limit"
           else None)
    if far is not None and far["far"] and verdicts[0] == "ADMIT":
        verdicts[0] = "UNCERTAIN"
        reasons.append(f"uncertain: this model's BF16 floor nsr is {far['factor']:.2g}x that of the nearest model "
                       f"these estimators' limits were calibrated on ({far['nearest']}), more than {FAR:g}x: they were "
                       "not measured on a model like it (calibrate on this model: opd sweep, then opd calibrate; or train "
                       "under the runtime guard)")
    if staleness:
        verdicts.append(_staleness_verdict(entry, cls, staleness, lr, reasons, floor_nsr,
                                           (thresholds or {}).get("models")))
    if floor is not None and health.kl_k3 is not None and floor.kl_k3 is not None:
        reasons.append(f"kl_k3 {health.kl_k3:.3g} vs the BF16 engine's {floor.kl_k3:.3g}; nsr "
                       f"{value / max(floor_nsr, 1e-12):.2g}x the BF16 engine's")
    ess = health.ess_frac
    if ess is not None and ess < MIN_ESS_FRAC:
        verdicts.append("REJECT")
        reasons.append(f"ess_frac {ess:.3f} < {MIN_ESS_FRAC}: the rollouts are so far from the trainer's policy that "
                       "nsr understates it (broken rollouts also inflate its denominator)")
    if health.adv_sign_flip is not None:
        reasons.append(f"adv_sign_flip {health.adv_sign_flip:.4f}, ess_frac {1 if ess is None else ess:.3f}")
    clipped_k, clipped_v = health.kv_clipped_k or 0, health.kv_clipped_v or 0
    if clipped_k > 0 or clipped_v > 0:
        reasons.append(f"the KV cache saturated {clipped_k:.3%} of the keys and {clipped_v:.3%} of the values at its "
                       "format's largest value (a larger or calibrated scale, kv_scale=calibrate, avoids it)")
    if teacher is not None:
        verdict = decide_teacher(teacher, thresholds, cls, limit if how == "user-set limit" else 0.0)
        verdicts.append(verdict.verdict)
        reasons += verdict.reasons
    return Decision(max(verdicts, key=ORDER.__getitem__), reasons, limit, value, reject_at)


def band(entry: dict, how: str, limit: float = 0.0) -> tuple[float, float, str]:
    """(limit, reject_at, how): a class entry's admitted limit and the top of its UNCERTAIN band, or the user's limit
    (> 0: no band)."""
    if limit > 0:
        return limit, limit, "user-set limit"
    limit = float(entry["max"])
    return limit, max(limit, float(entry.get("reject") or limit)), how


def in_band(value: float, limit: float, reject_at: float) -> str:
    """ADMIT up to the limit, UNCERTAIN in the band up to reject_at, REJECT above."""
    return "ADMIT" if value <= limit else "UNCERTAIN" if value <= reject_at else "REJECT"


# A model whose BF16 floor is more than this factor from every calibration model's is outside what the thresholds saw.
FAR = 3.0


def distance(floor_nsr: float, thresholds: dict | None, among: list[str] | None = None) -> dict | None:
    """How far a probed model is from the models the thresholds were calibrated on, by the BF16 floor's nsr (the scale
    that differed most between the toy pairs and a real one): the nearest model, the factor between the floors (>= 1)
    and a line for the reasons. among: only these models (an estimator class's, `models` in its entry: a class's
    limits were measured on the models its runs trained). None when the thresholds do not say what they were
    calibrated on."""
    models = (thresholds or {}).get("models")
    if models and among and set(among) & set(models):
        models = {name: m for name, m in models.items() if name in among}
    if not models or not (floor_nsr > 0 and math.isfinite(floor_nsr)):
        return None
    factor = {name: max(floor_nsr, m["floor_nsr"]) / min(floor_nsr, m["floor_nsr"]) for name, m in models.items()}
    nearest = min(factor, key=factor.get)
    seen = ", ".join(f"{name} {m['floor_nsr']:.3g}" for name, m in models.items())
    line = (f"calibrated on {len(models)} model(s) (their BF16 floor nsr: {seen}); this model's floor {floor_nsr:.3g} "
            f"is {factor[nearest]:.2g}x the nearest ({nearest})")
    if factor[nearest] > FAR:
        line += (f": outside what the thresholds saw (more than {FAR:g}x): calibrate on this model (opd sweep, then "
                 "opd calibrate) or train under the runtime guard")
    return {"nearest": nearest, "factor": factor[nearest], "far": factor[nearest] > FAR, "line": line}


def decide_teacher(teacher: TeacherHealth, thresholds: dict | None, cls: str, limit: float = 0.0) -> Decision:
    """The teacher side's verdict: the teacher engine's noise-to-signal `teacher_nsr` (mean |T - T_e| / mean |T - q|,
    metrics.py) against the thresholds' teacher-side limit for the class (`teacher` in the file: calibrated on the
    teacher study, docs/teacher.md); a file without one judges it by the student side's limit, which the reasons say.
    limit > 0 (the user's) replaces both. A top-k teacher's tail mass is reported beside it."""
    value = teacher.nsr
    side = (thresholds or {}).get("teacher")
    entry, how = ({}, "") if limit > 0 else class_limits(side or thresholds, cls)
    if limit <= 0 and not side:
        how = f"no teacher-side calibration in these thresholds: the student side's limit ({how})"
    limit, reject_at, how = band(entry, how, limit)
    if not math.isfinite(value):
        return Decision("REJECT", ["the teacher engine's log-probs are not finite (NaN/Inf)"], limit, value, reject_at)
    verdict = in_band(value, limit, reject_at)
    reasons = [f"teacher engine: teacher_nsr {value:.3g} {'<=' if value <= limit else '>'} teacher-side limit "
               f"{limit:.3g} ({how.replace('calibrated knee', 'teacher-side calibrated knee')})"]
    if verdict == "UNCERTAIN":
        reasons.append(f"uncertain: teacher_nsr <= {reject_at:.3g}, where teacher-side runs of these estimators both "
                       "trained fine and degraded; run it only under the runtime guard (guard.every > 0)")
    elif verdict == "REJECT" and reject_at > limit:
        reasons.append(f"teacher_nsr > {reject_at:.3g}, above every teacher-side run of these estimators that trained "
                       "fine")
    details = [f"{name} {getattr(teacher, field):.3g}" for name, field in (
        ("teacher_kl_k3", "kl_k3"), ("teacher_kl_exact", "kl_exact"), ("teacher_adv_sign_flip", "adv_sign_flip"),
        ("top-k tail mass", "tail_mass")) if getattr(teacher, field) is not None]
    if details:
        reasons.append("teacher engine: " + ", ".join(details))
    return Decision(verdict, reasons, limit, value, reject_at)


def safe_staleness(budget: float, lr: float) -> int:
    """The largest max_staleness a drift budget allows at a learning rate (capped: a budget may be huge)."""
    return int(min(budget / lr * (1 + 1e-9), 2 ** 31))


def drift_budget_for(entry: dict, floor_nsr: float | None, models: dict | None) -> tuple[float | None, str, bool]:
    """The class's drift budget for the probed model -> (budget, where it was measured, far). How far a policy moves
    in a step at a given lr is the model's own (the smollm2 pair's per-step stale KL at lr 3e-5 was ~0.25 nats/token,
    the toy pairs' 0.01-0.03 at lr 1e-3: docs/admission.md), so a budget holds for the model it was calibrated on:
    with per-model budgets (`max_drift_by_model`) and the probe's BF16 floor, the budget of the nearest model by the
    floor (admission.distance's scale), or far=True when even it is more than FAR away. Without them (an older file,
    or no floor measured), the budget over every model."""
    by_model = entry.get("max_drift_by_model") or {}
    known = {name: m for name, m in (models or {}).items() if name in by_model}
    near = distance(floor_nsr, {"models": known}) if floor_nsr is not None else None
    if near is None:
        return entry.get("max_drift"), "", False
    nearest = near["nearest"]
    where = f"{nearest}, whose BF16 floor nsr {known[nearest]['floor_nsr']:.3g} is {near['factor']:.2g}x this model's"
    return by_model[nearest], where, near["far"]


def _staleness_verdict(entry: dict, cls: str, staleness: int, lr: float, reasons: list[str],
                       floor_nsr: float | None = None, models: dict | None = None) -> str:
    """Staleness is judged by its drift budget, staleness x lr: under Adam every step moves each weight by about lr,
    so the policy a stale rollout lags behind is about that far away (dev/LOG.md: measured stale KL grows with both),
    for a given model: the budget is the nearest calibration model's (drift_budget_for); on a model far from every
    one of them the staleness is UNCERTAIN (REJECT where the estimator's form rejects uncalibrated staleness). Old
    thresholds files without a drift budget judge the staleness count."""
    drift = staleness * lr
    budget, where, far = drift_budget_for(entry, floor_nsr, models)
    if far and lr > 0:
        verdict = max("UNCERTAIN", UNCALIBRATED_STALENESS[cls][0], key=ORDER.__getitem__)
        reasons.append(f"max_staleness {staleness} x lr {lr:.3g} = drift {drift:.3g}: the drift budgets were measured "
                       f"on other models (the nearest, {where}: more than {FAR:g}x), and how far a policy moves per "
                       f"step at a given lr differs across models: {verdict} (calibrate staleness on this model, or "
                       "train under the runtime guard)")
        return verdict
    if budget is not None and lr > 0:  # (without a learning rate the drift is unknown: the prior below)
        ok = drift <= budget * (1 + 1e-9)
        on = f" on {where}" if where else ""
        reasons.append(f"max_staleness {staleness} x lr {lr:.3g} = drift {drift:.3g} {'<=' if ok else '>'} "
                       f"{budget:.3g}, the largest the calibration runs trained fine at with these estimators{on} "
                       f"(staleness <= {safe_staleness(budget, lr)} at this lr)")
        return "ADMIT" if ok else "REJECT"
    safe = entry.get("max_staleness")
    if safe is not None and "max_drift" not in entry:  # a thresholds file from before the drift budget
        ok = staleness <= safe
        reasons.append(f"max_staleness {staleness} {'<=' if ok else '>'} {safe}, the largest the sweep saw train fine "
                       "with these estimators")
        return "ADMIT" if ok else "REJECT"
    verdict, why = UNCALIBRATED_STALENESS[cls]
    reasons.append(f"max_staleness {staleness}: no staleness run of these estimators was calibrated; {why}: "
                   f"{verdict} (the runtime guard measures it live)")
    return verdict


# ---- staleness and the guard's fallback -----------------------------------------------------------------------

def staleness(cfg) -> int:
    return cfg.async_.max_staleness if cfg.schedule == "async" else 0


def calibrated(plan: Plan) -> Plan | None:
    """The plan with its fixed-scale FP8 KV layers calibrated instead (None if it has none). A fixed scale of 1.0
    (vLLM's default) saturates keys beyond the format's range (448 for e4m3); calibrated scales keep all of the KV
    memory saving (docs/tolerance.md, outlier keys)."""
    def fix(layer: LayerPrecision) -> LayerPrecision:
        fixed_fp8 = layer.kv.dtype in FP8_DTYPES and layer.kv.scale_mode == "fixed"
        return replace(layer, kv=replace(layer.kv, scale_mode="calibrate")) if fixed_fp8 else layer
    layers = tuple(map(fix, plan.layers))
    return replace(plan, layers=layers) if layers != plan.layers else None
