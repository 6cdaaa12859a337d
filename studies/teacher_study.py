"""The teacher's side of the mismatch: how much of it OPD tolerates, against the student's side at the same KL.

Two grids on both built-in pairs, the study's recipe (60 steps of batch 32, BF16 rollouts for the student):
- studies/data/teacher_grid.yaml: the teacher scored by the built-in engine under a teacher.plan (FP8 KV e4m3 and
  e5m2, FP8 weights, relative weight noise 0.3 and 1.0) for the full-vocabulary reverse KL and the sampled-token
  estimator, and beside them the same kinds of mismatch on the student's side (FP8 e5m2 KV, noise 0.3 and 1.0);
- studies/data/teacher_topk_grid.yaml: a teacher that returns only its top k = 1, 8, 64 log-probs, for the top-k
  forward KL and the top-k reverse KL with a tail bucket (k = V = 100: the full losses).
Each run is labelled as in the tolerance study (opd/study/tolerance.py: its final held-out reverse KL to the *trainer's*
teacher against its BF16 seeds). Printed: the table; the knees (teacher-side sources on `teacher_mismatch/kl_exact`, a
top-k teacher on its tail mass, student-side sources on `stale/total_kl_k3`); the comparison of the two sides at the
same measured KL; the teacher-side admission limits calibrated on these runs (thresholds.calibrate_teacher) and their
leave-one-source-out decisions.

**The comparison.** Both sides' engines are the built-in one, whose whole distributions give the exact mean KL per
position (student side: KL(rollout || trainer), `mismatch/kl_exact`; teacher side: KL(teacher engine || trainer's
teacher), `teacher_mismatch/kl_exact`). Per family and estimator, each side's runs give that side's knee by the
study's rule (thresholds.best_cut; the student side with its BF16 runs at their own exact KL; the teacher side's BF16
runs would sit at 0, their teacher being the trainer's, so its knee comes from its runs alone, and a knee below all of
them is only an upper bound); `tolerance_ratio` is the student side's knee over the teacher side's: above 1, OPD
tolerates more KL on the student's side. A student side without a degraded run gives a lower bound (its largest fine
KL over the teacher's knee), as does a teacher knee below all its runs.

    python studies/teacher_study.py --out runs/teacher --family llama   # and qwen3, side by side (~1 h each)
    python studies/teacher_study.py --quick     # the stored results (studies/data/teacher_results.jsonl)

The shipped thresholds' `teacher` entry is this calibration: `python studies/admission.py --quick
--write-thresholds opd/thresholds.json` writes it from studies/data/teacher_results.jsonl (`--store` that file).

The last line is `RESULT key=value ...`.
"""
import json
import math
from pathlib import Path

import yaml

from opd.health.rules import decide_teacher
from opd.config.files import stored_teacher
from opd.health.metrics import TeacherHealth
from opd.config.runlog import write_atomic
from opd.study.sweep import read_results, run_sweep
from opd.health.thresholds import best_cut, calibrate_teacher, is_teacher_side
from opd.study.tolerance import QUALITY, band, groups, knees, label, latest, pivot, teacher_thresholds
from studies import parse_args

DATA = Path(__file__).parent / "data"
STORED = DATA / "teacher_results.jsonl"
GRIDS = (DATA / "teacher_grid.yaml", DATA / "teacher_topk_grid.yaml")
STUDENT_SIDE = ("kv", "noise")


def side_knee(points: list[tuple[float, bool]]) -> dict:
    """points: (exact KL, degraded) of one side's runs -> the knee (thresholds.best_cut, cost 1), the largest KL that
    trained fine, the smallest that degraded, and whether the cut lies below every run (then the knee is only known
    to be under the smallest: best_cut puts it at that KL / sqrt 2)."""
    points = sorted(points)
    bad = [kl for kl, b in points if b]
    cut = best_cut(points, cost=1.0)["max"] if bad else None
    return {"knee": cut, "fine_max": max((kl for kl, b in points if not b), default=None),
            "degraded_min": min(bad, default=None), "below_all": cut is not None and cut < points[0][0]}


