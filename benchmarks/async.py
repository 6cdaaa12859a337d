"""Optimizer steps per second: the asynchronous schedule (max_staleness 1 and 2) vs the synchronous one.

Every run distills the same built-in pair (pretrained and cached on first use) with the same config (batch size,
the task's 105 new tokens, BF16 rollouts, full-vocabulary reverse KL, seed) for the same number of steps, through
`opd.training.trainer.train`, so a step is everything the product does: sampling, teacher scoring, learner forward and
backward, optimizer, per-step metrics, logging, weight publishing. The CPU budget is the same: `threads` (2) for
sync; async gives the rollout worker one thread and the trainer the rest. Throughput is steps over the summed step
times of the steps after `--warmup` (the pipeline fill and first-call costs excluded on both sides); evaluations are
not timed. Sync runs twice, first and last, and its throughput is the mean of the two, to share the machine's drift.
`speedup` is the best async throughput over sync's.

    python benchmarks/async.py            # what docs/benchmarks.md quotes
    python benchmarks/async.py --quick    # ~1 minute after the pair is cached

The last line is `RESULT key=value ...`.
"""
import argparse
import json
import os
import tempfile

from opd.config.files import build_config
from opd.config.runlog import read_metrics
from opd.training.trainer import train


def steps_per_second(run_dir, warmup: int) -> tuple[float, dict]:
    rows = [r for r in read_metrics(run_dir) if "time/step" in r][warmup:]
    seconds = sum(r["time/step"] for r in rows)
    waits = sum(r.get("time/rollout_wait", 0.0) for r in rows)
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)  # noqa: E731
    return len(rows) / seconds, {"trainer_idle": waits / seconds, "generate_s": mean("time/generate"),
                                 "recompute_s": mean("time/recompute"),
                                 "train_s": mean("time/teacher") + mean("time/train")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and a smaller batch")
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    steps = args.steps or (12 if args.quick else 30)
    batch = args.batch_size or (32 if args.quick else 64)
    base = {"family": args.family, "steps": steps, "batch_size": batch, "eval": {"every": 0, "examples": 16},
            "save_every": 0, "threads": 2}
    runs = [("sync", {}), ("async_k1", {"schedule": "async", "async": {"max_staleness": 1}}),
            ("async_k2", {"schedule": "async", "async": {"max_staleness": 2}}), ("sync_again", {})]
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in runs:
            run_dir = os.path.join(root, name)
            summary = train(build_config(base | overrides), run_dir, progress=False)
            results[name], extra = steps_per_second(run_dir, args.warmup)
            print(f"{name:>10}: {results[name]:.3f} steps/s  trainer idle {extra['trainer_idle']:.0%}  "
                  f"generate {extra['generate_s']:.2f} recompute {extra['recompute_s']:.2f} "
                  f"teacher+train {extra['train_s']:.2f} s  accuracy after {summary['after']['eval/accuracy']:.3f}"
                  + (f"  requeued {summary['async/requeued']}" if "async/requeued" in summary else ""), flush=True)
    sync = (results["sync"] + results["sync_again"]) / 2
    k1, k2 = results["async_k1"] / sync, results["async_k2"] / sync
    print(json.dumps({"family": args.family, "batch_size": batch, "steps": steps, "warmup": args.warmup,
                      "steps_per_s": results}))
    print(f"RESULT speedup={max(k1, k2):.2f} speedup_k1={k1:.2f} speedup_k2={k2:.2f} "
          f"sync_steps_per_s={sync:.3f} sync_drift={results['sync_again'] / results['sync']:.2f}")


if __name__ == "__main__":
    main()
