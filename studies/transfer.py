"""Does tolerance transfer across scale? The real pair's study next to the toy pairs', from stored results only.

Per model (the built-in llama and qwen3 pairs, 0.8M parameters; the smollm2 pair, SmolLM2-135M-Instruct and its
15-layer pruned student) and estimator: the BF16 seeds' band (mean, standard deviation, the `degraded` limit of
opd/study/tolerance.py), the probe's BF16 floor nsr and its reverse KL to the teacher (the OPD signal's scale); then per
mismatch source and level, the probe's nsr (and as a multiple of the model's own floor), the mismatch the run
measured while training (`stale/total_kl_k3`), the final held-out reverse KL's change against the BF16 seeds' mean,
and whether the run degraded. Then the sources ordered by that change on each model, and how far the orderings agree
on the sources both measured (Spearman's rank correlation), and the per-layer FP8 spread of each model
(studies/data/real_layers.jsonl: the most sensitive layer's KL over the median layer's).

The toy pairs' rows are the numerics, generalization, first-study and outlier grids (labelled as
studies/admission.py labels them, each against its own study's BF16 seeds); the real pair's are
studies/data/real_results.jsonl and real3e5_results.jsonl (studies/data/real_grid.yaml and
real_grid_lr3e5.yaml say how they were run), one column per learning rate (`smollm2@lr0.0001`, `smollm2@lr3e-05`).

    python studies/transfer.py            # reads the stored results (seconds; --quick is the same)

The last line is `RESULT families=... spearman_<toy>_<real>=... degraded_<family>=...`.
"""
import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from admission import DATA, TOY_FAMILIES, stored_rows  # noqa: E402  (benchmarks/ is not a package)

from opd.study.tolerance import QUALITY, band  # noqa: E402

ESTIMATORS = ("full_rkl", "sampled_pi", "sampled_mu", "sampled_tis")


def per_model(rows: list[dict], family: str, estimator: str) -> dict | None:
    mine = [r for r in rows if r["family"] == family and r["estimator"] == estimator]
    base_rows = [r for r in mine if r["source"] == "bf16"]
    if not base_rows:
        return None
    studies = {r["study"] for r in base_rows}
    out = {"studies": sorted(studies), "points": {}}
    for study in sorted(studies):  # each study's runs against its own BF16 seeds
        group = [r for r in mine if r["study"] == study]
        b = band(group)
        base = [r["after"][QUALITY] for r in group if r["source"] == "bf16"]
        if study == sorted(studies)[0]:
            floors = [r["probe"]["floor_nsr"] for r in group if r["probe"].get("floor_nsr")]
            out |= {"band": b, "sd": statistics.stdev(base) if len(base) > 1 else math.nan,
                    "floor_nsr": statistics.median(floors) if floors else math.nan,
                    "rkl": statistics.median(r["probe"]["rkl"] for r in group if "rkl" in r["probe"])}
        for r in group:
            if r["source"] == "bf16":
                continue
            point = out["points"].setdefault(f"{r['source']}={r['level']}", [])
            point.append({"nsr": r["probe"]["nsr"], "x_floor": r["probe"]["nsr"] / r["probe"]["floor_nsr"]
                          if r["probe"].get("floor_nsr") else math.nan,
                          "kl_k3": r["train"].get("stale/total_kl_k3") or math.nan,
                          "change": r["after"][QUALITY] / b["mean"] - 1, "degraded": bool(r["degraded"])})
    return out


def mean(values) -> float:
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def spearman(a: dict, b: dict) -> tuple[float, int]:
    common = sorted(set(a) & set(b))
    if len(common) < 3:
        return math.nan, len(common)
    rank = lambda d: {k: i for i, k in enumerate(sorted(common, key=lambda k: d[k]))}
    ra, rb = rank(a), rank(b)
    n = len(common)
    return 1 - 6 * sum((ra[k] - rb[k]) ** 2 for k in common) / (n * (n * n - 1)), n


def layer_spread(path: Path = DATA / "real_layers.jsonl") -> dict:
    out = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        row = json.loads(line)
        if "cells" in row:
            cells = row["cells"]
            out[f"{row['model']} {row['setting']}"] = (max(cells) / statistics.median(cells), len(cells))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same: stored results only")
    parser.parse_args()
    # a real pair's grid at each lr is its own column (family@lr...): the lr moved every label (docs/tolerance.md)
    rows = [r if r["family"] in TOY_FAMILIES else r | {"family": f"{r['family']}@lr{r['config']['optim']['lr']:g}"}
            for r in stored_rows()]
    families = sorted({r["family"] for r in rows}, key=lambda f: (f not in TOY_FAMILIES, f))
    result = {"families": ",".join(families)}
    for estimator in ESTIMATORS:
        models = {f: m for f in families if (m := per_model(rows, f, estimator)) is not None}
        if not any(f not in TOY_FAMILIES for f in models):
            continue
        print(f"\n## {estimator}\n")
        print("| model | BF16 seeds: final rkl mean (sd), degraded above | BF16 floor nsr | probe rkl (signal) |")
        print("|---|---|---|---|")
        for f, m in models.items():
            b = m["band"]
            print(f"| {f} | {b['mean']:.4g} ({m['sd']:.2g}, {b['seeds']} seeds), > {b['limit']:.4g} | "
                  f"{m['floor_nsr']:.3g} | {m['rkl']:.3g} |")
        points = sorted({p for m in models.values() for p in m["points"]})
        print("\n| source=level | " + " | ".join(f"{f}: nsr (x floor) / kl_k3 / rkl change" for f in models) + " |")
        print("|---|" + "---|" * len(models))
        for p in points:
            cells = []
            for m in models.values():
                runs = m["points"].get(p)
                if not runs:
                    cells.append("")
                    continue
                bad = sum(r["degraded"] for r in runs)
                cells.append(f"{mean(r['nsr'] for r in runs):.3g} ({mean(r['x_floor'] for r in runs):.2g}x) / "
                             f"{mean(r['kl_k3'] for r in runs):.2g} / {mean(r['change'] for r in runs):+.1%}"
                             + (f" **D{'' if len(runs) == 1 else f' {bad}/{len(runs)}'}**" if bad else ""))
            print(f"| {p} | " + " | ".join(cells) + " |")
        changes = {f: {p: mean(r["change"] for r in runs) for p, runs in m["points"].items()} for f, m in models.items()}
        for f in models:
            order = sorted(changes[f], key=changes[f].get)
            print(f"\n{f}: sources from least to most harm: " + ", ".join(order))
            degraded = sum(r["degraded"] for runs in models[f]["points"].values() for r in runs)
            total = sum(len(runs) for runs in models[f]["points"].values())
            result[f"degraded_{f}_{estimator}"] = f"{degraded}/{total}"
        for real in (f for f in models if f not in TOY_FAMILIES):
            for toy in (f for f in models if f in TOY_FAMILIES):
                rho, n = spearman(changes[toy], changes[real])
                print(f"rank agreement of the rkl change, {toy} vs {real}: Spearman {rho:.2f} over {n} sources=levels")
                result[f"spearman_{toy}_{real}_{estimator}"] = f"{rho:.2f}"
    print("\nper-layer FP8 KV sensitivity spread (most sensitive layer / median layer, studies/real_layers.py):")
    for name, (spread, n) in layer_spread().items():
        print(f"  {name:32} {spread:7.1f}x over {n} layers")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