def comparison(rows: list[dict]) -> tuple[list[str], dict]:
    """Per family and estimator, each side's runs on its exact KL (module docstring): the knee of each side and how
    many times more KL the student side tolerates (`tolerance_ratio`: student knee / teacher knee; a side without a
    degraded run gives a bound)."""
    lines, result = [], {}
    for (family, estimator), group in sorted(groups(label(rows)).items()):
        b = band(group)
        if b is None or estimator.startswith("topk"):
            continue
        floor = [(r["train"].get("mismatch/kl_exact", 0.0), False) for r in group if r["source"] == "bf16"]
        sides = {"student": [], "teacher": []}
        for r in sorted(group, key=lambda r: (r["source"], str(r["level"]))):
            if r["source"] in STUDENT_SIDE:
                side, kl = "student", r["train"].get("mismatch/kl_exact", math.nan)
            elif r["source"].startswith("teacher_"):
                side, kl = "teacher", r["train"].get("teacher_mismatch/kl_exact", math.nan)
            else:
                continue
            sides[side].append((kl, bool(r["degraded"])))
            lines.append(f"{family:6} {estimator:10} {side:7} {r['source']}={r['level']!s:9} exact KL {kl:9.3g}  "
                         f"final rkl {r['after'][QUALITY]:.4f} (BF16 {b['lo']:.4f}-{b['hi']:.4f}, limit "
                         f"{b['limit']:.4f})  {'degraded' if r['degraded'] else 'fine'}")
        # the student side's BF16 runs sit at their own exact KL; the teacher side's would sit at 0 (their teacher
        # is the trainer's), where no knee can be placed: its runs alone, a knee below them all being a bound
        knees_ = {"student": side_knee(sides["student"] + floor), "teacher": side_knee(sides["teacher"])}
        for side, k in knees_.items():
            where = "no knee" if k["knee"] is None else \
                f"knee {'below ' if k['below_all'] else ''}{k['knee']:.3g}"
            lines.append(f"{family:6} {estimator:10} {side:7} {where}; largest fine {fmt(k['fine_max'])}, smallest "
                         f"degraded {fmt(k['degraded_min'])}")
        s, t = knees_["student"], knees_["teacher"]
        if t["knee"] is None:
            ratio = "nan"  # nothing degraded on the teacher's side
        elif s["knee"] is None:  # the student side never degraded: a lower bound
            ratio = f">{s['fine_max'] / t['knee']:.3g}" if s["fine_max"] else "nan"
        else:
            ratio = f"{'>' if t['below_all'] else ''}{s['knee'] / t['knee']:.3g}"
        lines.append(f"{family:6} {estimator:10} the student side tolerates {ratio}x the teacher side's exact KL")
        result[f"tolerance_ratio_{family}_{estimator}"] = ratio
    return lines, result


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def leave_source_out(rows: list[dict]) -> tuple[list[str], int, int]:
    """Each teacher-side source decided by teacher limits calibrated on the other teacher-side sources."""
    labelled = [r for r in label(rows) if r["degraded"] is not None and is_teacher_side(r)
                and not stored_teacher(r["config"]).topk]
    lines, right = [], 0
    for source in sorted({r["source"] for r in labelled}):
        entry = calibrate_teacher([r for r in labelled if r["source"] != source])
        for r in (r for r in labelled if r["source"] == source):
            verdict = decide_teacher(TeacherHealth.of(r["probe"]), {"classes": {}, "teacher": entry},
                                     r["class"]).verdict \
                if entry else "none"
            ok = (verdict == "ADMIT") != r["degraded"]
            right += ok
            lines.append(f"{r['id']:45} teacher_nsr {r['probe']['teacher_nsr']:.3g}  {verdict:9} "
                         f"{'degraded' if r['degraded'] else 'fine':8}  {'yes' if ok else 'NO'}")
    return lines, right, len(labelled)


def main():
    args = parse_args(__doc__, STORED, "runs/teacher")
    if args.quick:
        rows = read_results(STORED)
    else:
        for path in GRIDS:
            run_sweep(yaml.safe_load(path.read_text()), args.out, args.family)
        rows = read_results(args.out / "results.jsonl")
    rows = latest(rows)
    if args.store:
        write_atomic(args.store, "".join(json.dumps(r) + "\n" for r in rows))
    print(pivot(rows))
    print("\nknees (teacher sources: teacher_mismatch/kl_exact; teacher_topk: tail mass; others: stale/total_kl_k3):")
    for k in knees(rows):
        where = f"knee {k['knee']:.3g} (first degraded {k['first_degraded']:.3g})" if k.get("knee") is not None \
            else f"no knee up to {k['max_mismatch']:.3g}" if k["max_mismatch"] is not None else "no runs"
        print(f"  {k['family']}/{k['estimator']}/{k['source']}: {where}")
    lines, result = comparison(rows)
    print("\nthe two sides at the same measured KL:")
    print("\n".join("  " + line for line in lines))
    entry = teacher_thresholds(rows)
    print("\nteacher-side limits calibrated on these runs (teacher_nsr of the probe):")
    for cls, e in (entry or {}).get("classes", {}).items():
        print(f"  {cls:10} ADMIT teacher_nsr <= {e['max']:.3g}, REJECT > {e['reject']:.3g} "
              f"({'knee' if e['knee'] else 'no degradation seen'}; {e['errors']} of {e['runs']} runs misclassified)")
    lines, right, n = leave_source_out(rows)
    print("\nleave one teacher-side source out (limits from the other sources decide it):")
    print("\n".join("  " + line for line in lines))
    result["teacher_admission_leave_source_out"] = f"{right / max(n, 1):.3f}"
    result["teacher_runs"] = n
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
