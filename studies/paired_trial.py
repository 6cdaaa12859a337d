"""Does a short paired trial's held-out quality predict a run's label on a pair it was not fitted on? (issue 57,
candidate (b), with held-out numbers: each trial is a real K-step run.)

For one stored configuration (pair, estimator, recipe) and its candidate, on the run's own recipe: K steps of the
candidate with seed s and of the BF16 runs of that recipe's seeds (the candidate shares prompts and sampling seeds
with the BF16 run of seed s: common random numbers), each evaluated on the held-out prompts every `--every` steps
(held-out reverse KL and entropy, the labels' own quality measures; by default on fixed contexts, as `opd admit
--trial` measures: opd/admission/trial.py, whose trial_z this study uses). At step k:

    z_rkl = |rkl(candidate, s, k) - rkl(BF16, s, k)| / mean_{s' != s} |rkl(BF16, s', k) - rkl(BF16, s, k)|

(z_entropy the same on the entropy; z = the larger): the early gap in units of the recipe's own seed noise, measured
on the user's model and recipe (learning rate included). The rule `degraded if z > c` takes c from the other pairs
(leave one pair out), the cut with the most right decisions, an admitted run that degraded counting twice; each
accuracy is printed beside never-admit and always-admit on the same runs.

    python studies/paired_trial.py --out studies/data/paired_trial_toys_fixed.jsonl   # the toy pairs' stored
                                                                              # configs, fixed contexts (not run yet)
    python studies/paired_trial.py --contexts sampled --out studies/data/paired_trial_toys.jsonl   # as stored
    python studies/paired_trial.py --quick                                    # one recipe, one candidate: seconds
    python studies/paired_trial.py --pairs smollm2 --estimators full_rkl --steps 4 --every 2 \
        --out studies/data/paired_trial_smollm2.jsonl                        # the far pair at both lrs: 36
                                                                              # trials, ~75 min alone (session 38)
    python studies/paired_trial.py --report studies/data/paired_trial_toys.jsonl  # the accuracies, nothing run

One JSON line per trial run (BF16 seeds and candidates) is appended to --out; one already there is not run again.
"""
import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import admission as bench  # noqa: E402 (the stored, labelled runs)

from opd.admission.trial import (NSR_RATIO, QUANTITIES, TRIAL_CUT, decide, eval_steps,  # noqa: E402 (what `opd
                                  mean_nsr, mismatch, trial_z)  # admit --trial` decides on)
from opd.config.runlog import read_metrics  # noqa: E402
from opd.study.sweep import stored_config  # noqa: E402
from opd.training.trainer import train  # noqa: E402

PAIRS = ("llama", "qwen3", "smollm2")


def trial(cfg, steps: int, every: int, contexts: str = "sampled") -> dict:
    """A K-step run of cfg, evaluated every `every` steps: {step: {rkl, entropy}} and the training curve.
    contexts "fixed": on the fixed contexts of one evaluation seed for the whole recipe (eval.seed 1000; the product's
    `opd admit --trial` measures so), "sampled": sampled anew at each evaluation with the run's seed + 1 (the
    stored toy trials, paired_trial_toys.jsonl)."""
    fixed = {"contexts": "fixed", "seed": 1000, "resample_final": False} if contexts == "fixed" else {}
    cfg = replace(cfg, steps=steps, eval=replace(cfg.eval, every=every, **fixed), save_every=0)
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp) / "run", progress=False)
        rows = read_metrics(Path(tmp) / "run")
    evals = {str(r["step"]): {"rkl": r["eval/rkl"], "entropy": r.get("eval/entropy")}
             for r in rows if "eval/rkl" in r}
    curve = [r.get("loss/rkl_sampled") for r in rows if "loss/value" in r]
    return {"evals": evals, "curve": curve, "nsr": mean_nsr([r for r in rows if "loss/value" in r])}


