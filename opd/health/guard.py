"""The runtime guard: the admission check's decision (admission.decide) on the live rollouts, every `guard.every`
steps, and the fallback ladder it climbs down when the rollouts' mismatch is too large.

It judges the numerics' noise-to-signal ratio `opd/nsr` (mean |q - mu| / mean |T - q|: the rollout engine vs the
trainer's forward with the weights that sampled, the probe's metric, on which the limit was calibrated) against the
estimator's limit, and the numerics' effective sample size fraction `is/ess_frac` (weights q/mu) against
MIN_ESS_FRAC, each averaged over the steps since the last check. Staleness is not judged here: the admission check's
max_staleness does that, and no plan fallback can fix it. `stale/total_nsr` (pi in place of q: numerics and
staleness together) is reported beside it (`guard/total_nsr`) but decides nothing: healthy async runs at lr 1e-3
reach high values over short windows (dev/LOG.md). Not the ESS of pi/mu either: one token whose probability an
update moved a lot collapses it. A non-finite nsr (broken rollouts) is a REJECT; so is a window without any (async
with async.recompute_fraction 0 has no q, which is why the config refuses the guard there).

On REJECT (nsr above the calibration band's upper edge, or the ESS under its floor) the event goes to guard.jsonl
and stderr, and `guard.action` is taken: warn, stop, or fall back. The ladder (`safer_plan`): a plan with
fixed-scale FP8 KV layers first gets calibrated scales (which keep the memory saving and fix saturated outlier
keys), anything else BF16 rollouts; a plan already at BF16 only warns. Inside the band (UNCERTAIN, the runs the
admission check sends to the guard) the window is logged as `guard/uncertain` and training goes on.
"""
import json
import math
import sys
from pathlib import Path

from opd.health.rules import FLOOR_PLAN, MIN_ESS_FRAC, calibrated, decide, decide_teacher
from opd.engines.kinds import kind
from opd.io.errors import OpdError
from opd.health.metrics import RolloutHealth, TeacherHealth
from opd.numerics.plan import Plan
from opd.config.runlog import read_guard_events, read_metrics, write_atomic
from opd.health.thresholds import load_thresholds

GUARD_TOTAL = "stale/total_nsr"  # reported beside the decision, never judged (module docstring)


def safer_plan(plan: Plan, engine: str = "builtin", calibrate: bool = True) -> Plan | None:
    """The guard's next rung down from plan: its fixed-scale FP8 KV layers calibrated (they keep all of the memory
    saving, and fix saturated outlier keys: docs/tolerance.md, "Outlier keys"; only an engine kind that calibrates
    scales, engines.Kind, and not with calibrate=False: a sharded learner's ranks would each calibrate on their own
    sub-batch), else BF16 rollouts; None when already at BF16."""
    floor = Plan.parse(FLOOR_PLAN, len(plan.layers))
    scaled = calibrated(plan) if calibrate and kind(engine).calibrates_scales else None
    return None if plan == floor else scaled or floor


def window_entry(metrics: dict) -> dict:
    """What the guard keeps of a step: its rollouts' and its teacher side's health (metrics.RolloutHealth and
    TeacherHealth: every field the admission check judges, None where the step has none) and stale/total_nsr."""
    total = metrics.get(GUARD_TOTAL)
    return {"rollouts": RolloutHealth.of(metrics), "teacher": TeacherHealth.of(metrics),
            "total_nsr": total if total is not None and math.isfinite(total) else None}


def log_event(run_dir: Path, event: dict, line: str) -> None:
    """A guard event: one guard.jsonl line, and `line` on stderr."""
    with open(run_dir / "guard.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")
    print(f"opd: guard: {line}", file=sys.stderr)


