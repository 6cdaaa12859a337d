"""The tolerance study's analysis: which runs degraded, where the knee is, and the plots. Reads only sweep results.

**Quality** is the held-out mean per-token reverse KL to the teacher after training (`eval/rkl`, lower is better;
exact-match accuracy is reported beside it but is too coarse on 100 prompts to decide with). **Mismatch** is what
the run measured, not what it was configured with: `stale/total_kl_k3` averaged over training, the k3 estimate of
KL(rollout engine || current learner), which covers numerics and staleness alike; for the teacher study's runs
(a teacher scored by an engine: teacher.py) the teacher side's exact `teacher_mismatch/kl_exact` (its k3 estimate is
a poor axis there: the tokens are the student's, not the teacher's), and for a top-k teacher the tail mass its k
tokens leave (`teacher_mismatch/tail_mass`).

**Degraded**, per family and estimator: the BF16 runs (source `bf16`, several seeds) span [lo, hi] in final reverse
KL. A configuration is degraded when the mean final reverse KL of its seeds exceeds hi by more than that spread, or
by 5% of the BF16 mean if the spread is narrower:  rkl > hi + max(hi - lo, 0.05 * mean).  A few seeds understate
the spread, hence the margin. Each of its runs carries the configuration's label (`label(by="run")`: its own).
A configuration is also degraded when its student **collapsed**: the mean held-out entropy of its seeds' samples
(`eval/entropy`, recorded since 2026-12-05) is under COLLAPSE (1/4) of the lowest BF16 seed's. The reverse KL alone
rewards collapse onto a string the teacher finds likely: on the smollm2 pair sampled_mu at staleness 8 ended with
every held-out sample one token repeated (p = 1.0) at a reverse KL inside the BF16 band (docs/tolerance.md).

**The knee** of a source (per family and estimator): the mismatch cut that puts the fewest of its runs (and the BF16
runs) on the wrong side, fine below and degraded above: the geometric middle of the widest gap among equally good
cuts, the same rule that calibrates the admission check (thresholds.best_cut). Runs on the wrong side are counted
(`misplaced`): a fine run above a degraded one is seed noise, or a source that does not act through the mismatch
alone. A source none of whose levels degraded has no knee; that, with the largest mismatch it reached, is a finding.
"""
import json
import math
from pathlib import Path

from opd.health.rules import decide_numbers
from opd.config.files import stored_teacher
from opd.io.errors import require
from opd.io.figures import pyplot, save
from opd.config.runlog import write_atomic
from opd.health.thresholds import best_cut, calibrate_teacher, is_teacher_side

QUALITY, MISMATCH, ENTROPY = "eval/rkl", "stale/total_kl_k3", "eval/entropy"
COLLAPSE = 0.25  # a student whose samples' entropy fell under this share of every BF16 seed's collapsed
# the teacher study's axes: the exact KL(teacher engine || trainer's teacher) per position (the k3 estimate on the
# student's tokens is dominated by tokens the teacher finds unlikely, where a low-precision teacher errs most), and
# for a top-k teacher the mass its k tokens leave
TEACHER_MISMATCH, TOPK_MISMATCH = "teacher_mismatch/kl_exact", "teacher_mismatch/tail_mass"
MARKERS = {"bf16": "o", "kv": "s", "kv_trunc": "P", "noise": "^", "staleness": "D", "weights": "v"}


