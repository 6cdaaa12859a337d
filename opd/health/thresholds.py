"""The admission check's thresholds: the file (`opd calibrate` writes it, opd/thresholds.json ships one; checked
against its schema on load, each error naming the class and key) and the calibration that makes one from sweep
results labelled fine or degraded (tolerance.label): per estimator class the best cut on the probe's nsr, the band
above it, and the drift budget of the staleness runs; the teacher side's entry from the teacher study's rows.
admission.py decides with what is loaded here.
"""
import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError

from opd.health.rules import CLASSES, FLOOR_FACTOR, METRIC, MIN_ESS_FRAC
from opd.io.errors import OpdError, require
from opd.io.schema import Schema, parse_json, problem, read_text

DEFAULT_THRESHOLDS = Path(__file__).parents[1] / "thresholds.json"  # opd/thresholds.json, package data
# A cut's errors: an admitted run that degraded costs a whole training run, a rejected one that would have trained
# fine the speed-up, a fraction of it: the first is weighted 2x (the trade-off this buys: docs/admission.md).
ADMITTED_DEGRADED_COST = 2.0


NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class ClassThresholds(Schema):
    """One estimator class's entry of a thresholds file (calibrate writes it; decide reads it)."""
    max: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    reject: NonNegative | None = None
    max_drift: NonNegative | None = None
    max_drift_by_model: dict[str, NonNegative | None] | None = None
    max_staleness: NonNegative | None = None
    knee: bool = False
    models: list[str] | None = None  # the models this class's runs trained (admission.distance measures to these)


class TeacherThresholds(Schema):
    metric: str = "teacher_nsr"
    classes: dict[Literal[CLASSES], ClassThresholds] = Field(min_length=1)


class CalibrationModel(Schema):
    """One model the thresholds were calibrated on, by the scales that differ across models (studies/admission.py,
    docs/tolerance.md): its BF16 engine's nsr on the probe (the floor) and the probe's reverse KL to the teacher (the
    OPD signal's scale)."""
    floor_nsr: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    floor_nsr_range: list[NonNegative] | None = Field(None, min_length=2, max_length=2)
    rkl: NonNegative | None = None
    runs: int = 0


def warm_thresholds(steps: int) -> Path:
    """The shipped thresholds calibrated on probes after `steps` BF16 steps (`opd admit --warmup`), where one ships."""
    return DEFAULT_THRESHOLDS.with_name(f"thresholds_warm{steps}.json")


class Thresholds(Schema):
    metric: str = METRIC
    classes: dict[str, ClassThresholds]
    teacher: TeacherThresholds | None = None  # the teacher side's limits (calibrate_teacher)
    models: dict[str, CalibrationModel] | None = None  # what it was calibrated on (calibration_models)
    probe_warmup: Annotated[int, Field(ge=0)] = 0  # its probes measured the student after this many BF16 steps


def load_thresholds(path: str | Path = "") -> dict:
    """A thresholds file, checked (Thresholds) with messages that say which class and key is wrong."""
    path = Path(path) if path else DEFAULT_THRESHOLDS
    where, fix = f"thresholds file {path}", "rewrite it with `opd calibrate`"
    text = read_text(path, "thresholds file")
    try:
        data = parse_json(text, where, fix)
    except OpdError as e:  # "... is not valid JSON (...)", as before the schema
        raise OpdError(e.problem.replace(f"{where}: ", f"{where} is ", 1), fix) from None
    classes = data.get("classes") if isinstance(data, dict) else None
    require(isinstance(classes, dict) and classes, f"{where} has no valid per-class limits", fix)
    require(set(classes) <= set(CLASSES), f"{where} names unknown estimator classes "
            f"{sorted(set(classes) - set(CLASSES))}", f"use {', '.join(CLASSES)}")
    require(data.get("metric", METRIC) == METRIC, f"{where} limits {data.get('metric')!r}, not {METRIC}", fix)
    try:
        Thresholds.model_validate(data)
    except ValidationError as e:
        loc = e.errors()[0]["loc"]
        if loc[0] == "teacher":
            raise OpdError(f"{where}: its teacher-side limits are invalid ({problem(e)})", fix) from None
        if loc[0] == "models":
            raise OpdError(f"{where}: what it says it was calibrated on is invalid ({problem(e)})", fix) from None
        if len(loc) < 3 or loc[2] == "max":
            raise OpdError(f"{where} has no valid per-class limits ({problem(e)})", fix) from None
        raise OpdError(f"{where}: '{loc[1]}' has an invalid {loc[2]} ({problem(e)})", fix) from None
    return data


def is_teacher_side(row: dict) -> bool:
    """A sweep result whose teacher was scored by an engine or cut to its top k (the teacher study's rows)."""
    from opd.config.files import stored_teacher
    return stored_teacher(row.get("config", {})).served


def drift_budget(stale: list[dict]) -> float | None:
    """The largest staleness x lr among these staleness runs that the best cut on staleness x lr keeps (None without
    any)."""
    points = sorted((r["staleness"] * r["config"]["optim"]["lr"], r["degraded"]) for r in stale)
    if not points:
        return None
    cut = best_cut(points)["max"]
    return max((d for d, _ in points if d <= cut), default=0.0)


