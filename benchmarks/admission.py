"""Is the admission check right, and is it cheap? Its decisions against real training outcomes.

Ground truth is the tolerance study's sweep (opd/sweep.py, the built-in grid): short OPD runs over mismatch sources
and levels on both built-in pairs, each labelled fine or **degraded** (its final held-out reverse KL to the teacher
is above the worst BF16 seed by more than the BF16 seeds' spread, or 5% of their mean if wider; opd/tolerance.py).
The check must predict that label before training.

Held-out evaluation, leave one configuration out: for each run, the thresholds are calibrated (`opd calibrate`'s
rule) on the runs of every *other* configuration (other family/estimator/source/level; the BF16 seeds of the same
group stay, they define "degraded"), and the check's decision for the run is made with them. ADMIT on a degraded
run or REJECT on a fine one is an error. A second split calibrates on one family and checks the other.

    python benchmarks/admission.py          # full: runs the sweep's missing trainings, re-runs every check
    python benchmarks/admission.py --quick  # the stored results (benchmarks/data/admission_results.jsonl):
                                            # decisions from their stored probes, no models needed, seconds

`cost_fraction` is the check's wall time (loading the pair, the probe on the candidate and on the BF16 floor, the
decision; the plan search that follows a REJECT is timed apart) over the wall time of the training run it judges
(training steps + the two evaluations), both at the run's thread count, medians over the runs. The last line is
`RESULT key=value ...`.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from opd.admission import calibrate, decide, probe
from opd.runlog import write_atomic
from opd.sweep import PROBE_ROLLOUTS, load_grid, read_results, run_sweep, stored_config
from opd.tolerance import accuracy, confusion, label

STORED = Path(__file__).parent / "data" / "admission_results.jsonl"


def config_of(row) -> tuple:
    return row["family"], row["estimator"], row["source"], str(row["level"])


def leave_one_out(rows: list[dict]) -> list[tuple[dict, bool]]:
    """-> (row, admitted) with thresholds calibrated without the row's configuration."""
    out = []
    for row in rows:
        others = [r for r in rows if config_of(r) != config_of(row)]
        thresholds = calibrate(others)
        out.append((row, decide(row["probe"], thresholds, row["class"], row["staleness"]).admit))
    return out


def cross_family(rows: list[dict]) -> list[tuple[dict, bool]]:
    out = []
    for family in sorted({r["family"] for r in rows}):
        thresholds = calibrate([r for r in rows if r["family"] != family])
        out += [(r, decide(r["probe"], thresholds, r["class"], r["staleness"]).admit)
                for r in rows if r["family"] == family]
    return out


def recheck(rows: list[dict]) -> list[float]:
    """Run every check again (the probe is re-measured; its numbers replace the stored ones); -> seconds each."""
    from opd.trainer import probe_setup
    seconds = []
    for i, row in enumerate(rows, 1):
        start = time.perf_counter()  # the decision itself (decide) is microseconds: the probe is the cost
        setup, plan = probe_setup(stored_config(row), PROBE_ROLLOUTS)
        row["probe"] = probe(setup, plan)
        seconds.append(time.perf_counter() - start)
        print(f"  [{i}/{len(rows)}] {row['id']}: nsr {row['probe']['nsr']:.3g} kl_k3 {row['probe']['kl_k3']:.3g} "
              f"({seconds[-1]:.2f} s)", file=sys.stderr, flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stored results and probes; no models, no training")
    parser.add_argument("--out", type=Path, default=Path("runs/study"), help="the sweep's folder (full mode)")
    parser.add_argument("--results", type=Path, default=STORED, help="--quick: the results file to read")
    parser.add_argument("--store", type=Path, help="write the (re-checked) results here, e.g. the --quick data file")
    args = parser.parse_args()
    if args.quick:
        rows = label(read_results(args.results))
        check_s = [r["probe"]["seconds"] for r in rows]
    else:
        rows = label(run_sweep(load_grid(None), args.out))
        check_s = recheck(rows)
    rows = [r for r in rows if r["degraded"] is not None]
    if args.store:
        write_atomic(args.store, "".join(json.dumps({k: v for k, v in r.items() if k not in ("degraded", "mismatch")})
                                         + "\n" for r in rows))
    train_s = [r["train_s"] + r["eval_s"] for r in rows]
    print(f"{len(rows)} runs ({sum(r['degraded'] for r in rows)} degraded), "
          f"{len({config_of(r) for r in rows})} configurations")
    results = {}
    for name, decisions in (("leave one configuration out", leave_one_out(rows)),
                            ("calibrated on the other family", cross_family(rows))):
        table = confusion(decisions)
        results[name] = accuracy(table)
        print(f"\n{name}:")
        for key, n in table.items():
            print(f"  {key:22} {n:3d}")
        print(f"  accuracy {results[name]:.3f}")
        wrong = [f"{r['id']} ({'ADMIT' if a else 'REJECT'}, nsr {r['probe']['nsr']:.2g})"
                 for r, a in decisions if a == bool(r["degraded"])]
        if wrong:
            print("  wrong: " + "; ".join(wrong))
    on_kl = [r | {"probe": r["probe"] | {"nsr": r["probe"]["kl_k3"], "floor_nsr": r["probe"]["floor_kl_k3"]}}
             for r in rows]  # the same rule on kl_k3 instead of nsr, for comparison
    results["kl_k3"] = accuracy(confusion(leave_one_out(on_kl)))
    print(f"\nthe same rule deciding on kl_k3 instead of nsr: leave-one-configuration-out accuracy "
          f"{results['kl_k3']:.3f}")
    cost = statistics.median(check_s) / statistics.median(train_s)
    print(f"\ncheck {statistics.median(check_s):.2f} s (median) vs training run {statistics.median(train_s):.1f} s")
    print(f"RESULT accuracy={results['leave one configuration out']:.3f} "
          f"accuracy_cross_family={results['calibrated on the other family']:.3f} "
          f"accuracy_on_kl_k3={results['kl_k3']:.3f} "
          f"cost_fraction={cost:.4f} "
          f"runs={len(rows)} check_s={statistics.median(check_s):.2f} train_s={statistics.median(train_s):.1f}")


if __name__ == "__main__":
    main()
