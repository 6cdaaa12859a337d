"""Does the admission probe read a real pair's runs better after a few BF16 steps?

On the smollm2 pair the probe of the initial (pruned, untrained) student measured 4-12x the mismatch the runs then
trained with (probe kl_k3 3.2 vs 0.75 averaged over the INT4-weights run; dev/LOG.md 2026-12-03): the first steps
move the student far (held-out reverse KL 6.6 -> ~1.3 in 16 steps), and its mismatch falls with it, within ~5 steps.
This measures the probe of every plan of a grid on the student after K steps of BF16 OPD (the grid's own recipe and
one estimator, the first unless --estimator, each seed that has a BF16 run), K = 0 being the probe as the sweep
stores it. Each (K, seed) trains once from the initial student and probes every plan on that student (the BF16 floor
once). One JSON line per (K, estimator, lr, seed, plan) is appended to --out; one already there is not measured
again, so a stopped run resumes.

    python studies/warm_probe.py --grid studies/data/real_grid.yaml --warmup 4 \
        --out studies/data/real_warm_probes.jsonl --results studies/data/real_results.jsonl
        # ~100 s of warm-up a seed and ~25 s a probe on 2 cores; what --out holds is not measured again;
        # --estimator sampled_pi: the same with that estimator's loss warming the student; --only-stored: only
        # the plans and seeds --results has a run of
    python studies/warm_probe.py --quick               # the built-in llama pair, 2 plans, K = 0 and 2: seconds

It ends with `RESULT`: the median over the mismatched plans of probe kl_k3 at the largest K over that at K = 0 (from
--results where this file has no K = 0 probe of the plan).
"""
import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

from opd.io.schema import read_jsonl
from opd.training.setup import parse_plan, probe_setup
from opd.study.sweep import PROBE_ROLLOUTS, expand, load_grid, read_results
from opd.admission.check import warm_weights
from opd.admission.probe import measure, probe
from opd.study.sweep_shared import append_result
from opd.numerics.plan import Plan
from opd.health.rules import FLOOR_PLAN

QUICK_GRID = {"families": ["llama"], "base": {"steps": 4, "batch_size": 8, "eval": {"every": 0, "examples": 4},
                                              "save_every": 0, "threads": 2, "optim": {"warmup_steps": 1}},
              "estimators": {"full_rkl": {"loss": {"name": "full_rkl"}}},
              "points": [{"source": "bf16", "level": 0, "set": {"plan": "forward=bf16 kv=bf16"}},
                         {"source": "kv", "level": "fp8_e5m2", "set": {"plan": "forward=bf16 kv=fp8_e5m2"}}]}


def read_lines(path: Path) -> list[dict]:
    """The rows measured so far (a torn last line, from a stop mid-write, is left out and measured again)."""
    return read_jsonl(path, "warm probes file") if path.is_file() else []


