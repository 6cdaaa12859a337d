"""Staleness at the demo's learning rate: does `max_staleness` from the study (lr 3e-4) hold at lr 1e-3?

The tolerance study calibrated the full class's `max_staleness` (4, the largest it tried) on runs at lr 3e-4. A
rollout k versions old differs from the learner by k optimizer steps, so its drift grows with the learning rate, and
the demo trains at lr 1e-3. This grid trains the full-vocabulary loss with the demo's recipe cut to 60 steps (batch
64, lr 1e-3, 10 warm-up steps, cosine, 100 held-out prompts) on both built-in pairs: BF16 rollouts (5 seeds, the
band), and async BF16 rollouts with max_staleness 1, 2, 4 (3 seeds each) and 8 (1 seed). Each run is labelled as in
the study (opd/study/tolerance.py) and decided with the *shipped* thresholds (opd/thresholds.json). Since 2026-12-01
(issue 22) those are calibrated on these runs too, so the decisions here are in sample; held out, the staleness
source is a row of studies/admission.py's leave-one-source-out. A run's probe is at the BF16 floor, so the
decision is its drift budget max_staleness x lr against the class's. Beside
it: the mean version gap, `stale/total_kl_k3` and `stale/total_nsr` averaged over training (what the runtime guard
used to judge, before it switched to the numerics alone; dev/LOG.md, 2026-12-01).

    python studies/staleness_training.py --out runs/staleness --family llama   # and qwen3, side by side
    python studies/staleness_training.py --quick   # the stored results (studies/data/staleness_results.jsonl)

The full mode runs what `<out>/results.jsonl` lacks (15 runs per family, ~45 minutes here with both families side
by side) and appends them. The last line is `RESULT agreement=... runs=... admitted_degraded=... rejected_fine=...`.
"""
from pathlib import Path

import yaml

from opd.study.sweep import DEFAULT_GRID
from opd.health.thresholds import load_thresholds
from opd.study.tolerance import QUALITY, out_of_sample, pivot
from studies import grid_rows, parse_args, print_counts

STORED = Path(__file__).parent / "data" / "staleness_results.jsonl"
DEMO = {"batch_size": 64, "optim": {"warmup_steps": 10, "schedule": "cosine"}}  # the demo's recipe, the study's 60 steps
POINTS = """
- {source: bf16, level: 0, set: {}, seeds: [0, 1, 2, 3, 4]}
- {source: staleness, level: 1, set: {schedule: async, async: {max_staleness: 1}, threads: 2}, seeds: [0, 1, 2]}
- {source: staleness, level: 2, set: {schedule: async, async: {max_staleness: 2}, threads: 2}, seeds: [0, 1, 2]}
- {source: staleness, level: 4, set: {schedule: async, async: {max_staleness: 4}, threads: 2}, seeds: [0, 1, 2]}
- {source: staleness, level: 8, set: {schedule: async, async: {max_staleness: 8}, threads: 2}}
"""


def staleness_grid() -> dict:
    """The study's grid (families, base) with the demo's batch and schedule, full_rkl at lr 1e-3, staleness points."""
    grid = yaml.safe_load(DEFAULT_GRID)
    grid["base"] |= DEMO
    grid["estimators"] = {"full_rkl_demo": {"loss": {"name": "full_rkl"}, "optim": {"lr": 1.0e-3}}}
    grid["points"] = yaml.safe_load(POINTS)
    return grid


def main():
    args = parse_args(__doc__, STORED, "runs/staleness")
    grid = staleness_grid()
    rows = grid_rows(grid, args, STORED, lambda r: r["estimator"] in grid["estimators"])
    print(pivot(rows))
    print()
    decided, counts = out_of_sample(rows, load_thresholds(""), ("staleness",))
    print(f"{'family':6} {'k':>2} {'seed':>4} {'gap':>5} {'total_kl_k3':>11} {'total_nsr':>9}  {'decision':8} "
          f"{'final rkl':>9} {'limit':>6}  outcome   agree")
    for row in sorted(decided, key=lambda r: (r["family"], r["staleness"], r["seed"])):
        t = row["train"]
        print(f"{row['family']:6} {row['staleness']:>2} {row['seed']:>4} {t['stale/version_gap_mean']:>5.2f} "
              f"{t['stale/total_kl_k3']:>11.4f} {t['stale/total_nsr']:>9.3f}  "
              f"{'ADMIT' if row['admitted'] else 'REJECT':8} {row['after'][QUALITY]:>9.3f} {row['limit']:>6.3f}  "
              f"{'degraded' if row['degraded'] else 'fine':8}  {'yes' if row['admitted'] != row['degraded'] else 'NO'}")
    print_counts(counts)


if __name__ == "__main__":
    main()