def gate_ratios(lines: list[dict], rows: list[dict]) -> dict:
    """(candidate line's key, run index) -> (its rollout nsr over its BF16 twin's, where it comes from): the trial's
    own steps where both lines stored an nsr, else the stand-in, the stored study run's probe nsr over its BF16
    floor's (at the initial student; the trial's gate measures at the trial's weights)."""
    twins = {(x["recipe"], x["seed"]): x.get("nsr") for x in lines if x["source"] == "bf16"}
    probes: dict[str, list[dict]] = {}
    for r in rows:
        if r["source"] != "bf16":
            probes.setdefault(f"{r['study']}|{r['family']}|{r['estimator']}|{r['source']}|{r['level']}", []).append(r)
    for runs in probes.values():  # in the order of the line's labels (bench.recipes: by seed)
        runs.sort(key=lambda r: r.get("seed", 0))
    out = {}
    for x in lines:
        if x["source"] == "bf16":
            continue
        twin, key = twins.get((x["recipe"], x["seed"])), x.get("key") or f"{x['recipe']}|{x['source']}|{x['seed']}"
        for i in range(len(x["degraded"])):
            if x.get("nsr") is not None and twin:
                out[(key, i)] = (x["nsr"] / twin, "trial")
            elif key in probes:
                probe = probes[key][min(i, len(probes[key]) - 1)]["probe"]
                if probe.get("nsr") is not None and probe.get("floor_nsr"):
                    out[(key, i)] = (probe["nsr"] / probe["floor_nsr"], "probe")
    return out


def plan_trials(rows: list[dict], pairs: tuple) -> list[dict]:
    """Every trial to run: per recipe (study, pair, estimator) its BF16 seeds, then one candidate run per stored
    configuration (its first seed, with a BF16 seed to pair with)."""
    out = []
    for recipe, runs, points in bench.recipes(rows, pairs):
        bf16 = {r["seed"]: r for r in runs}
        if len(bf16) < 2:
            continue
        family = recipe.split("|")[1]
        out += [{"key": f"{recipe}|bf16|0|seed{s}", "recipe": recipe, "pair": family, "source": "bf16",
                 "seed": s, "row": bf16[s]} for s in sorted(bf16)]
        for (source, level), prs in points.items():
            paired = [r for r in prs if r["seed"] in bf16]
            if not paired:
                continue
            out.append({"key": f"{recipe}|{source}|{level}", "recipe": recipe, "pair": family, "source": source,
                        "seed": paired[0]["seed"], "row": paired[0], "degraded": [bool(r["degraded"]) for r in prs]})
    return out


def z_scores(lines: list[dict], step: str) -> list[dict]:
    """One {pair, degraded, z_rkl, z_entropy, z} per stored run of a candidate line whose recipe has >= 2 BF16 trials
    evaluated at `step`."""
    bf16: dict[str, dict[int, dict]] = {}
    for x in lines:
        if x["source"] == "bf16" and step in x["evals"]:
            bf16.setdefault(x["recipe"], {})[x["seed"]] = x["evals"][step]
    out = []
    for x in lines:
        seeds = bf16.get(x["recipe"], {})
        if x["source"] == "bf16" or step not in x["evals"] or x["seed"] not in seeds or len(seeds) < 2:
            continue
        ref = seeds[x["seed"]]
        if any(e.get(name) is None for e in (ref, x["evals"][step]) for name in ("rkl", "entropy")):
            continue
        as_eval = lambda e: {"eval/rkl": e["rkl"], "eval/entropy": e["entropy"]}  # noqa: E731
        z = trial_z(as_eval(x["evals"][step]), as_eval(ref), [as_eval(e) for s, e in seeds.items() if s != x["seed"]])
        key = x.get("key") or f"{x['recipe']}|{x['source']}|{x['seed']}"
        out += [{"key": (key, i), "pair": x["pair"], "degraded": d, "noise_seeds": z["noise_seeds"],
                 **{k: z[k] for k in ("z_rkl", "z_entropy", "z")}} for i, d in enumerate(x["degraded"])]
    return out


def fit_cut(runs: list[dict], stat: str) -> float:
    """The studies' cut on `stat` (degraded if stat > cut): the one with the most right decisions on these runs, an
    admitted run that degraded counting twice, the lowest of the best."""
    score = lambda c: sum((r[stat] > c) == r["degraded"] for r in runs) - sum(  # noqa: E731
        r[stat] <= c and r["degraded"] for r in runs)
    return max(sorted({r[stat] for r in runs} | {0.0}), key=score)


def held_out(runs: list[dict], pair: str, stat: str) -> dict:
    return decided([r for r in runs if r["pair"] != pair], [r for r in runs if r["pair"] == pair], stat)


def decided(train: list[dict], test: list[dict], stat: str) -> dict:
    """`test` decided by the cut fit_cut fits on `train`: accuracy and admitted-and-degraded share beside the
    trivial rules on the same runs."""
    cut = fit_cut(train, stat)
    n, bad = len(test), sum(r["degraded"] for r in test)
    return {"n": n, "cut": cut, "accuracy": sum((r[stat] > cut) == r["degraded"] for r in test) / n,
            "admitted_degraded": sum(r[stat] <= cut and r["degraded"] for r in test) / n,
            "never_admit": bad / n, "always_admit": 1 - bad / n}


