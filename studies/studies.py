"""What outlier_training.py and staleness_training.py share: a grid of short runs that checks the shipped admission
thresholds on runs they were never calibrated on. Full mode runs what the sweep folder lacks; --quick reads the runs
stored in benchmarks/data; --store writes the grid's runs there."""
import argparse
import json
from pathlib import Path

from opd.config.runlog import write_atomic
from opd.study.sweep import read_results, run_sweep
from opd.study.tolerance import latest, result_line


def parse_args(doc: str, stored: Path, default_out: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"the stored results (studies/data/{stored.name})")
    ap.add_argument("--out", type=Path, default=Path(default_out), help="the sweep's folder (full mode)")
    ap.add_argument("--family", action="append", choices=["llama", "qwen3"], help="full mode: only these families")
    ap.add_argument("--store", type=Path, help="write the grid's results here, e.g. the --quick data file")
    return ap.parse_args()


def grid_rows(grid: dict, args: argparse.Namespace, stored: Path, keep) -> list[dict]:
    """The runs of the grid that keep(row) accepts (the latest line of each): stored (--quick), or run and read from
    --out. The analysis (tolerance.label, pivot, out_of_sample) labels them."""
    if args.quick:
        rows = read_results(stored)
    else:
        run_sweep(grid, args.out, args.family)
        rows = read_results(args.out / "results.jsonl")
    rows = [r for r in latest(rows) if keep(r)]
    if args.store:
        write_atomic(args.store, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def print_counts(counts: dict) -> None:
    print()
    for key, n in counts.items():
        print(f"  {key:22} {n:3d}")
    print(result_line(counts))
