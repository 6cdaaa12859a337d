"""The training config: one typed dataclass, read from YAML, overridden with `--set key=value`, saved resolved.

A YAML file holds any subset of the fields below (the rest keep their defaults); the loss is a nested mapping:

    family: qwen3            # the built-in pair to distill (ignored when student and teacher are given)
    steps: 300
    plan: "kv=fp8_e4m3"      # rollout precision plan (plan.py); a mapping {"*": ..., "0,3": ...} also works
    loss: {name: sampled_rkl, student_term: learner, correction: tis, cap: 2.0}

`--set` takes dotted keys (`loss.name=fkl`) and YAML values (`lr=3e-4`, `exact_kl=false`). Unknown keys, wrong
types and bad values are errors that name the key.
"""
import difflib
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from opd.errors import OpdError, require
from opd.scoring import check_name as check_scoring
from opd.task import get_task

FAMILIES = ("llama", "qwen3")  # the built-in pairs' model families (pretrain.py)
DTYPE_NAMES = ("float32", "bf16")  # the learner's and teacher's dtypes (devices.DTYPES: their torch dtypes)
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"

SCHEDULES = ("sync", "async")
ENGINES = ("builtin", "vllm")
STALE_POLICIES = ("requeue", "drop")
GUARD_ACTIONS = ("warn", "fallback", "stop")
LR_SCHEDULES = ("cosine", "constant")
LONG_PROMPTS = ("refuse", "drop")
FILE_PROMPT_TOKENS = 512  # max_new_tokens with a prompt file when neither the config nor the checkpoint sets it
SEED_LIMIT = 2 ** 32  # seeds are in [0, SEED_LIMIT): sampler_seed(seed, step) must stay a 64-bit generator seed
INT_LIMIT = 2 ** 31  # any other integer setting (a count or a size) is below it


LOSSES = ("sampled_rkl", "full_rkl", "topk_rkl", "fkl", "jsd")
STUDENT_TERMS = ("sampler", "learner")
CORRECTIONS = ("none", "tis", "mis")


@dataclass(frozen=True)
class LossConfig:
    name: str = "full_rkl"  # the lowest-variance estimator; see dev/LOG.md for the others on the built-in pairs
    student_term: str = "learner"
    correction: str = "none"
    cap: float = 2.0  # C of TIS / MIS
    topk: int = 16
    topk_support: str = "student"
    jsd_beta: float = 0.5

    def __post_init__(self):
        require(self.name in LOSSES, f"unknown loss {self.name!r}", f"use one of {', '.join(LOSSES)}")
        require(self.student_term in STUDENT_TERMS, f"unknown student_term {self.student_term!r}",
                f"use one of {', '.join(STUDENT_TERMS)}")
        require(self.correction in CORRECTIONS, f"unknown correction {self.correction!r}",
                f"use one of {', '.join(CORRECTIONS)}")
        require(self.cap > 1, f"correction cap must be > 1, got {self.cap}")
        require(self.topk > 0, f"topk must be positive, got {self.topk}")
        require(self.topk_support in ("student", "teacher"), f"topk_support must be student or teacher, "
                                                             f"got {self.topk_support!r}")
        require(0 < self.jsd_beta < 1, f"jsd_beta must be in (0, 1), got {self.jsd_beta}",
                "use loss fkl or full_rkl for the limits")