def mean_z(lines: list[dict], k: int) -> tuple[list[dict], list[int]]:
    """The product's statistic at K (opd.admission.trial: z averaged over the evaluations after eval_steps(K)), from
    the stored evaluations among those steps; -> (one row per stored run as z_scores, with "z_mean"; the steps used)."""
    stored = {int(s) for x in lines for s in x["evals"]}
    steps = [s for s in eval_steps(k) if s in stored]
    by_step = [{r["key"]: r for r in z_scores(lines, str(s))} for s in steps]
    keys = set.intersection(*(set(b) for b in by_step)) if by_step else set()
    rows = [by_step[-1][key] | {"z_mean": sum(b[key]["z"] for b in by_step) / len(by_step)}
            for key in sorted(keys)]
    return rows, steps


def pooled_z(lines: list[dict], k: int) -> tuple[list[dict], list[int]]:
    """The pooled z at K (pre-registered in dev/LOG.md, session 38): per quantity, the candidate's gaps to its twin
    summed over the stored evaluations among eval_steps(K), over the mean gap between all pairs of the recipe's BF16
    runs (the twin included) summed over the same evaluations; the larger of reverse KL and entropy. Against the
    shipped mean of per-evaluation ratios, one small seed gap at one evaluation cannot blow it up.
    -> (one row per stored run: {"key", "pair", "recipe", "degraded", "z_pooled"}, the steps used)."""
    from itertools import combinations
    stored = {int(s) for x in lines for s in x["evals"]}
    steps = [str(s) for s in eval_steps(k) if s in stored]
    bf16: dict[str, dict[int, dict]] = {}
    for x in lines:
        if x["source"] == "bf16" and all(s in x["evals"] for s in steps):
            bf16.setdefault(x["recipe"], {})[x["seed"]] = x["evals"]
    out = []
    for x in lines:
        seeds = bf16.get(x["recipe"], {})
        if x["source"] == "bf16" or x["seed"] not in seeds or len(seeds) < 2 or not all(s in x["evals"] for s in steps):
            continue
        z = {}
        for q in QUANTITIES:
            gap = sum(abs(x["evals"][s][q] - seeds[x["seed"]][s][q]) for s in steps)
            pairs = list(combinations(seeds.values(), 2))
            noise = sum(sum(abs(a[s][q] - b[s][q]) for a, b in pairs) / len(pairs) for s in steps)
            z[q] = gap / max(noise, 1e-12)
        key = x.get("key") or f"{x['recipe']}|{x['source']}|{x['seed']}"
        out += [{"key": (key, i), "pair": x["pair"], "recipe": x["recipe"], "degraded": d,
                 "z_pooled": max(z.values())} for i, d in enumerate(x["degraded"])]
    return out, [int(s) for s in steps]


def report_pooled(lines: list[dict]) -> dict:
    """The pooled z's accuracies: its cut fitted on the built-in pairs' runs (both), applied to each real recipe;
    and each pair held out (the cut from the others); beside the shipped cut 3 (two ways) and the trivial rules."""
    result = {}
    for k in sorted({int(s) for x in lines for s in x["evals"] if int(s) > 0}):
        rows, used = pooled_z(lines, k)
        toys = [r for r in rows if r["pair"] in ("llama", "qwen3")]
        if not toys or not rows:
            continue
        cut = fit_cut(toys, "z_pooled")
        for pair in sorted({r["pair"] for r in rows}):
            if any(r["pair"] != pair for r in rows):
                h = held_out([r | {"z": r["z_pooled"]} for r in rows], pair, "z")
                print(f"K={k} pooled z (steps {used}) held out {pair:8} ({h['n']:3} runs) > {h['cut']:.3g}: accuracy "
                      f"{h['accuracy']:.3f}, admitted and degraded {h['admitted_degraded']:.3f} | never-admit "
                      f"{h['never_admit']:.3f}, always-admit {h['always_admit']:.3f}")
                result[f"pooled_k{k}_{pair}"] = h["accuracy"]
        for recipe in sorted({r["recipe"] for r in rows if r["pair"] not in ("llama", "qwen3")}):
            mine = [r for r in rows if r["recipe"] == recipe]
            n, bad = len(mine), sum(r["degraded"] for r in mine)
            for name, c in (("the toys' cut", cut), ("cut 3", TRIAL_CUT)):
                right = sum((r["z_pooled"] > c) == r["degraded"] for r in mine) / n
                unsafe = sum(r["z_pooled"] <= c and r["degraded"] for r in mine) / n
                print(f"K={k} pooled z, {name} {c:.3g}, on {recipe} ({n} runs): accuracy {right:.3f}, admitted and "
                      f"degraded {unsafe:.3f} | never-admit {bad / n:.3f}, always-admit {1 - bad / n:.3f}")
            result[f"pooled_toycut_k{k}_{recipe.split('|')[0].replace(' ', '_')}"] = sum(
                (r["z_pooled"] > cut) == r["degraded"] for r in mine) / n
    return result


