"""Does a short paired trial predict a run's label on a pair it was not fitted on? (issue 57, candidate (b), first
look, on stored curves only: no model runs.)

Every stored run logs its training batch's sampled reverse KL at each step (`curve.rkl_sampled`). A run of seed s and
the BF16 run of the same seed share prompts and sampling seeds (common random numbers); the other BF16 seeds of the
same recipe give the noise. The statistic after K steps:

    z = (mean_{k<K} rkl(candidate, s) - mean_{k<K} rkl(BF16, s)) / mean_{s' != s} |mean_{k<K} rkl(BF16, s') - rkl(BF16, s)|

a gap in units of the recipe's own seed noise, measured on the user's model and recipe. The rule `degraded if |z| > c`
takes its cut c from the other pairs (leave one pair out: llama, qwen3, smollm2), the cut with the most right
decisions, an admitted run that degraded counting twice. Each accuracy is printed beside never-admit and
always-admit on the same runs. The sign is not used: on the toys a degraded run's training reverse KL rises above
BF16's, on the smollm2 pair it falls below it (its own mismatched rollouts are easier: dev/LOG.md 2026-12-06).

    python studies/early_trial.py          # seconds (--quick: the same)
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import admission as bench  # noqa: E402 (the stored, labelled runs)

PAIRS = ("llama", "qwen3", "smollm2")
STEPS = (2, 4, 6, 8)


def z_scores(rows: list[dict], k: int) -> list[dict]:
    """One {pair, staleness, degraded, z} per scored run whose recipe has two BF16 seeds or more."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["study"], r["family"], r["estimator"]), []).append(r)
    out = []
    for group in groups.values():
        bf16 = {r["seed"]: r["curve"]["rkl_sampled"] for r in group if r["source"] == "bf16"}
        if len(bf16) < 2:
            continue
        head = lambda curve: sum(x for x in curve[:k] if x is not None) / k  # noqa: E731
        for r in group:
            if r["source"] == "bf16" or len(r["curve"]["rkl_sampled"]) < k:
                continue
            ref = r["seed"] if r["seed"] in bf16 else min(bf16)
            noise = statistics.mean(abs(head(bf16[s]) - head(bf16[ref])) for s in bf16 if s != ref)
            gap = head(r["curve"]["rkl_sampled"]) - head(bf16[ref])
            out.append({"pair": r["family"], "staleness": r["staleness"], "degraded": r["degraded"],
                        "z": abs(gap) / max(noise, 1e-12)})
    return out


def held_out(runs: list[dict], pair: str) -> dict:
    train, test = [r for r in runs if r["pair"] != pair], [r for r in runs if r["pair"] == pair]
    score = lambda c, rs: sum((r["z"] > c) == r["degraded"] for r in rs) - sum(  # noqa: E731
        r["z"] <= c and r["degraded"] for r in rs)
    cut = max(sorted({r["z"] for r in train}), key=lambda c: score(c, train))
    n, degraded = len(test), sum(r["degraded"] for r in test)
    return {"pair": pair, "n": n, "cut": cut, "accuracy": sum((r["z"] > cut) == r["degraded"] for r in test) / n,
            "admitted_degraded": sum(r["z"] <= cut and r["degraded"] for r in test) / n,
            "never_admit": degraded / n, "always_admit": 1 - degraded / n}


def main() -> None:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same: it reads stored runs only")
    parser.parse_args()
    rows = bench.stored_rows()
    result = {}
    for k in STEPS:
        runs = z_scores(rows, k)
        for pair in PAIRS:
            h = held_out(runs, pair)
            print(f"K={k} held out {pair:8} ({h['n']:3} runs) |z| > {h['cut']:6.2f}: accuracy {h['accuracy']:.3f}, "
                  f"admitted and degraded {h['admitted_degraded']:.3f} | never-admit {h['never_admit']:.3f}, "
                  f"always-admit {h['always_admit']:.3f}")
            result[f"accuracy_k{k}_{pair}"] = h["accuracy"]
    print("RESULT " + " ".join(f"{key}={value:.3f}" for key, value in result.items()))


if __name__ == "__main__":
    main()
