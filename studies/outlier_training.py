"""Outlier keys, trained: does OPD degrade where the admission check rejects? (studies/outlier_keys.py, trained)

The tolerance study's short runs (opd/study/sweep.py's built-in grid: 60 steps of batch 32, `full_rkl` at lr 3e-4 and
`sampled_mu` at lr 1e-4, 100 held-out prompts) with rollouts from an engine whose copy of the student has outlier
keys (the plan setting `key_outlier=alpha`, opd/numerics/stress.py). The learner trains the original weights; only the
engine's KV cache holds keys alpha times larger in one RoPE channel pair, as a real outlier model's engine would.
Points: BF16 rollouts with the outlier (a control: it must train like plain BF16), FP8-e4m3 KV with vLLM's fixed
scale 1.0 at alpha 100 and 300, calibrated FP8 scales at alpha 300, and calibrated INT8 at alpha 300. Each run is
labelled as in the study (opd/study/tolerance.py: degraded when its final reverse KL to the teacher is above the worst
of the study's 5 BF16 seeds by more than their spread), and its probe is decided with the *shipped* thresholds
(opd/thresholds.json). Since 2026-12-01 (issue 22) those are calibrated on these runs too, so the decisions here
are in sample; held out, the outlier source is a row of studies/admission.py's leave-one-source-out.

    mkdir -p runs/outlier_study && cp studies/data/admission_results.jsonl runs/outlier_study/results.jsonl
    python studies/outlier_training.py --out runs/outlier_study --family llama   # and qwen3, side by side
    python studies/outlier_training.py --quick   # the stored results (studies/data/outlier_results.jsonl)

The full mode runs what `<out>/results.jsonl` lacks (10 runs per family, ~18 minutes here) and appends them; the
copy above gives it the study's BF16 seeds, which it would otherwise run too. The last line is
`RESULT agreement=... runs=... admitted_degraded=... rejected_fine=...`.
"""
from pathlib import Path

import yaml

from opd.study.sweep import DEFAULT_GRID
from opd.health.thresholds import load_thresholds
from opd.study.tolerance import QUALITY, out_of_sample
from studies import grid_rows, parse_args, print_counts

STORED = Path(__file__).parent / "data" / "outlier_results.jsonl"
POINTS = """
- {source: key_outlier, level: bf16_a300, set: {plan: "kv=bf16 w=bf16 key_outlier=300"}}
- {source: key_outlier, level: fp8_a100, set: {plan: "kv=fp8_e4m3 w=bf16 key_outlier=100"}}
- {source: key_outlier, level: fp8_a300, set: {plan: "kv=fp8_e4m3 w=bf16 key_outlier=300"}}
- {source: key_outlier, level: fp8cal_a300, set: {plan: "kv=fp8_e4m3 kv_scale=calibrate w=bf16 key_outlier=300"}}
- {source: key_outlier, level: int8cal_a300, set: {plan: "kv=int8 kv_scale=calibrate w=bf16 key_outlier=300"}}
"""


def outlier_grid() -> dict:
    """The study's grid (families, base, the two estimators these runs used, its BF16 seeds) with the outlier points
    instead of its others."""
    grid = yaml.safe_load(DEFAULT_GRID)
    grid["estimators"] = {name: grid["estimators"][name] for name in ("full_rkl", "sampled_mu")}
    grid["points"] = [p for p in grid["points"] if p["source"] == "bf16"] + yaml.safe_load(POINTS)
    return grid


def main():
    args = parse_args(__doc__, STORED, "runs/outlier_study")
    grid = outlier_grid()
    levels = {str(point["level"]) for point in grid["points"]}
    rows = grid_rows(grid, args, STORED, lambda r: r["source"] in ("bf16", "key_outlier") and str(r["level"]) in levels)
    decided, counts = out_of_sample(rows, load_thresholds(""), ("key_outlier",))
    print(f"{'family':6} {'estimator':10} {'point':13} {'kl_k3':>8} {'nsr':>6} {'ess':>5} {'clipped':>8}  "
          f"{'decision':8} {'final rkl':>9} {'limit':>6}  outcome   agree")
    for row in sorted(decided, key=lambda r: (r["family"], r["estimator"], str(r["level"]))):
        p = row["probe"]
        print(f"{row['family']:6} {row['estimator']:10} {row['level']:13} {p['kl_k3']:>8.2e} {p['nsr']:>6.3f} "
              f"{p['ess_frac']:>5.3f} {p.get('kv_clipped_k', 0):>8.3%}  {'ADMIT' if row['admitted'] else 'REJECT':8} "
              f"{row['after'][QUALITY]:>9.3f} {row['limit']:>6.3f}  {'degraded' if row['degraded'] else 'fine':8}  "
              f"{'yes' if row['admitted'] != row['degraded'] else 'NO'}")
    print_counts(counts)


if __name__ == "__main__":
    main()