def check_name(name: str, what: str = "device") -> None:
    """A device name a config may use (whether this machine has it: devices.resolve, when a run is set up)."""
    require(isinstance(name, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", name) is not None,
            f"config: unknown {what} {name!r}", f"use {DEVICE_FORMS}")


def check_dtype_name(name: str, what: str = "dtype") -> None:
    require(name in DTYPE_NAMES, f"config: unknown {what} {name!r}", f"use one of {', '.join(DTYPE_NAMES)}")


@dataclass
class TrainConfig:
    family: str = "llama"  # built-in pair (pretrained on first use) when student/teacher are empty
    student: str = ""  # HF checkpoint folder of the student
    teacher: str = ""  # HF checkpoint folder of the teacher
    task: str = "chain"  # the built-in task: training prompts and held-out evaluation unless `prompts` is given
    prompts: str = ""  # JSONL prompt file (prompts.py); default: the task's training stream
    prompt_key: str = "prompt"  # the prompt's field in each line (text, or chat messages); "messages" also works
    answer_key: str = "answer"  # the reference answer's field (optional per line)
    chat: bool = False  # send text prompts through the student's chat template as one user message
    eval_prompts: str = ""  # JSONL held-out prompts for evaluation; "": eval_fraction of `prompts`
    eval_fraction: float = 0.1  # share of `prompts` held out for evaluation (by a hash of the prompt)
    max_prompt_tokens: int = 0  # 0: what the context leaves after max_new_tokens
    long_prompts: str = "refuse"  # a prompt over max_prompt_tokens: "refuse" (an error) or "drop" (counted)
    scoring: str = "last_hash"  # answer extraction (scoring.py): last_hash, gsm8k, boxed, exact, none, module:fn
    steps: int = 150
    batch_size: int = 64  # prompts (= rollouts) per optimizer step
    max_new_tokens: int = 0  # 0: generation_config.json's, else the task's default (512 with a prompt file)
    temperature: float | None = None  # sampling temperature; None: generation_config.json's, else 1.0
    top_k: int | None = None  # None: generation_config.json's, else 0 (off)
    top_p: float | None = None  # None: generation_config.json's, else 1.0 (off)
    plan: str | dict = "forward=bf16 kv=bf16"  # rollout precision plan (plan.py): BF16 rollouts; "" = float32
    noise_seed: int = 0
    loss: LossConfig = field(default_factory=LossConfig)
    lr: float = 1e-3
    warmup_steps: int = 20
    lr_schedule: str = "cosine"  # after warm-up: "cosine" (to lr/10 at `steps`) or "constant"
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 75  # 0: only before and after training
    eval_examples: int = 500
    save_every: int = 50  # 0: only at the end (and on Ctrl-C)
    exact_kl: bool = True  # also log the exact per-position KL(p_rollout || p_train) (needs the engine's distributions)
    max_bad_steps: int = 5  # stop after this many non-finite losses/gradients in a row
    engine: str = "builtin"  # the rollout engine: "builtin" (emulated precisions) or "vllm" (vllm_engine.py)
    engine_compile: bool = False  # builtin engine: torch.compile its forward (faster decoding, ~1 min to compile)
    schedule: str = "sync"  # "async": a rollout worker process samples while the trainer trains (async_rollouts.py)
    max_staleness: int = 1  # async: most optimizer steps a rollout's weights may lag the learner's
    prefetch: int = -1  # async: batches the worker may sample ahead of the one being trained; -1: max_staleness
    stale_policy: str = "requeue"  # async: a rollout older than max_staleness is re-sampled ("requeue") or "drop"ped
    recompute_fraction: float = 1.0  # async: share of each batch (its first rollouts) whose q the worker recomputes
    worker_threads: int = 1  # async: the rollout worker's threads (the trainer gets threads - worker_threads)
    worker_timeout: float = 120.0  # async: seconds without a message from a busy worker before it counts as hung
    max_worker_restarts: int = 2  # async: a dead or hung worker is restarted this many times, then the run stops
    guard_every: int = 0  # the runtime admission check on the live rollouts every this many steps; 0: off
    guard_action: str = "warn"  # on REJECT: "warn", "fallback" (a safer plan from then on, guard.safer_plan), "stop"
    guard_thresholds: str = ""  # a thresholds file from `opd calibrate`; "": the shipped opd/thresholds.json
    guard_limit: float = 0.0  # > 0: this limit on the rollout-vs-learner nsr (admission.py), not the calibrated one
    seed: int = 0
    threads: int = 2  # CPU threads for the whole run (async: split between the worker and the trainer)
    device: str = "auto"  # learner and rollout engine: auto (CUDA when present, else CPU), cpu, cuda, cuda:N
    teacher_device: str = ""  # the teacher's device; "": the same as `device`
    dtype: str = "float32"  # learner compute: float32, or bf16 (autocast; float32 master weights and optimizer)
    teacher_dtype: str = "float32"  # the teacher's weights and compute: float32 or bf16
    micro_batch_size: int = 0  # rollouts per learner/teacher forward (gradients accumulated); 0: the whole batch
    chunk_tokens: int = 0  # tokens per chunk of full-vocabulary work (chunked.py); 0: 2**24 floats / vocab
    eval_batch_size: int = 0  # held-out prompts per generation batch; 0: 2**24 floats / vocab (all, at vocab 100)

    def __post_init__(self):
        check_numbers(self, "")
        require(isinstance(self.loss, LossConfig), f"config: loss must be a mapping, got {self.loss!r}")
        check_numbers(self.loss, "loss.")
        require(self.family in FAMILIES, f"unknown family {self.family!r}", f"use one of {', '.join(FAMILIES)}")
        require(bool(self.student) == bool(self.teacher), "give both student and teacher, or neither",
                "neither: the built-in pair of `family`")
        get_task(self.task)
        for name in ("steps", "batch_size", "eval_examples", "threads", "max_bad_steps"):
            require(getattr(self, name) > 0, f"config: {name} must be positive, got {getattr(self, name)}")
        for name in ("max_new_tokens", "warmup_steps", "eval_every", "save_every"):
            require(getattr(self, name) >= 0, f"config: {name} must be >= 0, got {getattr(self, name)}")
        require(self.temperature is None or self.temperature > 0,
                f"config: temperature must be > 0, got {self.temperature}",
                "on-policy training samples; greedy rollouts are not on-policy")
        require(self.top_k is None or self.top_k >= 0, f"config: top_k must be >= 0, got {self.top_k}", "0 is off")
        require(self.top_p is None or 0 < self.top_p <= 1, f"config: top_p must be in (0, 1], got {self.top_p}")
        require(0 <= self.eval_fraction < 1, f"config: eval_fraction must be in [0, 1), got {self.eval_fraction}")
        require(not self.prompts or self.eval_prompts or self.eval_fraction > 0,
                "config: a prompt file needs held-out prompts for evaluation", "set eval_fraction > 0 or eval_prompts")
        require(self.max_prompt_tokens >= 0, f"config: max_prompt_tokens must be >= 0, got {self.max_prompt_tokens}")
        require(self.long_prompts in LONG_PROMPTS, f"unknown long_prompts {self.long_prompts!r}",
                f"use one of {', '.join(LONG_PROMPTS)}")
        for name in ("prompt_key", "answer_key"):
            require(getattr(self, name) != "", f"config: {name} must not be empty")
        check_scoring(self.scoring)
        require(self.lr > 0, f"config: lr must be positive, got {self.lr}")
        require(self.grad_clip > 0, f"config: grad_clip must be positive, got {self.grad_clip}")
        require(self.weight_decay >= 0, f"config: weight_decay must be >= 0, got {self.weight_decay}")
        require(isinstance(self.plan, (str, dict)), f"config: plan must be a string or a mapping, got {self.plan!r}")
        require(self.lr_schedule in LR_SCHEDULES, f"unknown lr_schedule {self.lr_schedule!r}",
                f"use one of {', '.join(LR_SCHEDULES)}")
        require(self.schedule in SCHEDULES, f"unknown schedule {self.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
        require(self.engine in ENGINES, f"unknown engine {self.engine!r}", f"use one of {', '.join(ENGINES)}")
        require(not (self.engine_compile and self.engine == "vllm"), "engine_compile applies to the builtin engine",
                "vLLM compiles its own model; drop engine_compile")
        require(self.stale_policy in STALE_POLICIES, f"unknown stale_policy {self.stale_policy!r}",
                f"use one of {', '.join(STALE_POLICIES)}")
        for name in ("max_staleness", "max_worker_restarts"):
            require(getattr(self, name) >= 0, f"config: {name} must be >= 0, got {getattr(self, name)}")
        require(self.prefetch >= -1, f"config: prefetch must be >= 0 (or -1: max_staleness), got {self.prefetch}")
        require(0 <= self.recompute_fraction <= 1,
                f"config: recompute_fraction must be in [0, 1], got {self.recompute_fraction}")
        require(self.guard_action in GUARD_ACTIONS, f"unknown guard_action {self.guard_action!r}",
                f"use one of {', '.join(GUARD_ACTIONS)}")
        require(self.guard_every >= 0, f"config: guard_every must be >= 0, got {self.guard_every}", "0 turns it off")
        require(self.guard_limit >= 0, f"config: guard_limit must be >= 0, got {self.guard_limit}",
                "0 uses the calibrated limit")
        require(not (self.guard_every and self.schedule == "async" and self.recompute_fraction == 0),
                "config: the runtime guard reads the rollouts' numerics mismatch (q vs mu), which an async run "
                "only has with recompute_fraction > 0", "set recompute_fraction (e.g. 0.25) or guard_every=0")
        require(self.worker_threads > 0, f"config: worker_threads must be positive, got {self.worker_threads}")
        require(self.worker_timeout > 0, f"config: worker_timeout must be positive, got {self.worker_timeout}")
        check_name(self.device)
        if self.teacher_device:
            check_name(self.teacher_device, "teacher_device")
        check_dtype_name(self.dtype)
        check_dtype_name(self.teacher_dtype, "teacher_dtype")
        for name in ("micro_batch_size", "chunk_tokens", "eval_batch_size"):
            require(getattr(self, name) >= 0, f"config: {name} must be >= 0, got {getattr(self, name)}",
                    "0 chooses it automatically")
        require(self.batch_size % max(self.micro_batch_size, 1) == 0,
                f"config: micro_batch_size {self.micro_batch_size} does not divide batch_size {self.batch_size}",
                "use a divisor of batch_size (gradients are accumulated over equal micro-batches), or 0")
        require(self.schedule != "async" or self.threads > self.worker_threads,
                f"config: async needs more threads ({self.threads}) than the rollout worker's ({self.worker_threads})",
                "the trainer gets threads - worker_threads; on 2 cores use threads=2 worker_threads=1")

    @property
    def lookahead(self) -> int:
        """Batches the async worker may sample beyond the one being trained."""
        return self.max_staleness if self.prefetch < 0 else self.prefetch

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens or (FILE_PROMPT_TOKENS if self.prompts else get_task(self.task).max_new_tokens)

    @property
    def sampling(self) -> dict:
        """temperature, top_k, top_p as the rollouts use them (call on a resolved config: resolve_generation)."""
        return {"temperature": self.temperature or 1.0, "top_k": self.top_k or 0,
                "top_p": 1.0 if self.top_p is None else self.top_p}

    def to_dict(self) -> dict:
        return asdict(self)


def check_numbers(section, prefix: str) -> None:
    """Every float setting finite, every integer one within its range: checked when the config is read, so a bad value
    fails before anything is loaded or trained, not later with a message that blames something else."""
    for f in fields(section):
        value = getattr(section, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = prefix + f.name
        if isinstance(value, float):
            require(math.isfinite(value), f"config: {name} must be a finite number, got {value}")
        elif "seed" in f.name:
            require(0 <= value < SEED_LIMIT, f"config: {name} must be in [0, 2**32), got {value}")
        else:
            require(abs(value) < INT_LIMIT, f"config: {name} is out of range, got {value}", "use a value below 2**31")


def _checked_keys(values: dict, cls, prefix: str = "") -> dict:
    names = [f.name for f in fields(cls)]
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            raise OpdError(f"unknown config key {prefix + str(key)!r}",
                           f"did you mean {prefix}{close[0]}?" if close else f"valid keys: {', '.join(names)}")
    return values


OPTIONAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # fields whose default is None: a value of this type


def _typed(key: str, value, default):
    """Check a YAML value against the type of the field's default (ints are accepted for floats)."""
    if default is None and key in OPTIONAL:
        return None if value is None else _typed(key, value, OPTIONAL[key])
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            (isinstance(value, float) or abs(value) < 1e308)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, str) and key == "plan":
        ok = isinstance(value, str) or (isinstance(value, dict) and all(
            isinstance(k, (str, int)) and not isinstance(k, bool) and isinstance(v, str) for k, v in value.items()))
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        ok = True
    names = {bool: "true or false", float: "a number", int: "an integer", str: "a string"}
    expected = "a string or a mapping of layers to settings strings" if key == "plan" else names[type(default)]
    require(ok, f"config: {key} must be {expected}, got {value!r:.60}",
            "e.g. plan: \"kv=fp8_e4m3\"" if key == "plan" else f"e.g. {key}: {json.dumps(default)}")
    return value


def _checked_values(values, where: str = "config") -> dict:
    """values with their keys and types checked (no range checks yet: TrainConfig's own); errors name `where`."""
    try:
        require(isinstance(values, dict), f"config: expected a mapping of keys to values, got {type(values).__name__}",
                "write key: value lines")
        _checked_keys(values, TrainConfig)
        defaults, loss_defaults = TrainConfig(), asdict(LossConfig())
        out = {}
        for key, value in values.items():
            if key == "loss":
                require(isinstance(value, dict), "config: loss must be a mapping", "e.g. loss: {name: full_rkl}")
                _checked_keys(value, LossConfig, "loss.")
                out["loss"] = {k: _typed(f"loss.{k}", v, loss_defaults[k]) for k, v in value.items()}
            else:
                out[key] = _typed(key, value, getattr(defaults, key))
        return out
    except OpdError as e:
        if where == "config":
            raise
        raise OpdError(f"{where}: {e.problem.removeprefix('config: ')}", e.fix) from None


def build_config(values: dict, where: str = "config") -> TrainConfig:
    """A TrainConfig from a (possibly nested) mapping, with key, type and range checks."""
    out = _checked_values(values, where)
    try:
        if "loss" in out:
            out["loss"] = LossConfig(**out["loss"])
        return TrainConfig(**out)
    except OpdError as e:
        problem = e.problem if where == "config" else f"{where}: {e.problem.removeprefix('config: ')}"
        raise OpdError(problem, e.fix or "each key's meaning and range: opd/config.py") from None


def parse_overrides(pairs: list[str]) -> dict:
    """["lr=3e-4", "loss.name=fkl"] -> {"lr": 0.0003, "loss": {"name": "fkl"}}."""
    out: dict = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        require(eq == "=" and key.strip(), f"--set {pair!r}: expected key=value", "e.g. --set lr=3e-4")
        try:
            value = yaml.load(text, Loader=_unique_key_loader()) if text.strip() else ""  # noqa: S506 (safe)
        except yaml.constructor.ConstructorError as e:  # a key given twice
            raise OpdError(f"--set {pair!r}: {e.problem}", "give each key once") from None
        except yaml.YAMLError:
            value = text
        *parents, leaf = key.strip().split(".")
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
            require(isinstance(node, dict), f"--set {pair!r}: {parent} is not a section")
        node[leaf] = value
    return out


def _unique_key_loader():
    from opd.schema import UniqueKeyLoader  # pydantic comes with schema.py: not imported for a config alone
    return UniqueKeyLoader


def merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: Path | None, overrides: list[str] = ()) -> TrainConfig:
    """The config file (checked: UTF-8, YAML without duplicate keys, known keys of the right types, each error
    naming the file) with the --set overrides applied, then range-checked as a whole."""
    from opd.schema import read_yaml
    values = {}
    if path is not None:
        values = read_yaml(path, "config file", "fix the file") or {}
        require(isinstance(values, dict), f"{path}: expected a mapping of config keys, got {type(values).__name__}",
                "write key: value lines")
        _checked_values(values, str(path))
    return build_config(merge(values, parse_overrides(list(overrides))))


def generation_defaults(generation: dict, **given) -> dict:
    """The sampling settings `given` (temperature, top_k, top_p), each left unset (None) taken from a checkpoint's
    generation_config.json (`generation`), else its OPTIONAL default (temperature 1, top-k and top-p off)."""
    return {name: value if value is not None else generation.get(name, OPTIONAL[name]) for name, value in given.items()}


def resolve_generation(cfg: TrainConfig, generation: dict) -> TrainConfig:
    """The config with the sampling settings the user left unset taken from the student's generation_config.json
    (`generation`: its temperature, top_k, top_p, max_new_tokens), else the defaults (1.0, off, off, the task's or
    FILE_PROMPT_TOKENS): what a run actually uses, and what it saves and compares on resume."""
    chosen = generation_defaults(generation, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    new_tokens = cfg.max_new_tokens or generation.get("max_new_tokens") or cfg.new_tokens
    out = replace(cfg, temperature=float(chosen["temperature"]), top_k=int(chosen["top_k"]),
                  top_p=float(chosen["top_p"]), max_new_tokens=int(new_tokens))
    require(out.temperature > 0 and out.top_k >= 0 and 0 < out.top_p <= 1,
            f"generation_config.json's sampling settings are out of range (temperature {out.temperature}, top_k "
            f"{out.top_k}, top_p {out.top_p})", "set temperature, top_k and top_p in the config")
    return out


def dump_config(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
