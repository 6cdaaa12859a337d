"""The close pair's grid as issue 57's paired trial: its runs' own held-out evaluations at steps 4 and 8.

`studies/data/qwen_grid_lr1e5.yaml` evaluates every run (Qwen2.5-Coder-0.5B under the 1.5B, full_rkl at lr 1e-5)
at steps 4, 8 and 12 on the held-out prompts. A run of seed s and the BF16 run of seed s share prompts and sampling
seeds, so the grid's early evaluations are candidate (b) of issue 57 read at no cost: the candidate's gap to the BF16
run of its seed at step K, over the mean gap of the other BF16 seeds to that one (studies/paired_trial.py's z), and
the run's label at step 12 (opd/study/tolerance.py, by configuration). This script turns the grid's run folders and
results into paired_trial.py's lines, so that its report holds the close pair out beside the others:

    python studies/close_pair.py /work/runs/qwen1e5f --out studies/data/qwen1e5_trials.jsonl      # a sweep's folder
    python studies/close_pair.py --results studies/data/qwen1e5_results.jsonl --runs studies/data/qwen1e5_runs \
        --out studies/data/qwen1e5_trials.jsonl                                                 # the stored copy
    cat studies/data/paired_trial_toys.jsonl studies/data/qwen1e5_trials.jsonl > /tmp/all.jsonl
    python studies/paired_trial.py --report /tmp/all.jsonl

A grid folder: `results.jsonl` (the sweep's results) and `runs/<id>/metrics.jsonl` (each run's log; the stored copy
keeps the same layout in studies/data/qwen1e5_runs, written by the session that ran them). Lines of runs
whose group has fewer than two BF16 seeds carry no z (paired_trial.py skips them).
"""
import argparse
import json
import sys
from pathlib import Path

from opd.admission.trial import mean_nsr
from opd.config.runlog import read_metrics
from opd.study.sweep import read_results
from opd.study.tolerance import label, latest


def trial_lines(results: Path, runs: Path, study: str, quality: str = "fixed") -> list[dict]:
    """paired_trial.py's lines ({key, recipe, pair, source, seed, evals {step: {rkl, entropy}}, nsr, degraded}; nsr:
    the mean opd/nsr of the steps before the first evaluation after step 0, the trial's mismatch gate) of a grid's
    runs (its results file, its folder of run logs), labelled by configuration against the grid's own BF16 seeds.
    quality: what labels a run, its final evaluation "fixed" (eval.contexts fixed: the reverse KL and entropy on the
    contexts every run shares) or "sampled" (its final samples drawn anew: eval/sampled_rkl, eval/sampled_entropy)."""
    rows = latest(read_results(results))
    if quality == "sampled":
        rows = [r | {"after": r["after"] | {"eval/rkl": r["after"]["eval/sampled_rkl"],
                                            "eval/entropy": r["after"]["eval/sampled_entropy"]}} for r in rows]
    rows = label(rows)
    out = []
    for r in rows:
        log = runs / r["id"].replace("/", "__") / "metrics.jsonl"
        if not log.is_file():
            print(f"close_pair: no log for {r['id']} ({log}): skipped", file=sys.stderr)
            continue
        metrics = read_metrics(log.parent)
        evals = {str(m["step"]): {"rkl": m["eval/rkl"], "entropy": m.get("eval/entropy")}
                 for m in metrics if "eval/rkl" in m}
        first = min([int(s) for s in evals if int(s) > 0], default=None)  # the early look: a K-step trial's steps
        recipe = f"{study}|{r['family']}|{r['estimator']}"
        line = {"key": f"{recipe}|{r['source']}|{r['level']}|seed{r['seed']}", "recipe": recipe, "pair": r["family"],
                "source": r["source"], "seed": r["seed"], "evals": evals,
                "nsr": mean_nsr([m for m in metrics if "loss/value" in m and (first is None or m["step"] < first)])}
        if r["source"] != "bf16":
            line["degraded"] = [bool(r["degraded"])] if r["degraded"] is not None else []
        out.append(line)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path, nargs="?", help="the grid's --out folder (results.jsonl, runs/)")
    parser.add_argument("--results", type=Path, help="instead of a folder: the results file ...")
    parser.add_argument("--runs", type=Path, help="... and the folder of run logs")
    parser.add_argument("--study", default="real qwen2.5-coder lr 1e-5")
    parser.add_argument("--quality", choices=("fixed", "sampled"), default="fixed",
                        help="label by the final evaluation on the fixed contexts or on samples drawn anew")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.grid:
        args.results, args.runs = args.grid / "results.jsonl", args.grid / "runs"
    if not (args.results and args.runs):
        parser.error("give the grid's folder, or --results and --runs")
    lines = trial_lines(args.results, args.runs, args.study, args.quality)
    args.out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    bf16 = sum(x["source"] == "bf16" for x in lines)
    print(f"{len(lines)} runs ({bf16} BF16) -> {args.out}; steps evaluated: "
          f"{sorted({int(s) for x in lines for s in x['evals']})}")


if __name__ == "__main__":
    main()
