"""Sweeps: a grid of short OPD runs over mismatch sources and levels x estimators x seeds; one JSON line per run.

A grid is YAML (`DEFAULT_GRID` below is the one the tolerance study (docs/tolerance.md) ran):

    families: [llama, qwen3]
    base: {steps: 60, batch_size: 32}                   # TrainConfig keys shared by every run
    estimators:                                         # name -> TrainConfig keys: the loss and its lr
      full_rkl: {loss: {name: full_rkl}, optim: {lr: 3.0e-4}}
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

Both files are checked as data (schema.py). A grid is checked whole before the first run: its shape (`Grid`), then
every run's config (`expand`). A results line that is torn, not UTF-8, not JSON or not the shape of a result
(`Result`: the keys plotting and calibration read, with their types) is skipped with a warning naming the file, the
line and the key: the file is an append log that several sweeps share, one bad line must not stop them, and a skipped
run is only re-run.
"""
import hashlib
import json
import shutil
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, ValidationError, model_validator

from opd.health.rules import CLASSES, estimator_class, staleness
from opd.config.run import TrainConfig, resolve_generation
from opd.config.files import build_config, known_settings, merge, migrate
from opd.models.devices import cpu_description
from opd.io.errors import OpdError, require
from opd.numerics.plan import Plan
from opd.config.runlog import read_metrics, read_run_config
from opd.io.schema import Schema, check, parse_json, parse_yaml, problem, read_text
from opd.config.sections import FAMILIES, REAL_PAIRS
from opd.study.sweep_shared import BEFORE_IGNORES, Shared, append_result, shared_floor_probe, shared_key

DEFAULT_GRID = """
families: [llama, qwen3]
base: {steps: 60, batch_size: 32, save_every: 0, threads: 1, optim: {warmup_steps: 5, schedule: constant},
       eval: {every: 0, examples: 100}}
estimators:
  full_rkl: {loss: {name: full_rkl}, optim: {lr: 3.0e-4}}
  sampled_mu: {loss: {name: sampled_rkl, student_term: sampler}, optim: {lr: 1.0e-4}}
  sampled_pi: {loss: {name: sampled_rkl, student_term: learner}, optim: {lr: 1.0e-4}}
  sampled_tis: {loss: {name: sampled_rkl, student_term: learner, correction: tis, cap: 2.0}, optim: {lr: 1.0e-4}}
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
  - {source: staleness, level: 1, set: {schedule: async, async: {max_staleness: 1}, threads: 2}}
  - {source: staleness, level: 4, set: {schedule: async, async: {max_staleness: 4}, threads: 2}}
"""
PROBE_ROLLOUTS = 16
PLAN_CHECK_LAYERS = 1024
CURVE_POINTS = 30
AVERAGED = ("mismatch/", "is/", "opd/", "stale/", "loss/", "train/grad_norm", "rollout/", "throughput/",
            "teacher_mismatch/")


Seed = Annotated[int, Field(ge=0, lt=2 ** 32)]  # torch and numpy take seeds in [0, 2**32)
Finite = Annotated[float, Field(allow_inf_nan=False)]


class GridPoint(Schema):
    model_config = ConfigDict(strict=True, extra="forbid")  # a mistyped key (`seed:` for `seeds:`) is an error
    source: str
    level: str | int | Finite
    set: dict[str, Any] | None = None  # TrainConfig keys (checked by build_config in expand)
    seeds: list[Seed] | None = Field(None, min_length=1)


class Grid(Schema):
    model_config = ConfigDict(strict=True, extra="forbid")
    families: list[Literal[FAMILIES + REAL_PAIRS]] = Field(["llama"], min_length=1)
    base: dict[str, Any] = {}
    estimators: dict[str, dict[str, Any] | None] = Field(min_length=1)
    seeds: list[Seed] = Field([0], min_length=1)
    points: list[GridPoint] = Field(min_length=1)


def load_grid(path: Path | None) -> dict:
    where = str(path) if path else "the default grid"
    grid = parse_yaml(read_text(path, "grid file") if path else DEFAULT_GRID, where)
    check_grid(grid, where)
    return grid