def product_verdict(r: dict, ratios: dict | None = None) -> str:
    """`opd admit --trial`'s decision for a stored run (mean_z's row): its z against the shipped cut three ways, then
    the mismatch gate where `ratios` (gate_ratios) has the run."""
    gate = (ratios or {}).get(r["key"])
    if gate is not None and mismatch(gate[0], 1.0)["reject"]:
        return "REJECT"
    return decide(r["z_mean"], r["noise_seeds"], TRIAL_CUT)["decision"]


def report(lines: list[dict], ratios: dict | None = None) -> dict:
    """The accuracies of the stored trial lines; ratios (gate_ratios): the product's rule is also reported with its
    mismatch gate (a candidate whose rollout nsr is more than NSR_RATIO x its twin's is rejected)."""
    result = {}
    steps = sorted({int(s) for x in lines for s in x["evals"] if int(s) > 0})
    for step in steps:
        runs = z_scores(lines, str(step))
        averaged, used = mean_z(lines, step)
        for stat in ("z_rkl", "z_entropy", "z", "z_mean"):
            mine = averaged if stat == "z_mean" else [r for r in runs if stat in r]
            for pair in sorted({r["pair"] for r in mine}):
                if not any(r["pair"] != pair for r in mine):
                    continue
                h = held_out(mine, pair, stat)
                print(f"K={step} {stat:9} held out {pair:8} ({h['n']:3} runs) > {h['cut']:7.3g}: accuracy "
                      f"{h['accuracy']:.3f}, admitted and degraded {h['admitted_degraded']:.3f} | never-admit "
                      f"{h['never_admit']:.3f}, always-admit {h['always_admit']:.3f}")
                result[f"accuracy_k{step}_{stat}_{pair}"] = h["accuracy"]
        for pair in sorted({r["pair"] for r in averaged}):  # the product's rule: its shipped cut, three ways
            mine = [r for r in averaged if r["pair"] == pair]
            verdicts = [product_verdict(r) for r in mine]
            n, bad = len(mine), sum(r["degraded"] for r in mine)
            right = sum((v == "ADMIT") != r["degraded"] for v, r in zip(verdicts, mine)) / n
            unsafe = sum(v == "ADMIT" and r["degraded"] for v, r in zip(verdicts, mine)) / n
            decided = [(v, r) for v, r in zip(verdicts, mine) if v != "UNCERTAIN"]
            among = sum((v == "ADMIT") != r["degraded"] for v, r in decided) / max(1, len(decided))
            full = "" if used == eval_steps(step) else f", of its {eval_steps(step)}"
            print(f"K={step} opd admit --trial (z averaged over the evaluations after steps {used}{full}; cut "
                  f"{TRIAL_CUT:g}, three ways, UNCERTAIN not admitted) {pair:8} ({n:3} runs): accuracy {right:.3f}, "
                  f"admitted and degraded {unsafe:.3f}, UNCERTAIN {verdicts.count('UNCERTAIN') / n:.3f} (right among "
                  f"the decided {among:.3f}) | never-admit "
                  f"{bad / n:.3f}, always-admit {1 - bad / n:.3f}")
            result[f"trial_k{step}_{pair}"] = right
            gated = [(ratios or {}).get(r["key"]) for r in mine]
            if ratios and all(g is not None for g in gated):
                verdicts = [product_verdict(r, ratios) for r in mine]
                right = sum((v == "ADMIT") != r["degraded"] for v, r in zip(verdicts, mine)) / n
                unsafe = sum(v == "ADMIT" and r["degraded"] for v, r in zip(verdicts, mine)) / n
                where = sorted({g[1] for g in gated})
                print(f"K={step} opd admit --trial with its mismatch gate (nsr > {NSR_RATIO:g}x the twin's: REJECT; "
                      f"the ratio from {' and '.join(where)}) {pair:8} ({n:3} runs): accuracy {right:.3f}, admitted "
                      f"and degraded {unsafe:.3f}, UNCERTAIN {verdicts.count('UNCERTAIN') / n:.3f} | never-admit "
                      f"{bad / n:.3f}, always-admit {1 - bad / n:.3f}")
                result[f"trial_gated_k{step}_{pair}"] = right
    return result