def groups(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for row in latest(rows):
        out.setdefault((row["family"], row["estimator"]), []).append(row)
    return out


def latest(rows: list[dict]) -> list[dict]:
    """One row per run id: the last one written (a re-run after a grid change replaces the older line)."""
    return list({row["id"]: row for row in rows}.values())


def band(rows: list[dict]) -> dict | None:
    base = [r["after"][QUALITY] for r in rows if r["source"] == "bf16"]
    if not base:
        return None
    lo, hi, mean = min(base), max(base), sum(base) / len(base)
    return {"lo": lo, "hi": hi, "mean": mean, "limit": hi + max(hi - lo, 0.05 * mean), "seeds": len(base)}


def label(rows: list[dict], by: str = "config") -> list[dict]:
    """The latest rows with `degraded` (None where the group has no BF16 runs to compare with) and `mismatch`.
    by="config": a run is labelled by its configuration (source and level), the mean final reverse KL of its seeds
    against the band: the outcome the check predicts is the configuration's, and one seed of it is that plus seed
    noise (on the smollm2 pair at lr 3e-5 the three FP8-e5m2 seeds ended at 0.468, 0.398 and 0.385 against BF16's
    0.415-0.435). by="run": each run on its own final reverse KL."""
    require(by in ("config", "run"), f"unknown labelling {by!r}", "use config or run")
    out = []
    for group in groups(rows).values():
        b, floor = band(group), entropy_floor(group)
        seeds: dict[tuple, list[dict]] = {}
        for row in group:
            seeds.setdefault(configuration(row), []).append(row["after"])
        for row in group:
            mismatch = mismatch_of(row)
            after = seeds[configuration(row)] if by == "config" else [row["after"]]
            value = sum(a[QUALITY] for a in after) / len(after)
            entropy = [a[ENTROPY] for a in after if a.get(ENTROPY) is not None]
            collapsed = None if floor is None or len(entropy) < len(after) else \
                sum(entropy) / len(entropy) < COLLAPSE * floor
            out.append(row | {"degraded": None if b is None else value > b["limit"] or bool(collapsed),
                              "collapsed": collapsed, "mismatch": mismatch if mismatch is not None else math.nan})
    return out


def label_odds(rows: list[dict], draws: int = 4000, seed: int = 0, config_seeds: int = 0,
               bf16_seeds: int = 0) -> dict[tuple, dict]:
    """How firm each configuration's label is: the chance that running its seeds and the BF16 seeds again, as many of
    each, would label it degraded. Each run's final reverse KL is redrawn as normal around its configuration's mean
    (the observed mean taken for the true one) and label()'s rule applied to the draws. Two spreads, since a few seeds
    estimate it poorly: the BF16 seeds' own (`p_bf16`), and the pooled spread within every configuration of two or
    more seeds, BF16 included (`p_pooled`: mismatched runs may spread wider than the BF16 ones). A collapsed
    configuration keeps its label (p = 1). `config_seeds` / `bf16_seeds`: redraw every configuration / the BF16 band
    with that many seeds (0: as many as stored), what more seeds would buy. -> {(family, estimator, source, level):
    {"runs", "degraded", "p_bf16", "p_pooled"}} over the groups with at least two BF16 seeds; BF16 ones left out."""
    import numpy as np
    rng, out = np.random.default_rng(seed), {}
    for (family, estimator), group in groups(rows).items():
        seeds: dict[tuple, list[float]] = {}
        for row in group:
            seeds.setdefault(configuration(row), []).append(row["after"][QUALITY])
        base = seeds.get(("bf16", "0"), [])
        if len(base) < 2:
            continue
        multi = [v for v in seeds.values() if len(v) > 1]
        spreads = {"p_bf16": float(np.std(base, ddof=1)),
                   "p_pooled": float(np.sqrt(np.mean([np.var(v, ddof=1) for v in multi])))}
        labelled = {configuration(r): r for r in label(group)}
        entries = {c: {"runs": len(v), "degraded": bool(labelled[c]["degraded"])} for c, v in seeds.items()
                   if c != ("bf16", "0")}
        for name, sd in spreads.items():
            b = np.mean(base) + sd * rng.standard_normal((draws, bf16_seeds or len(base)))
            hi, lo = b.max(axis=1), b.min(axis=1)
            limit = hi + np.maximum(hi - lo, 0.05 * b.mean(axis=1))
            for c, entry in entries.items():
                if labelled[c]["collapsed"]:
                    entry[name] = 1.0
                    continue
                mean = np.mean(seeds[c]) + sd / math.sqrt(config_seeds or len(seeds[c])) * rng.standard_normal(draws)
                entry[name] = float(np.mean(mean > limit))
        out |= {(family, estimator) + c: e for c, e in entries.items()}
    return out


def label_ceiling(entries: list[dict], p: str = "p_pooled") -> tuple[float, float]:
    """-> (the accuracy no rule can expect to beat on these runs' labels were they run again: each configuration's
    runs counted right with the likelier label's chance, max(p, 1 - p); the share of runs whose configuration is a
    coin flip, 0.1 < p < 0.9) over label_odds() entries."""
    n = sum(e["runs"] for e in entries)
    if not n:
        return math.nan, math.nan
    return (sum(e["runs"] * max(e[p], 1 - e[p]) for e in entries) / n,
            sum(e["runs"] for e in entries if 0.1 < e[p] < 0.9) / n)


def entropy_floor(rows: list[dict]) -> float | None:
    """The lowest held-out sample entropy among the BF16 seeds (None unless every one recorded it)."""
    base = [r["after"].get(ENTROPY) for r in rows if r["source"] == "bf16"]
    return min(base) if base and None not in base else None


def configuration(row: dict) -> tuple:
    """What a run's seeds share inside its (family, estimator) group: its source and level."""
    return row["source"], str(row["level"])


def mismatch_of(row: dict) -> float | None:
    """The run's measured mismatch: the rollouts' (MISMATCH) or, for the teacher study's runs, the teacher side's
    (TEACHER_MISMATCH; a top-k teacher's: the mass its k tokens leave)."""
    train = row["train"]
    if is_teacher_side(row):
        if stored_teacher(row.get("config", {})).topk:
            return train.get(TOPK_MISMATCH, math.nan)
        return train.get(TEACHER_MISMATCH, train.get("teacher_mismatch/kl_k3", math.nan))
    return train.get(MISMATCH, train.get("mismatch/kl_k3", math.nan))


def teacher_thresholds(rows: list[dict]) -> dict | None:
    """A thresholds file's `teacher` entry from the teacher study's results (labelled here against their BF16 seeds;
    thresholds.calibrate_teacher)."""
    return calibrate_teacher([r for r in label(rows) if r["degraded"] is not None and is_teacher_side(r)])


def knees(rows: list[dict]) -> list[dict]:
    """Per (family, estimator, source): the knee, or the largest mismatch reached without degrading."""
    out = []
    labelled = label(rows)
    for (family, estimator), group in groups(labelled).items():
        for source in sorted({r["source"] for r in group} - {"bf16"}):
            # a teacher-side source's BF16 runs would sit at 0 (their teacher is the trainer's), where no knee can
            # be placed: its own runs alone (a knee below all of them is then an upper bound)
            both = (source,) if source.startswith("teacher_") else (source, "bf16")
            points = sorted((r["mismatch"], bool(r["degraded"])) for r in group
                            if r["source"] in both and r["degraded"] is not None)
            entry = {"family": family, "estimator": estimator, "source": source,
                     "max_mismatch": max(m for m, _ in points) if points else None}
            cut = best_cut(points, cost=1.0) if any(bad for _, bad in points) else None
            first_bad = min((m for m, bad in points if bad and m > cut["max"]), default=None) if cut else None
            if first_bad is None:  # nothing degraded, or only runs the best cut calls noise (below fine ones)
                entry |= {"knee": None, "misplaced": sum(bad for _, bad in points),
                          "note": "no knee up to the largest level"}
            else:
                entry |= {"knee": cut["max"], "misplaced": cut["errors"], "first_degraded": first_bad,
                          "last_fine": max((m for m, bad in points if not bad and m <= cut["max"]), default=None)}
            out.append(entry)
    return out


def _two(value) -> str:
    """A number to two places, or "-" where a run did not measure it (eval.greedy off and no sampled scoring)."""
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[dict]) -> str:
    """Markdown: one line per run, grouped, with the BF16 band."""
    lines = ["| family | estimator | source | level | seed | total_kl_k3 | rkl before -> after | accuracy after | "
             "degraded |", "|---|---|---|---|---|---|---|---|---|"]
    for (family, estimator), group in groups(label(rows)).items():
        for r in sorted(group, key=lambda r: (r["source"] != "bf16", r["source"], r["mismatch"], r["seed"])):
            flag = "**yes (collapsed)**" if r["collapsed"] else {None: "-", True: "**yes**", False: "no"}[r["degraded"]]
            lines.append(f"| {family} | {estimator} | {r['source']} | {r['level']} | {r['seed']} | "
                         f"{r['mismatch']:.2g} | {r['before'][QUALITY]:.3f} -> {r['after'][QUALITY]:.3f} | "
                         f"{_two(r['after'].get('eval/accuracy'))} | {flag} |")
    return "\n".join(lines)