def check_grid(grid, where: str = "the grid") -> Grid:
    """The grid's shape; the old messages for a grid without estimators or points, or a point without its source and
    level (the first thing a grid written by hand gets wrong)."""
    fix = "see the example in opd/study/sweep.py"
    try:
        return Grid.model_validate(grid)
    except ValidationError as e:
        loc = e.errors()[0]["loc"]
        if not isinstance(grid, dict) or not (grid.get("points") and grid.get("estimators")):
            raise OpdError(f"{where}: a grid needs `estimators` and `points` ({problem(e)})", fix) from None
        if len(loc) == 3 and loc[0] == "points" and loc[2] in ("source", "level") \
                and e.errors()[0]["type"] == "missing":
            raise OpdError(f"{where}: grid point {loc[1] + 1} needs `source` and `level`",
                           "e.g. {source: kv, level: fp8_e4m3, set: {...}}") from None
        raise OpdError(f"{where}: {problem(e)}", fix) from None


def expand(grid: dict, families: list[str] | None = None) -> list[dict]:
    """-> one spec per run: {id, family, estimator, source, level, seed, cfg}; configs are validated here, so a bad
    grid fails before the first run starts. Two runs with one id (a point given twice) would share a run folder and
    replace each other's results line: an error too."""
    shape = check_grid(grid)
    runs, seen = [], set()
    for family in dict.fromkeys(families or shape.families):  # each once
        for name, est in shape.estimators.items():
            for point in shape.points:
                for seed in point.seeds or shape.seeds:
                    values = merge(merge(merge(dict(shape.base), est or {}), point.set or {}),
                                   {"family": family, "seed": seed})
                    run_id = f"{family}/{name}/{point.source}={point.level}/seed{seed}"
                    require(run_id not in seen, f"grid runs {run_id} twice",
                            "give each point its own source=level, or merge their seeds")
                    seen.add(run_id)
                    try:
                        cfg = build_config(values)
                        if isinstance(cfg.plan, str):  # the layer count is known only later: check the names now
                            Plan.parse(cfg.plan, PLAN_CHECK_LAYERS)
                        else:
                            Plan.from_mapping(cfg.plan, PLAN_CHECK_LAYERS)
                    except OpdError as e:
                        raise OpdError(f"grid run {run_id}: {e.problem}", e.fix) from None
                    runs.append({"id": run_id, "family": family, "estimator": name, "source": point.source,
                                 "level": point.level, "seed": seed, "cfg": cfg})
    return runs


def contexts_key(cfg) -> str:
    """Under kept eval.contexts (fixed, teacher), the runs whose evaluation contexts are the same: those of one start
    (the before evaluation's key), of any training seed where eval.seed fixes the sampling. A grid that goes on in
    another session, on another CPU type, reuses the first runs' contexts from out/contexts/ instead of sampling
    other ones."""
    return shared_key(cfg, BEFORE_IGNORES + (("seed",) if cfg.eval.seed >= 0 else ()))


def config_key(cfg) -> str:
    """A hash of the config's non-default values, with its sampling settings resolved as the run resolves them
    (config.resolve_generation): a release that adds config fields (with defaults that change nothing) does not
    invalidate earlier results, and a setting left to the checkpoint hashes as the value it takes."""
    from opd.models.checkpoint import generation_config
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
    """A results line's config, read by this release (settings it no longer has are dropped)."""
    return build_config(known_settings(migrate(row["config"])))


def _not_negative(value: float) -> float:
    if value < 0:
        raise ValueError("a number >= 0 (or NaN)")
    return value


Ratio = Annotated[float, AfterValidator(_not_negative)]  # nsr and its floor (NaN: the probe's rollouts were broken)


class Probe(Schema):
    """The probe numbers that calibration and decide() read (each may be absent in an older line)."""
    nsr: Ratio = math.nan
    floor_nsr: Ratio = 0.0
    ess_frac: float = 1.0
    kl_k3: float = 0.0
    floor_kl_k3: float = 0.0
    adv_sign_flip: float = 0.0
    kv_clipped_k: float = 0.0
    kv_clipped_v: float = 0.0


