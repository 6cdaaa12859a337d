"""The Ray backend's cost and scaling: rollout throughput on 1 and 2 Ray rollout actors (one CPU each) against the
in-process engine, and the OPD step time of `async.backend: ray` against the process backend at equal settings.

Rollout throughput: batches of the built-in pair's prompts (BF16 rollouts, the task's new tokens), dispatched at
once through the async schedule (its window opened to all of them, no weights published between; one warm-up batch
first), so the actors sample back to back; tokens per second from the dispatch to the last batch in. One actor
samples each batch whole; two actors take whole batches in turn (sampling.shards = 1: `rollout_scaling_2w`), or
split every batch in two (the default shards = 2: `rollout_scaling_2w_split`), each over one actor's tokens/s. The
in-process engine is SyncRollouts with one thread.

Step time: the same short async run (max_staleness 1, one rollout worker with one thread, the trainer one thread)
with the process backend and with the Ray backend; the mean `time/step` after `--warmup` steps. `ray_overhead` = Ray
step time / process step time.

Ray runs a local cluster of 2 CPUs bound to 127.0.0.1, inside a network namespace with only loopback: the script
re-runs itself under `unshare -n` (as root) when it is not in one.

    python benchmarks/ray_scale.py            # what docs/benchmarks.md quotes
    python benchmarks/ray_scale.py --quick    # under a minute

The last line is `RESULT key=value ...`.
"""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time


def loopback_only() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def rollout_throughput(cfg, batches: int) -> float:
    """Tokens per second sampling `batches` batches through the config's rollouts (sync: one after another)."""
    from opd.training.setup import setup
    run = setup(cfg)
    weights = {k: v.detach().clone() for k, v in run.student.state_dict().items()}
    run.rollouts.start(weights, 0, {})
    try:
        lookahead = getattr(run.rollouts, "lookahead", 0)
        if lookahead:
            run.rollouts.lookahead = 0  # the warm-up batch alone in flight
        run.rollouts.next_batch(0, 0)  # warm up (first calls build caches), then time from the dispatch of the rest
        if lookahead:
            run.rollouts.lookahead = lookahead
        start, tokens = time.perf_counter(), 0
        for step in range(1, batches + 1):
            tokens += sum(len(r.completion_ids) for r in run.rollouts.next_batch(step, 0).rollouts)
        return tokens / (time.perf_counter() - start)
    finally:
        run.rollouts.close()


def step_time(cfg, warmup: int) -> float:
    from opd.config.runlog import read_metrics
    from opd.training.trainer import train
    with tempfile.TemporaryDirectory() as root:
        train(cfg, os.path.join(root, "run"), progress=False)
        rows = [r for r in read_metrics(os.path.join(root, "run")) if "time/step" in r][warmup:]
    return sum(r["time/step"] for r in rows) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and steps")
    parser.add_argument("--family", default="llama")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if not loopback_only():
        cmd = " ".join(["ip link set lo up && exec", sys.executable, *map(lambda a: f"'{a}'", sys.argv)])
        raise SystemExit(subprocess.call(["unshare", "-n", "sh", "-c", cmd]))
    import ray
    from opd.config.files import build_config
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _node_ip_address="127.0.0.1")
    batch = args.batch_size or (16 if args.quick else 32)
    batches = 3 if args.quick else 8
    steps = 6 if args.quick else 14
    base = {"family": args.family, "batch_size": batch, "eval": {"every": 0, "examples": 8}, "save_every": 0,
            "threads": 2, "plan": "forward=bf16 kv=bf16"}
    window = {"schedule": "async", "async": {"max_staleness": batches - 1, "worker_threads": 1}}  # all timed at once
    inproc = rollout_throughput(build_config(base | {"threads": 1}), batches)
    on_ray = window | {"async": window["async"] | {"backend": "ray"}}
    one = rollout_throughput(build_config(base | on_ray), batches)
    two = rollout_throughput(build_config(base | on_ray | {"ray": {"workers": 2}, "sampling": {"shards": 1}}),
                             batches)
    split = rollout_throughput(build_config(base | on_ray | {"ray": {"workers": 2}}), batches)
    print(f"rollout tokens/s: in-process {inproc:.0f}, 1 Ray actor {one:.0f} ({one / inproc:.2f}x), 2 Ray actors "
          f"taking whole batches in turn {two:.0f} ({two / inproc:.2f}x), 2 actors splitting each batch {split:.0f} "
          f"({split / inproc:.2f}x)", flush=True)
    run = base | {"steps": steps, "schedule": "async", "async": {"max_staleness": 1, "worker_threads": 1}}
    process = step_time(build_config(run), args.warmup)
    ray_step = step_time(build_config(run | {"async": run["async"] | {"backend": "ray"}}), args.warmup)
    print(f"OPD step (async, max_staleness 1): process backend {process:.3f} s, Ray backend {ray_step:.3f} s",
          flush=True)
    ray.shutdown()
    print(f"RESULT rollout_scaling_2w={two / one:.2f} rollout_scaling_2w_split={split / one:.2f} "
          f"ray_overhead={ray_step / process:.2f} ray_1w_vs_inprocess={one / inproc:.2f} batch={batch} "
          f"batches={batches} steps={steps}")


if __name__ == "__main__":
    main()