class Guard:
    """The guard of one run (settings.every > 0; with 0, `observe` is never due)."""

    def __init__(self, settings, cls: str, engine: str, asynchronous: bool, calibrate: bool = True):
        """settings: the run's guard section (sections.GuardConfig); cls: its estimator class
        (admission.estimator_class); engine: its rollout engine's kind (the fallback ladder depends on it);
        calibrate: the ladder may calibrate KV scales (safer_plan)."""
        self.every, self.action, self.limit = settings.every, settings.action, settings.limit
        self.engine, self.asynchronous, self.cls, self.calibrate = engine, asynchronous, cls, calibrate
        self.thresholds = load_thresholds(settings.thresholds) if settings.every and not settings.limit else None
        self.window: list[dict] = []

    def observe(self, step: int, metrics: dict) -> bool:
        """Add a step's live numbers to the window; whether a check is due after this step."""
        if not self.every:
            return False
        self.window.append(window_entry(metrics))
        return (step + 1) % self.every == 0

    def check(self, step: int, plan: Plan, run_dir: Path) -> tuple[dict, Plan | None]:
        """The check over the window (then emptied) -> (the guard/* metrics, the plan to fall back to or None).
        Raises OpdError when the action is `stop`."""
        # field by field over the window; a NaN nsr (broken rollouts) stays NaN, a REJECT; none at all is one too
        health = RolloutHealth.mean([e["rollouts"] for e in self.window if e["rollouts"]]) or RolloutHealth()
        teacher = TeacherHealth.mean([e["teacher"] for e in self.window if e["teacher"]])
        totals = [e["total_nsr"] for e in self.window if e["total_nsr"] is not None]
        total = sum(totals) / len(totals) if totals else None
        self.window.clear()
        teacher_out = {} if teacher is None else self._check_teacher(step, teacher, run_dir)
        nsr, ess = health.nsr, health.ess_frac
        decision = decide(health, self.thresholds, self.cls, 0, self.limit)
        out = {"guard/nsr": nsr, "guard/limit": decision.limit, "guard/triggered": float(decision.reject),
               "guard/uncertain": float(decision.verdict == "UNCERTAIN")}
        if ess is not None:
            out["guard/ess_frac"] = ess
        if total is not None and self.asynchronous:
            out["guard/total_nsr"] = total
        out |= teacher_out
        if not decision.reject:
            return out, None
        safer = safer_plan(plan, self.engine, self.calibrate)
        action = "warn" if self.action == "fallback" and safer is None else self.action
        event = {"step": step, "action": action, "nsr": nsr, "ess_frac": ess, "limit": decision.limit,
                 "reject_at": decision.reject_at, "plan": str(plan), "reasons": decision.reasons}
        if action == "fallback":
            event["to"] = str(safer)
        what = f"nsr {nsr:.3g} {'>' if nsr > decision.reject_at else '<='} {decision.reject_at:.3g}" + (
            "" if ess is None else f", ess_frac {ess:.3g} {'<' if ess < MIN_ESS_FRAC else '>='} {MIN_ESS_FRAC}")
        log_event(run_dir, event, f"step {step}: rollout-vs-learner {what} (plan {plan}): {action}"
                  + (f" to {event['to']}" if "to" in event else ""))
        if action == "stop":
            raise OpdError(f"guard: the rollouts' mismatch exceeded what the admission check allows at step {step} "
                           f"({what})", "use a safer plan (`opd admit` proposes one), guard.action=fallback, or a "
                           "higher guard.limit")
        return out, safer if action == "fallback" else None

    def _check_teacher(self, step: int, teacher: TeacherHealth, run_dir: Path) -> dict:
        """The teacher side's check over the window: guard/teacher_* metrics; on REJECT an event, then warn or stop."""
        decision = decide_teacher(teacher, self.thresholds, self.cls, self.limit)
        nsr = teacher.nsr
        out = {"guard/teacher_nsr": nsr, "guard/teacher_limit": decision.limit,
               "guard/teacher_triggered": float(decision.reject)}
        if not decision.reject:
            return out
        action = "stop" if self.action == "stop" else "warn"
        what = f"teacher_nsr {nsr:.3g} {'>' if nsr > decision.reject_at else '<='} {decision.reject_at:.3g}"
        log_event(run_dir, {"step": step, "side": "teacher", "action": action, "teacher_nsr": nsr,
                            "limit": decision.limit, "reject_at": decision.reject_at, "reasons": decision.reasons},
                  f"step {step}: teacher engine vs the trainer's teacher {what}: {action}")
        if action == "stop":
            raise OpdError(f"guard: the teacher engine's mismatch exceeded what the admission check allows at step "
                           f"{step} ({what})", "score the teacher at a higher precision (teacher.plan), with the "
                           "trainer (teacher.engine=trainer), or raise guard.limit")
        return out

    def resume(self, run_dir: Path, step: int) -> None:
        """On resume: the live numbers of the steps since the last check (from metrics.jsonl), so the checks see what
        they would have seen; and guard events of the steps to be re-run are dropped (they are logged again)."""
        path = run_dir / "guard.jsonl"
        if path.is_file():
            kept = [event for event in read_guard_events(run_dir) if event["step"] < step]
            write_atomic(path, "".join(json.dumps(event) + "\n" for event in kept))
        if not self.every:
            self.window = []
            return
        first = step - step % self.every
        self.window = [window_entry({key: math.nan if value is None else value for key, value in row.items()})
                       for row in read_metrics(run_dir) if first <= row["step"] < step]  # null: logged non-finite