def record(lines: list[dict], ratios: dict, k: int = 4) -> dict:
    """The product's rule at K as `opd admit --trial` decides (trial.TRIAL_RECORD, which it prints as its error rate):
    z averaged over the stored evaluations among eval_steps(K), the shipped cut three ways, the mismatch gate where a
    run has a ratio (gate_ratios); per pair -> {runs, admitted, admitted_degraded, rejected, rejected_fine}."""
    rows, _ = mean_z(lines, k)
    out = {}
    for r in rows:
        verdict = product_verdict(r, ratios)
        x = out.setdefault(r["pair"], dict.fromkeys(("runs", "admitted", "admitted_degraded", "rejected",
                                                     "rejected_fine"), 0))
        x["runs"] += 1
        x["admitted"] += verdict == "ADMIT"
        x["admitted_degraded"] += verdict == "ADMIT" and r["degraded"]
        x["rejected"] += verdict == "REJECT"
        x["rejected_fine"] += verdict == "REJECT" and not r["degraded"]
    return out


def read_lines(path: Path | None) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path and path.is_file() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="append one line per trial run here (resumes)")
    parser.add_argument("--pairs", default="llama,qwen3", help="comma-separated pairs to run")
    parser.add_argument("--studies", default="", help="comma-separated stored studies to run (default: all)")
    parser.add_argument("--estimators", default="", help="comma-separated estimators to run (default: all)")
    parser.add_argument("--steps", type=int, default=6, help="K: steps of each trial")
    parser.add_argument("--every", type=int, default=2, help="held-out evaluation every this many steps")
    parser.add_argument("--report", default="", help="only print the accuracies of this file's lines")
    parser.add_argument("--contexts", choices=("sampled", "fixed"), default="fixed",
                        help="held-out evaluation on fixed contexts (as `opd admit --trial`) or sampled anew")
    parser.add_argument("--quick", action="store_true", help="one recipe's BF16 seeds and one candidate, 2 steps")
    parser.add_argument("--record", action="store_true", help="with --report (comma-separated files): the product's "
                        "rule at K = 4 per pair, as trial.TRIAL_RECORD")
    args = parser.parse_args()
    if args.report and args.record:
        lines = [x for f in args.report.split(",") for x in read_lines(Path(f))]
        print(json.dumps(record(lines, gate_ratios(lines, bench.stored_rows())), indent=1))
        return
    if args.report:
        lines = read_lines(Path(args.report))
        result = report(lines, gate_ratios(lines, bench.stored_rows())) | report_pooled(lines)
        print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))
        return
    rows = bench.stored_rows()
    if args.studies:
        rows = [r for r in rows if r["study"] in args.studies.split(",")]
    if args.estimators:
        rows = [r for r in rows if r["estimator"] in args.estimators.split(",")]
    todo = plan_trials(rows, tuple(args.pairs.split(",")))
    if args.quick:
        first = todo[0]["recipe"]
        todo = [t for t in todo if t["recipe"] == first]
        todo = [t for t in todo if t["source"] == "bf16"][:2] + [t for t in todo if t["source"] != "bf16"][:1]
        args.steps, args.every = 2, 2
    out = Path(args.out) if args.out and not args.quick else None
    done = {x["key"] for x in read_lines(out)}
    todo = [t for t in todo if t["key"] not in done]
    lines = []
    for n, t in enumerate(todo):
        start = time.perf_counter()
        line = {k: v for k, v in t.items() if k != "row"} | trial(stored_config(t["row"]), args.steps, args.every,
                                                                      args.contexts) \
            | {"steps": args.steps, "contexts": args.contexts, "seconds": time.perf_counter() - start}
        lines.append(line)
        last = line["evals"][max(line["evals"], key=int)]
        print(f"[{n + 1}/{len(todo)}] {t['key']}: held-out rkl {last['rkl']:.4g} entropy {last['entropy']:.4g} at "
              f"step {max(line['evals'], key=int)} ({line['seconds']:.0f} s)", flush=True)
        if out:
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")
    lines = read_lines(out) if out else lines
    result = report(lines, gate_ratios(lines, bench.stored_rows()))
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()) if result else
          f"RESULT trials={len(lines)}")


if __name__ == "__main__":
    main()