def calibrate(rows: list[dict]) -> dict:
    """Per estimator class, from sweep results labelled by tolerance.label(): the cut on the probe's nsr that
    misclassifies the fewest synchronous runs (the widest gap among equally good cuts, its geometric middle); the
    band's upper edge `reject`, between the largest nsr that trained fine and the next run above it, all of which
    degraded (REJECT above it, UNCERTAIN between the cut and it); and the drift budget `max_drift`, the largest
    staleness x lr among the runs whose only mismatch was staleness that the same best-cut rule keeps, over all of
    them and per model (`max_drift_by_model`: how far a policy moves per step at a given lr is the model's own, so a
    budget holds for the model it was measured on; admission.drift_budget_for picks the nearest)."""
    teacher = calibrate_teacher([r for r in rows if is_teacher_side(r)])
    rows = [r for r in rows if not is_teacher_side(r)]  # their rollouts are at the floor: a teacher's knee is not q's
    classes = {}
    for cls in CLASSES:
        mine = [r for r in rows if r["class"] == cls and math.isfinite(r["probe"].get(METRIC, math.nan))]
        points = sorted((r["probe"][METRIC], r["degraded"]) for r in mine  # the ESS floor rejects the others
                        if not r["staleness"] and r["probe"].get("ess_frac", 1.0) >= MIN_ESS_FRAC)
        if not points:
            continue
        stale = [r for r in mine  # at the floor: staleness is their only mismatch
                 if r["staleness"] and r["probe"][METRIC] <= FLOOR_FACTOR * r["probe"].get("floor_nsr", 0)]
        by_model = {name: drift_budget([r for r in stale if model_name(r) == name])
                    for name in sorted({model_name(r) for r in stale} - {None})}
        names = sorted({model_name(r) for r in mine} - {None})  # the models this class's limits were measured on
        classes[cls] = cut_and_band(points) | {"runs": len(points), "max_drift": drift_budget(stale),
                                               "staleness_seen": sorted({r["staleness"] for r in stale})} | (
            {"max_drift_by_model": by_model} if by_model else {}) | ({"models": names} if names else {})
    require(classes, "no synchronous sweep results with probe measurements to calibrate from", "run `opd sweep` first")
    models = calibration_models(rows)
    return {"metric": METRIC, "classes": classes} | ({"teacher": teacher} if teacher else {}) | (
        {"models": models} if models else {})


def model_name(row: dict) -> str | None:
    """The model a sweep result trained: its student checkpoint's folder name, or its pair's family."""
    student = row.get("config", {}).get("student") or ""
    return Path(student).name if student else row.get("family")


def calibration_models(rows: list[dict]) -> dict:
    """Per model of the calibration rows: the median (and range) of its probes' BF16 floor nsr and their median
    reverse KL to the teacher, for admission.distance to tell a user how far their model is from these."""
    out = {}
    for name in sorted({model_name(r) for r in rows} - {None}):
        mine = [r["probe"] for r in rows if model_name(r) == name]
        floors = sorted(p["floor_nsr"] for p in mine if 0 < p.get("floor_nsr", 0) < math.inf)
        rkl = sorted(p["rkl"] for p in mine if math.isfinite(p.get("rkl", math.nan)))
        if floors:
            out[name] = {"floor_nsr": floors[len(floors) // 2], "floor_nsr_range": [floors[0], floors[-1]],
                         "rkl": rkl[len(rkl) // 2] if rkl else None, "runs": len(mine)}
    return out


def calibrate_teacher(rows: list[dict]) -> dict | None:
    """The teacher side's limits, per estimator class, from the teacher study's rows (teacher engines under a plan;
    not top-k alone, whose sampled tokens' log-probs are exact: its teacher_nsr is 0): the same best cut on the
    probe's teacher_nsr and the band above it (cut_and_band). None without such rows."""
    from opd.config.files import stored_teacher
    classes = {}
    for cls in CLASSES:
        points = sorted((r["probe"]["teacher_nsr"], r["degraded"]) for r in rows if r["class"] == cls and
                        math.isfinite(r["probe"].get("teacher_nsr", math.nan)) and not r["staleness"] and
                        not stored_teacher(r["config"]).topk)
        if not points:
            continue
        classes[cls] = cut_and_band(points) | {"runs": len(points)}
    return {"metric": "teacher_nsr", "classes": classes} if classes else None


def cut_and_band(points: list[tuple[float, bool]]) -> dict:
    """best_cut's entry with the band's upper edge `reject`: between the largest value that trained fine and the next
    run above it (all of those degraded), never below the cut."""
    entry = best_cut(points)
    fine_max = max((v for v, bad in points if not bad), default=0.0)
    above = [v for v, bad in points if v > fine_max]
    return entry | {"reject": max(entry["max"], math.sqrt(fine_max * above[0]) if above else fine_max)}


def best_cut(points: list[tuple[float, bool]], cost: float = ADMITTED_DEGRADED_COST) -> dict:
    """points: sorted (mismatch, degraded). -> {max: the cut, knee: whether any point degraded, errors (the runs it
    misplaces), fine_max}. The cut minimises cost x (degraded runs admitted) + (fine runs rejected)."""
    values = [v for v, _ in points]
    fine = [v for v, bad in points if not bad]
    if not any(bad for _, bad in points):
        return {"max": max(values), "knee": False, "errors": 0}
    best = None
    for i in range(len(points) + 1):  # cut between points[i-1] and points[i]: admit the first i
        admitted_bad, rejected_fine = sum(bad for _, bad in points[:i]), sum(not bad for _, bad in points[i:])
        low = values[i - 1] if i else values[0] / 2
        high = values[i] if i < len(values) else values[-1] * 2
        gap = math.log(max(high, 1e-12) / max(low, 1e-12))
        key = (cost * admitted_bad + rejected_fine, -gap)
        if best is None or key < best[0]:
            best = (key, admitted_bad + rejected_fine, math.sqrt(max(low, 1e-12) * max(high, 1e-12)))
    return {"max": best[2], "knee": True, "errors": best[1], "fine_max": max(fine) if fine else None}