def measure_grid(grid: dict, warmups: list[int], out: Path, estimator: str = "", only: set | None = None) -> None:
    """Probe every plan of one of the grid's estimators (the first by default: the warm-up trains with its loss) after
    each K in warmups, per seed with a BF16 run; one line per (K, estimator, seed, plan) appended to out, skipping
    those already there. only: the (seed, plan) pairs to probe (None: all)."""
    specs = expand(grid)
    first = estimator or specs[0]["estimator"]
    specs = [s for s in specs if s["estimator"] == first]
    if not specs:
        sys.exit(f"warm_probe: the grid has no estimator {first!r}")
    lr = specs[0]["cfg"].optim.lr  # the warm-up's: a grid at another lr warms another student
    done = {(r["warmup"], r["seed"], r["plan"]) for r in read_lines(out)
            if r.get("estimator", first) == first and r["lr"] == lr}
    for k, seed in itertools.product(warmups, sorted({s["seed"] for s in specs})):
        todo = [s for s in specs if s["seed"] == seed and (k, seed, str(s["cfg"].plan)) not in done
                and (only is None or (seed, str(s["cfg"].plan)) in only)]
        todo = list({str(s["cfg"].plan): s for s in reversed(todo)}.values())[::-1]  # a plan once (staleness: BF16's)
        base = next((s["cfg"] for s in specs if s["source"] == "bf16" and s["seed"] == seed), None)
        if not todo or base is None:  # a seed without a BF16 run has no warm-up recipe
            continue
        start = time.perf_counter()
        weights = warm_weights(base, k) if k else None
        warm_seconds = time.perf_counter() - start
        setup, _ = probe_setup(base, PROBE_ROLLOUTS)  # the plans differ only in what the engine does: one set-up
        if weights is not None:
            setup.student.load_state_dict(weights)
        layers = setup.student.cfg.num_layers
        floor = measure(setup, Plan.parse(FLOOR_PLAN, layers))
        for spec in todo:
            numbers = probe(setup, parse_plan(spec["cfg"], layers), floor=floor)
            row = {"id": f"{spec['id']}@warmup{k}", "warmup": k, "plan": str(spec["cfg"].plan),
                   "source": spec["source"], "level": spec["level"], "family": spec["family"], "estimator": first,
                   "lr": lr, "seed": seed, "probe": numbers, "warm_seconds": warm_seconds}
            append_result(out, row)
            print(f"warmup {k} {spec['source']}={spec['level']}: kl_k3 {numbers['kl_k3']:.3f} nsr "
                  f"{numbers['nsr']:.3f} ess_frac {numbers['ess_frac']:.3f} ({numbers['seconds']:.0f} s)",
                  file=sys.stderr)
        setup.teacher.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=Path, default=Path(__file__).parent / "data" / "real_grid.yaml")
    parser.add_argument("--warmup", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--estimator", default="", help="the grid's estimator whose recipe warms the student "
                        "(default: its first)")
    parser.add_argument("--results", type=Path, help="the grid's sweep results: their probes stand for K = 0")
    parser.add_argument("--only-stored", action="store_true", help="probe only the plans and seeds --results holds "
                        "a run of (the grid's sweep still going)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        grid, args.warmup, args.results = QUICK_GRID, [0, 2], None
        out = Path(tempfile.mkdtemp()) / "warm.jsonl"
    else:
        grid, out = load_grid(args.grid), args.out or Path(tempfile.mkdtemp()) / "warm.jsonl"
    name = args.estimator or expand(grid)[0]["estimator"]
    only = ({(r["seed"], str(r["config"]["plan"])) for r in read_results(args.results) if r["estimator"] == name}
            if args.only_stored and args.results else None)
    measure_grid(grid, args.warmup, out, args.estimator, only)
    lr = next(s["cfg"].optim.lr for s in expand(grid) if s["estimator"] == name)
    rows = [r for r in read_lines(out) if r.get("estimator", name) == name and r["lr"] == lr]
    by = {(r["warmup"], r["seed"], r["plan"]): r["probe"] for r in rows}
    if args.results:  # the sweep's stored probes are the K = 0 ones (the same numbers: tests/test_study.py)
        stored = [r for r in read_results(args.results) if r["estimator"] == name and r["config"]["optim"]["lr"] == lr]
        by |= {(0, r["seed"], str(r["config"]["plan"])): r["probe"] for r in stored if (0, r["seed"], str(
            r["config"]["plan"])) not in by}
        rows += [{"warmup": 0, "seed": r["seed"], "plan": str(r["config"]["plan"]), "source": r["source"]}
                 for r in stored]
    ks = sorted({r["warmup"] for r in rows})
    floors = {r["plan"] for r in rows if r["source"] == "bf16"}  # staleness points probe the BF16 plan too
    mismatched = {(r["seed"], r["plan"]) for r in rows if r["plan"] not in floors}
    ratios = [by[(ks[-1], *p)]["kl_k3"] / by[(ks[0], *p)]["kl_k3"] for p in mismatched if (ks[0], *p) in by
              and (ks[-1], *p) in by]
    print(f"RESULT warmups={','.join(map(str, ks))} plans={len(ratios)} "
          f"kl_k3_ratio_median={statistics.median(ratios):.3f} out={out}")


if __name__ == "__main__":
    main()
