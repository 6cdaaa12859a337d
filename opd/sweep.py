"""Sweeps: a grid of short OPD runs over mismatch sources and levels x estimators x seeds; one JSON line per run.

A grid is YAML (`DEFAULT_GRID` below is the one the README's tolerance study ran):

    families: [llama, qwen3]
    base: {steps: 60, batch_size: 32}                   # TrainConfig keys shared by every run
    estimators:                                         # name -> TrainConfig keys: the loss and its lr
      full_rkl: {loss: {name: full_rkl}, lr: 3.0e-4}
    seeds: [0]                                          # a point's seeds unless it names its own
    points:                                             # mismatch source, level, TrainConfig keys
      - {source: bf16, level: 0, set: {}, seeds: [0, 1, 2, 3, 4]}
      - {source: kv, level: fp8_e4m3, set: {plan: "forward=bf16 kv=fp8_e4m3"}, seeds: [0, 1, 2]}

Every run = family x estimator x point x seed. For each, the admission probe runs first on the initial student (what
`opd admit` would see for that configuration), then the training run; then one line is appended to the results file:
the run's id and key, its resolved config, the probe, quality before and after (held-out accuracy and reverse KL to
the teacher), every per-step metric averaged over training, a short training curve, wall times and the git SHA.
The key is a hash of the resolved config's non-default values: a run whose key is already in the file is skipped,
so a sweep that was stopped continues where it left off, and a changed grid re-runs only what changed. A line is
written only when its run has finished (one `write` under a file lock, so two sweeps may share a file); a torn last
line is ignored.
Plotting and the knee (tolerance.py) read only the results file.
"""
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from opd.admission import estimator_class, probe, staleness
from opd.config import TrainConfig, build_config, merge, resolve_generation
from opd.errors import OpdError, require
from opd.plan import Plan
from opd.runlog import read_metrics

DEFAULT_GRID = """
families: [llama, qwen3]
base: {steps: 60, batch_size: 32, warmup_steps: 5, lr_schedule: constant, eval_every: 0, eval_examples: 100,
       save_every: 0, threads: 1}
estimators:
  full_rkl: {loss: {name: full_rkl}, lr: 3.0e-4}
  sampled_mu: {loss: {name: sampled_rkl, student_term: sampler}, lr: 1.0e-4}
  sampled_pi: {loss: {name: sampled_rkl, student_term: learner}, lr: 1.0e-4}
  sampled_tis: {loss: {name: sampled_rkl, student_term: learner, correction: tis, cap: 2.0}, lr: 1.0e-4}
seeds: [0]
points:
  - {source: bf16, level: 0, set: {}, seeds: [0, 1, 2, 3, 4]}
  - {source: kv, level: fp8_e4m3, set: {plan: "forward=bf16 kv=fp8_e4m3"}, seeds: [0, 1, 2]}
  - {source: kv, level: fp8_e5m2, set: {plan: "forward=bf16 kv=fp8_e5m2"}}
  - {source: kv_trunc, level: fp8_e4m3, set: {plan: "forward=bf16 kv=fp8_e4m3 kv_round=zero"}, seeds: [0, 1, 2]}
  - {source: kv_trunc, level: fp8_e5m2, set: {plan: "forward=bf16 kv=fp8_e5m2 kv_round=zero"}}
  - {source: noise, level: 0.1, set: {plan: "forward=bf16 kv=bf16 noise=0.1"}}
  - {source: noise, level: 0.3, set: {plan: "forward=bf16 kv=bf16 noise=0.3"}}
  - {source: noise, level: 1.0, set: {plan: "forward=bf16 kv=bf16 noise=1.0"}}
  - {source: staleness, level: 1, set: {schedule: async, max_staleness: 1, threads: 2}}
  - {source: staleness, level: 4, set: {schedule: async, max_staleness: 4, threads: 2}}
"""
PROBE_ROLLOUTS = 16
PLAN_CHECK_LAYERS = 1024
CURVE_POINTS = 30
AVERAGED = ("mismatch/", "is/", "opd/", "stale/", "loss/", "train/grad_norm", "rollout/", "throughput/")


def load_grid(path: Path | None) -> dict:
    try:
        grid = yaml.safe_load(path.read_text() if path else DEFAULT_GRID)
    except FileNotFoundError:
        raise OpdError(f"grid file {path} not found", "pass a YAML grid (see opd/sweep.py)") from None
    except yaml.YAMLError as e:
        raise OpdError(f"grid file {path} is not valid YAML ({str(e).splitlines()[0]})", "fix the YAML") from None
    require(isinstance(grid, dict) and grid.get("points") and grid.get("estimators"),
            f"grid {path or 'default'} needs `estimators` and `points`", "see the example in opd/sweep.py")
    for i, point in enumerate(grid["points"]):
        require(isinstance(point, dict) and "source" in point and "level" in point,
                f"grid point {i + 1} needs `source` and `level`", "e.g. {source: kv, level: fp8_e4m3, set: {...}}")
    return grid