def pivot(rows: list[dict]) -> str:
    """Markdown: one line per source=level, one column per family/estimator; a cell is the final reverse KL (mean over
    seeds, with the seeds' range when there are several), the measured mismatch, and how many runs degraded."""
    labelled = groups(label(rows))
    columns = sorted(labelled)
    points = sorted({(r["source"], str(r["level"])) for g in labelled.values() for r in g},
                    key=lambda p: (p[0] != "bf16", p[0], _number(p[1]), p[1]))  # total: not the set's order
    lines = ["| source = level | " + " | ".join(f"{f} / {e}" for f, e in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for source, level in points:
        cells = []
        for key in columns:
            runs = [r for r in labelled[key] if (r["source"], str(r["level"])) == (source, level)]
            if not runs:
                cells.append("")
                continue
            q = [r["after"][QUALITY] for r in runs]
            bad = sum(bool(r["degraded"]) for r in runs)
            spread = f" [{min(q):.3f}-{max(q):.3f}]" if len(q) > 1 else ""
            mark = f" **{bad}/{len(runs)} degraded**" if bad else ""
            cells.append(f"{sum(q) / len(q):.3f}{spread} @ {sum(r['mismatch'] for r in runs) / len(runs):.1e}{mark}")
        lines.append(f"| {source} = {level} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.inf if text.startswith("fp8_e5") else -math.inf  # fp8_e4m3 before fp8_e5m2


def fp8_answer(rows: list[dict]) -> list[str]:
    """Does FP8-e4m3 KV stay inside BF16's seed spread? One line per family and estimator."""
    out = []
    for (family, estimator), group in groups(rows).items():
        b = band(group)
        for r in sorted(group, key=lambda r: r["seed"]):
            if b and r["source"] == "kv" and r["level"] == "fp8_e4m3":
                q = r["after"][QUALITY]
                where = "inside" if b["lo"] <= q <= b["hi"] else ("below (better than)" if q < b["lo"] else
                                                                    "above" if q > b["limit"] else
                                                                    "above the spread but within the margin of")
                out.append(f"{family}/{estimator} seed {r['seed']}: FP8-e4m3 KV rkl {q:.3f} is {where} the BF16 seeds' "
                           f"[{b['lo']:.3f}, {b['hi']:.3f}]")
    return out


def confusion(decisions: list[tuple[dict, bool]]) -> dict:
    """(labelled run, admitted) pairs -> the four counts "admitted & fine", "admitted & degraded", ..."""
    counts = {"admitted & fine": 0, "admitted & degraded": 0, "rejected & fine": 0, "rejected & degraded": 0}
    for row, admitted in decisions:
        counts[f"{'admitted' if admitted else 'rejected'} & {'degraded' if row['degraded'] else 'fine'}"] += 1
    return counts


def accuracy(counts: dict) -> float:
    return (counts["admitted & fine"] + counts["rejected & degraded"]) / max(1, sum(counts.values()))


def out_of_sample(rows: list[dict], thresholds: dict, sources: tuple[str, ...]) -> tuple[list[dict], dict]:
    """The admission check's decision on each labelled run of `sources`, from the probe and max_staleness the run
    stored -> (the runs with `admitted` and `limit`, the BF16 band's line on final quality; confusion's counts).
    The benchmarks that test thresholds on runs they were not calibrated on use it."""
    decided = []
    for group in groups(label(rows)).values():
        b = band(group)
        for row in group:
            if row["source"] in sources and b is not None:
                admitted = decide_numbers(row["probe"], thresholds, row["class"], row["staleness"],
                                  lr=row["config"]["optim"]["lr"]).admit
                decided.append(row | {"admitted": admitted, "limit": b["limit"]})
    return decided, confusion([(row, row["admitted"]) for row in decided])


def result_line(counts: dict) -> str:
    """`RESULT agreement=... runs=... admitted_degraded=... rejected_fine=...` of confusion's counts."""
    return (f"RESULT agreement={accuracy(counts):.3f} runs={sum(counts.values())} "
            f"admitted_degraded={counts['admitted & degraded']} rejected_fine={counts['rejected & fine']}")


def report(rows: list[dict], out: Path) -> str:
    """Write knees.json and the two plots into out; return the text summary."""
    require(bool(rows), f"no sweep results to analyse in {out}", "run `opd sweep` first")
    out.mkdir(parents=True, exist_ok=True)
    found = knees(rows)
    write_atomic(out / "knees.json", json.dumps(found, indent=2))
    plot_quality(rows, out / "quality_vs_mismatch.png")
    plot_curves(rows, out / "curves.png")
    lines = [table(rows), "", pivot(rows), "", "knees (total_kl_k3 averaged over training):"]
    for k in found:
        lines.append(f"  {k['family']}/{k['estimator']}/{k['source']}: " + (
            f"knee ~{k['knee']:.2g} (fine up to {k['last_fine'] or 0:.2g}, degraded from {k['first_degraded'] or 0:.2g}"
            f"; {k['misplaced']} run(s) on the wrong side)"
            if k["knee"] is not None else f"no knee up to {k['max_mismatch']:.2g}"
            + (f" ({k['misplaced']} degraded run(s) below fine ones: noise)" if k["misplaced"] else "")))
    lines += ["", *fp8_answer(rows), "", f"plots: {out / 'quality_vs_mismatch.png'}, {out / 'curves.png'}"]
    return "\n".join(lines)


def _figure(rows: list[dict]):
    keys = sorted(groups(rows))
    families = sorted({f for f, _ in keys})
    estimators = sorted({e for _, e in keys})
    fig, axes = pyplot().subplots(len(families), len(estimators), figsize=(5 * len(estimators), 4 * len(families)),
                             squeeze=False)
    return fig, {(f, e): axes[i][j] for i, f in enumerate(families) for j, e in enumerate(estimators)}


def _label(text: str) -> str:
    """Text for a figure: a `$` would start matplotlib's math mode."""
    return text.replace("$", "\\$")


def plot_quality(rows: list[dict], path: Path) -> None:
    """Final reverse KL vs measured mismatch: one marker per source, every seed its own point, the BF16 band."""
    fig, axes = _figure(rows)
    labelled = groups(label(rows))
    for key, ax in axes.items():
        group = labelled.get(key, [])
        b = band(group)
        if b:
            ax.axhspan(b["lo"], b["hi"], color="tab:green", alpha=0.15, label="BF16 seed spread")
            ax.axhline(b["limit"], color="tab:red", lw=0.8, ls="--", label="degraded above")
        for source in sorted({r["source"] for r in group}):
            pts = [(max(r["mismatch"], 1e-7), r["after"][QUALITY]) for r in group if r["source"] == source]
            ax.scatter(*zip(*pts), marker=MARKERS.get(source, "x"), label=_label(source), alpha=0.8)
        for k in knees(rows):
            if (k["family"], k["estimator"]) == key and k["knee"] is not None:
                ax.axvline(k["knee"], color="gray", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")  # collapsed runs sit orders of magnitude above the rest
        ax.set(title=_label(f"{key[0]} / {key[1]}"), xlabel="rollout vs learner KL (total_kl_k3, mean over training)",
               ylabel="held-out reverse KL to teacher (after)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def plot_curves(rows: list[dict], path: Path) -> None:
    """Training curves (sampled reverse KL per step) of every run, coloured by source."""
    fig, axes = _figure(rows)
    colors = {}
    for key, ax in axes.items():
        for r in sorted(groups(rows).get(key, []), key=lambda r: r["source"]):
            color = colors.setdefault(r["source"], f"C{len(colors)}")
            ax.plot(r["curve"]["step"], r["curve"]["rkl_sampled"], color=color, alpha=0.7, lw=1,
                    label=_label(f"{r['source']}={r['level']}"))
        ax.set_yscale("symlog", linthresh=0.1)  # a sampled estimate: it can dip below zero
        ax.set(title=_label(f"{key[0]} / {key[1]}"), xlabel="step", ylabel="reverse KL on the rollouts (sampled)")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save(fig, path)