class Eval(Schema):
    rkl: Finite = Field(alias="eval/rkl")


class EvalAfter(Eval):
    accuracy: Finite | None = Field(None, alias="eval/accuracy")  # None: eval.greedy off


class TrainMeans(Schema):
    total_kl_k3: Finite | None = Field(None, alias="stale/total_kl_k3")
    kl_k3: Finite | None = Field(None, alias="mismatch/kl_k3")


class Curve(Schema):
    step: list[int]
    rkl_sampled: list[Finite | None]
    total_kl_k3: list[Finite | None] = []

    @model_validator(mode="after")
    def _aligned(self):
        if len(self.step) != len(self.rkl_sampled):
            raise ValueError("step and rkl_sampled of one length")
        return self


class StoredOptim(Schema):
    lr: Annotated[float, Field(gt=0, allow_inf_nan=False)]


class StoredConfig(Schema):
    optim: StoredOptim


class Result(Schema):
    """A results line as tolerance.py (plots, knees), thresholds.calibrate and the resume read it."""
    id: str
    key: str
    family: Literal[FAMILIES + REAL_PAIRS]
    estimator: str
    source: str
    level: str | int | Finite
    seed: Seed
    class_: Literal[CLASSES] = Field(alias="class")
    staleness: Annotated[int, Field(ge=0)]
    config: StoredConfig
    probe: Probe
    before: Eval
    after: EvalAfter
    train: TrainMeans
    curve: Curve


def read_results(path: Path, warn: bool = True) -> list[dict]:
    """The results file's lines. A line that is torn (a killed writer), not UTF-8, not JSON or not a result's shape is
    skipped with a warning (the module docstring says why)."""
    if not path.is_file():
        return []
    rows = []
    for n, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            rows.append(_result(raw, f"{path}:{n}"))
        except OpdError as e:
            if warn:
                print(f"opd: warning: {e.problem}; ignored", file=sys.stderr)
    return rows


def _result(raw: bytes, where: str) -> dict:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OpdError(f"{where} is not UTF-8 text (byte {e.start})") from None
    try:
        row = parse_json(line, where)
    except OpdError:  # torn, or not JSON at all
        raise OpdError(f"{where} is not a complete JSON line") from None
    if not isinstance(row, dict):
        raise OpdError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if isinstance(row.get("config"), dict):  # a line written before the config had sections: today's layout
        row["config"] = migrate(row["config"])
    check(Result, row, where)
    return row