def expand(grid: dict, families: list[str] | None = None) -> list[dict]:
    """-> one spec per run: {id, family, estimator, source, level, seed, cfg}; configs are validated here, so a bad
    grid fails before the first run starts."""
    runs = []
    for family in families or grid.get("families", ["llama"]):
        for name, est in grid["estimators"].items():
            for point in grid["points"]:
                for seed in point.get("seeds", grid.get("seeds", [0])):
                    values = merge(merge(merge(dict(grid.get("base", {})), est or {}), point.get("set") or {}),
                                   {"family": family, "seed": seed})
                    run_id = f"{family}/{name}/{point['source']}={point['level']}/seed{seed}"
                    try:
                        cfg = build_config(values)
                        if isinstance(cfg.plan, str):  # the layer count is known only later: check the names now
                            Plan.parse(cfg.plan, PLAN_CHECK_LAYERS)
                    except OpdError as e:
                        raise OpdError(f"grid run {run_id}: {e.problem}", e.fix) from None
                    runs.append({"id": run_id, "family": family, "estimator": name, "source": point["source"],
                                 "level": point["level"], "seed": seed, "cfg": cfg})
    return runs


def config_key(cfg) -> str:
    """A hash of the config's non-default values, with its sampling settings resolved as the run resolves them
    (config.resolve_generation): a release that adds config fields (with defaults that change nothing) does not
    invalidate earlier results, and a setting left to the checkpoint hashes as the value it takes."""
    from opd.checkpoint import generation_config
    resolved = resolve_generation(cfg, generation_config(cfg.student) if cfg.student else {})
    return hashlib.sha256(json.dumps(_non_default(resolved.to_dict(), TrainConfig().to_dict()),
                                     sort_keys=True).encode()).hexdigest()[:16]


def _non_default(values: dict, defaults: dict) -> dict:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            value = _non_default(value, defaults[key])
            if value:
                out[key] = value
        elif key not in defaults or value != defaults[key]:
            out[key] = value
    return out


def finished_keys(rows: list[dict]) -> set[str]:
    """Keys of the runs in a results file, recomputed from their stored configs (the stored `key` may come from an
    older release; config fields this release no longer has are ignored)."""
    keys = set()
    for row in rows:
        try:
            keys.add(config_key(stored_config(row)))
        except (OpdError, KeyError, TypeError, AttributeError):
            keys.add(row.get("key"))
    return keys


def stored_config(row: dict) -> TrainConfig:
    """A results line's config, read by this release (fields it no longer has are dropped)."""
    known = set(TrainConfig().to_dict())
    return build_config({k: v for k, v in row["config"].items() if k in known})


def read_results(path: Path) -> list[dict]:
    """The results file's lines (a torn or corrupt line, e.g. from a killed writer, is skipped with a warning)."""
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"opd: warning: {path}:{n} is not a complete JSON line; ignored", file=sys.stderr)
    return rows


def append_result(path: Path, row: dict) -> None:
    data = (json.dumps(row) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def git_sha() -> str:
    here = Path(__file__).parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "opd"], cwd=here, capture_output=True,
                               text=True).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_sweep(grid: dict, out: Path, families: list[str] | None = None, progress: bool = True) -> list[dict]:
    """Run every run of the grid not yet in out/results.jsonl; returns all results."""
    from opd.trainer import probe_setup, train
    results_path = out / "results.jsonl"
    runs = expand(grid, families)
    done = finished_keys(read_results(results_path))
    todo = [r for r in runs if config_key(r["cfg"]) not in done]
    if progress:
        print(f"sweep: {len(runs)} runs, {len(runs) - len(todo)} already in {results_path}", file=sys.stderr)
    for i, spec in enumerate(todo, 1):
        cfg, start = spec["cfg"], time.perf_counter()
        setup, plan = probe_setup(cfg, PROBE_ROLLOUTS)
        numbers = probe(setup, plan)
        del setup
        run_dir = out / "runs" / spec["id"].replace("/", "__")
        summary = train(cfg, run_dir, overwrite=True, progress=False)
        rows = read_metrics(run_dir)
        row = {"id": spec["id"], "key": config_key(cfg), "family": spec["family"], "estimator": spec["estimator"],
               "class": estimator_class(cfg.loss), "source": spec["source"], "level": spec["level"],
               "seed": spec["seed"], "staleness": staleness(cfg), "config": cfg.to_dict(), "probe": numbers,
               "before": summary["before"], "after": summary["after"], "train": averages(rows),
               "curve": curve(rows), "train_s": summary["time/step"], "eval_s": summary["time/eval"],
               "wall_s": time.perf_counter() - start, "git": git_sha(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
        append_result(results_path, row)
        if progress:
            print(f"[{i}/{len(todo)}] {spec['id']}: rkl {row['before']['eval/rkl']:.3f} -> "
                  f"{row['after']['eval/rkl']:.3f}, accuracy {row['after']['eval/accuracy']:.3f}, "
                  f"total_kl_k3 {row['train'].get('stale/total_kl_k3', float('nan')):.3g}, "
                  f"{row['wall_s']:.0f} s", file=sys.stderr)
    return read_results(results_path)


def averages(rows: list[dict]) -> dict:
    """Each per-step metric's mean over the training steps (None where it was never finite)."""
    sums: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith(AVERAGED) and isinstance(value, (int, float)):
                sums.setdefault(key, []).append(float(value))
    return {key: sum(v) / len(v) for key, v in sums.items()}


def curve(rows: list[dict]) -> dict:
    """A short training curve: the sampled reverse KL and the rollout-vs-learner KL at ~CURVE_POINTS steps."""
    steps = [r for r in rows if "loss/rkl_sampled" in r]
    every = max(1, len(steps) // CURVE_POINTS)
    picked = steps[::every]
    return {"step": [r["step"] for r in picked], "rkl_sampled": [r["loss/rkl_sampled"] for r in picked],
            "total_kl_k3": [r.get("stale/total_kl_k3") for r in picked]}
