"""Do token-level criteria of the candidate's rollouts, each relative to the same recipe's BF16 floor, predict a run's
label on a pair they were not fitted on? (issue 57, candidate (c): measured on the probe, before any training.)

From the probe every stored run already carries (16 of the run's prompts sampled by its engine, the student's forward
recomputing the tokens: opd/admission/probe.py), over the synchronous configurations (a stale candidate's probe is
its numerics alone; staleness is judged by the drift budget):

- `drift`: |mean(delta)| (delta = q - mu, the probe's kl_k1), over the BF16 runs' mean of the same: a persistent
  shift of the sampler's log-probs against the trainer's (the drift arXiv 2609.20807 finds destabilizing);
- `magnitude`: mean |delta|, over BF16's;
- `drift_share`: |mean(delta)| / mean |delta|, unitless without a floor: how much of the mismatch is one-signed;
- `clipped`: the share of tokens whose weight exp(delta) lies outside [1/2, 2] (a clipped objective with C = 2
  would clip them only because of the mismatch), less BF16's ("phantom clipping"; the probe stores C = 2 only);
- `ess_loss`: BF16's effective sample size fraction less the candidate's;
- `nsr`: the admission check's statistic over BF16's, for comparison.

Each is decided as `degraded if stat > c`, c fitted on the other pairs' runs (paired_trial.decided: the most right
decisions, an admitted run that degraded counting twice), one pair held out at a time (the far pair's two learning
rates together, then each apart with the same cut), every accuracy beside never-admit and always-admit on the same
runs. The close pair's runs are labelled by their own grid (studies/data/qwen1e5_results.jsonl).

    python studies/token_criteria.py            # the report; reads stored runs only, seconds
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import admission as bench  # noqa: E402 (the stored, labelled runs)
from paired_trial import decided  # noqa: E402 (the studies' cut, fitted and applied)

STATS = ("drift", "magnitude", "drift_share", "clipped", "ess_loss", "nsr")


def criteria(runs: list[dict]) -> list[dict]:
    """One row per synchronous mismatched run: {"pair", "study", "estimator", "degraded", *STATS}, each statistic
    against the mean over its recipe's (study, pair, estimator) BF16 runs' probes."""
    keys = ("kl_k1", "abs_dlogp_mean", "frac_outside", "ess_frac", "nsr")
    runs = [r for r in runs if all(k in r.get("probe", {}) for k in keys)]  # (some outlier BF16 probes lack nsr)
    floors: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["source"] == "bf16":
            floors.setdefault((r["study"], r["family"], r["estimator"]), []).append(r["probe"])
    out = []
    for r in runs:
        base = floors.get((r["study"], r["family"], r["estimator"]))
        if r["source"] == "bf16" or r["staleness"] or not base:
            continue
        f = {k: sum(p[k] for p in base) / len(base) for k in ("abs_dlogp_mean", "frac_outside", "ess_frac", "nsr")}
        f["drift"] = sum(abs(p["kl_k1"]) for p in base) / len(base)
        p = r["probe"]
        out.append({"pair": r["family"], "study": r["study"], "estimator": r["estimator"],
                    "degraded": bool(r["degraded"]), "id": r["id"],
                    "drift": abs(p["kl_k1"]) / max(f["drift"], 1e-12),
                    "magnitude": p["abs_dlogp_mean"] / max(f["abs_dlogp_mean"], 1e-12),
                    "drift_share": abs(p["kl_k1"]) / max(p["abs_dlogp_mean"], 1e-12),
                    "clipped": p["frac_outside"] - f["frac_outside"],
                    "ess_loss": f["ess_frac"] - p["ess_frac"],
                    "nsr": p["nsr"] / max(f["nsr"], 1e-12)})
    return out


def report(table: list[dict], estimators: str = "") -> dict:
    """Each statistic, each pair held out (and each of its studies apart with the same cut); -> RESULT entries."""
    if estimators:
        table = [r for r in table if r["estimator"] in estimators.split(",")]
    result = {}
    for stat in STATS:
        for pair in sorted({r["pair"] for r in table}):
            train = [r for r in table if r["pair"] != pair]
            mine = [r for r in table if r["pair"] == pair]
            studies = sorted({r["study"] for r in mine})
            apart = [(s if pair in s else f"{pair} {s}", [r for r in mine if r["study"] == s]) for s in studies]
            for name, test in [(pair, mine)] + (apart if len(studies) > 1 else []):
                d = decided(train, test, stat)
                print(f"{stat:11} held out {name:26} ({d['n']:3} runs) {stat} > {d['cut']:9.4g}: accuracy "
                      f"{d['accuracy']:.3f}, admitted and degraded {d['admitted_degraded']:.3f} | never-admit "
                      f"{d['never_admit']:.3f}, always-admit {d['always_admit']:.3f}")
                result[f"{stat}_{name.replace(' ', '_')}"] = d["accuracy"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--estimators", default="", help="only these estimators (comma-separated; default all)")
    parser.add_argument("--dump", default="", help="also write each run's statistics here (JSON lines)")
    args = parser.parse_args()
    table = criteria(bench.all_labelled_rows())
    if args.dump:
        Path(args.dump).write_text("".join(json.dumps(r) + "\n" for r in table))
    result = report(table, args.estimators)
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