def git_sha() -> str:
    here = Path(__file__).parents[2]  # the checkout (opd's package is opd/ in it)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "opd"], cwd=here, capture_output=True,
                               text=True).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_sweep(grid: dict, out: Path, families: list[str] | None = None, progress: bool = True) -> list[dict]:
    """Run every run of the grid not yet in out/results.jsonl; returns all results. Several sweeps may share one
    --out: before each run the results are read again (another sweep may have finished it meanwhile), and a run whose
    folder another live process holds (train's lock) is left to it."""
    from opd.config.runlog import RunDirLocked
    from opd.training.setup import probe_setup
    from opd.training.trainer import Interrupted, train
    results_path = out / "results.jsonl"
    runs = expand(grid, families)  # the whole grid is valid, and --out writable, before the first run
    check_writable(out)
    done = finished_keys(read_results(results_path))
    shared = Shared(out / "shared.jsonl")
    todo = [r for r in runs if config_key(r["cfg"]) not in done]
    if progress:
        print(f"sweep: {len(runs)} runs, {len(runs) - len(todo)} already in {results_path}", file=sys.stderr)
    for i, spec in enumerate(todo, 1):
        cfg, start = spec["cfg"], time.perf_counter()
        if i > 1 and config_key(cfg) in finished_keys(read_results(results_path, warn=False)):
            _note(progress, f"[{i}/{len(todo)}] {spec['id']}: finished by another sweep meanwhile; skipped")
            continue
        setup, plan = probe_setup(cfg, PROBE_ROLLOUTS)
        numbers = shared_floor_probe(setup, plan, shared)
        setup.teacher.close()
        del setup
        run_dir = out / "runs" / spec["id"].replace("/", "__")
        before_key = shared_key(cfg, BEFORE_IGNORES)
        stop = None
        contexts = out / "contexts" / f"{contexts_key(cfg)}.json"  # kept eval.contexts: sampled once per start
        resume = cut_short(run_dir, cfg)
        if resume:
            _note(progress, f"[{i}/{len(todo)}] {spec['id']}: continued from its checkpoint in {run_dir}")
        try:
            summary = train(cfg, run_dir, resume=resume, overwrite=not resume, progress=False,
                            before=shared.get("before", before_key), contexts=contexts if contexts.is_file() else None)
        except RunDirLocked as e:
            print(f"opd: note: {spec['id']} skipped: another sweep (process {e.pid}) is running it in {run_dir}",
                  file=sys.stderr)
            continue
        except Interrupted as e:  # a signal during the run's final evaluation: record the finished run, then stop
            if e.summary is None:
                raise
            summary, stop = e.summary, e
        shared.put("before", before_key, summary["before"])
        if cfg.eval.kept and not contexts.is_file():
            contexts.parent.mkdir(exist_ok=True)
            shutil.copyfile(run_dir / "eval_contexts.json", contexts)
        rows = read_metrics(run_dir)
        row = {"id": spec["id"], "key": config_key(cfg), "family": spec["family"], "estimator": spec["estimator"],
               "class": estimator_class(cfg.loss), "source": spec["source"], "level": spec["level"],
               "seed": spec["seed"], "staleness": staleness(cfg), "config": cfg.to_dict(), "probe": numbers,
               "before": summary["before"], "after": summary["after"], "train": averages(rows),
               "curve": curve(rows), "train_s": summary["time/step"], "eval_s": summary["time/eval"],
               "wall_s": time.perf_counter() - start, "git": git_sha(), "cpu": cpu_description(),
               "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
        append_result(results_path, row)
        _note(progress, f"[{i}/{len(todo)}] {spec['id']}: rkl {row['before']['eval/rkl']:.3f} -> "
                        f"{row['after']['eval/rkl']:.3f}, entropy {row['after'].get('eval/entropy', float('nan')):.3f}, "
                        f"accuracy {row['after'].get('eval/accuracy', float('nan')):.3f}, "
                        f"total_kl_k3 {row['train'].get('stale/total_kl_k3', float('nan')):.3g}, "
                        f"{row['wall_s']:.0f} s")
        if stop is not None:
            raise stop
    return read_results(results_path)


def cut_short(run_dir: Path, cfg) -> bool:
    """run_dir holds this config's run, cut short (a session's end, a crash) after a checkpoint (save_every > 0): the
    sweep continues it exactly (train's resume) instead of starting it again. Another config's run, or one with no
    checkpoint yet, is replaced as before (with a note where a checkpoint is thrown away). The run saved its config as
    set-up made it (a real pair's default prompts filled in, the sampling settings resolved): the grid's config is
    compared in that form."""
    from opd.training.resume import STATE_FILE
    from opd.training.setup import with_pair_defaults
    if not cfg.save_every or not (run_dir / "checkpoint" / STATE_FILE).is_file():
        return False
    try:
        same = config_key(read_run_config(run_dir)) == config_key(with_pair_defaults(cfg))
    except OpdError:
        same = False
    if not same:
        print(f"opd: note: {run_dir} holds a checkpoint of another config's run: it is started again",
              file=sys.stderr)
    return same


def _note(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr)


def check_writable(out: Path) -> None:
    """--out can hold the run folders and results.jsonl (checked before hours of runs, not after the first)."""
    from opd.config.runlog import check_writable as check_folder
    results = out / "results.jsonl"
    check_folder(out, "--out")
    try:
        if results.exists():
            open(results, "ab").close()  # appends nothing: is it a file this process may append to?
    except OSError as e:
        raise OpdError(f"cannot append to {results}: {e.strerror or e}",
                       "make it a writable file, or choose another --out") from None


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
