"""The training config: typed sections, read from YAML, overridden with `--set key=value`, saved resolved.

A YAML file holds any subset of the settings below (the rest keep their defaults). The run-wide ones are top-level
keys; the others live in sections (SECTIONS: data, sampling, loss, optim, eval, engine, async, guard, compute), each a
frozen dataclass that checks its own values in __post_init__:

    family: qwen3            # the built-in pair to distill (ignored when student and teacher are given)
    steps: 300
    plan: "kv=fp8_e4m3"      # rollout precision plan (plan.py); a mapping {"*": ..., "0,3": ...} also works
    schedule: async
    loss: {name: sampled_rkl, student_term: learner, correction: tis, cap: 2.0}
    optim: {lr: 3.0e-4}
    async: {max_staleness: 2}

`--set` takes dotted keys (`async.max_staleness=2`, `loss.name=fkl`) and YAML values (`optim.lr=3e-4`,
`exact_kl=false`). Unknown keys, wrong types and bad values are errors that name the key; a key from before the
sections (`max_staleness`) is refused with its new name. In Python the async section is `cfg.async_` (`async` is a
keyword).
"""
import difflib
import json
import keyword
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from opd import engines
from opd.errors import OpdError, require
from opd.real_pairs import PAIRS
from opd.scoring import check_name as check_scoring
from opd.task import get_task

FAMILIES = ("llama", "qwen3")  # the built-in pairs' model families (pretrain.py)
REAL_PAIRS = tuple(PAIRS)  # real pretrained pairs, built from registry packages (real_pairs.py)
DTYPE_NAMES = ("float32", "bf16")  # the learner's and teacher's dtypes (devices.DTYPES: their torch dtypes)
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"

SCHEDULES = ("sync", "async")
BACKENDS = ("process", "ray")
ENGINES = engines.NAMES  # the rollout engines' kinds (engines.KINDS)
TEACHER_ENGINES = ("trainer", "builtin", "vllm")  # who scores the student's tokens for the teacher (teacher.py)
TOPK_TEACHER_LOSSES = ("sampled_rkl", "topk_fkl", "topk_rkl_tail", "topk_rkl")  # what a top-k teacher can drive
STALE_POLICIES = ("requeue", "drop")
GUARD_ACTIONS = ("warn", "fallback", "stop")
LR_SCHEDULES = ("cosine", "constant")
LONG_PROMPTS = ("refuse", "drop")
FILE_PROMPT_TOKENS = 512  # max_new_tokens with a prompt file when neither the config nor the checkpoint sets it
SEED_LIMIT = 2 ** 32  # seeds are in [0, SEED_LIMIT): sampler_seed(seed, step) must stay a 64-bit generator seed
INT_LIMIT = 2 ** 31  # any other integer setting (a count or a size) is below it


LOSSES = ("sampled_rkl", "full_rkl", "topk_rkl", "fkl", "jsd", "topk_fkl", "topk_rkl_tail")
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
        check_numbers(self, "loss.")
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


def _at_least(section, key: str, names, low: int, fix: str = "") -> None:
    for name in names:
        value = getattr(section, name)
        if value < low:
            word = "positive" if low == 1 else f">= {low}"
            raise OpdError(f"config: {key}.{name} must be {word}, got {value}", fix)


def _one_of(section, key: str, name: str, choices) -> None:
    value = getattr(section, name)
    require(value in choices, f"unknown {key + '.' if key else ''}{name} {value!r}", f"use one of {', '.join(choices)}")


@dataclass(frozen=True)
class DataConfig:
    """The training prompts and how answers are scored."""
    prompts: str = ""  # JSONL prompt file (prompts.py); default: the task's training stream
    prompt_key: str = "prompt"  # the prompt's field in each line (text, or chat messages); "messages" also works
    answer_key: str = "answer"  # the reference answer's field (optional per line)
    chat: bool = False  # send text prompts through the student's chat template as one user message
    max_prompt_tokens: int = 0  # 0: what the context leaves after max_new_tokens
    long_prompts: str = "refuse"  # a prompt over max_prompt_tokens: "refuse" (an error) or "drop" (counted)
    scoring: str = "last_hash"  # answer extraction (scoring.py): last_hash, gsm8k, boxed, exact, none, module:fn

    def __post_init__(self):
        check_numbers(self, "data.")
        _at_least(self, "data", ["max_prompt_tokens"], 0, "0: what the context leaves")
        _one_of(self, "data", "long_prompts", LONG_PROMPTS)
        for name in ("prompt_key", "answer_key"):
            require(getattr(self, name) != "", f"config: data.{name} must not be empty")
        check_scoring(self.scoring)


@dataclass(frozen=True)
class SamplingConfig:
    """How rollouts (and evaluation) sample; a setting left None is taken from the student's generation_config.json
    (resolve_generation)."""
    max_new_tokens: int = 0  # 0: generation_config.json's, else the task's default (512 with a prompt file)
    temperature: float | None = None  # None: generation_config.json's, else 1.0
    top_k: int | None = None  # None: generation_config.json's, else 0 (off)
    top_p: float | None = None  # None: generation_config.json's, else 1.0 (off)
    # The batch is sampled as this many contiguous sub-batches, each from a seed of its own, so the rollouts are the
    # same wherever the sub-batches run (one engine, a worker process, or ray.workers Ray actors). 0: one per rollout
    # worker (1, or ray.workers on the Ray backend); 1 on Ray: whole batches go to the actors in turn.
    shards: int = 0

    def __post_init__(self):
        check_numbers(self, "sampling.")
        _at_least(self, "sampling", ["max_new_tokens", "shards"], 0, "0: the checkpoint's or the task's default "
                  "(max_new_tokens), one per rollout worker (shards)")
        require(self.temperature is None or self.temperature > 0,
                f"config: sampling.temperature must be > 0, got {self.temperature}",
                "on-policy training samples; greedy rollouts are not on-policy")
        require(self.top_k is None or self.top_k >= 0, f"config: sampling.top_k must be >= 0, got {self.top_k}",
                "0 is off")
        require(self.top_p is None or 0 < self.top_p <= 1, f"config: sampling.top_p must be in (0, 1], got {self.top_p}")

    @property
    def truncates(self) -> bool:
        """top-k or top-p cut the rollouts' distributions (sampling.py: a mismatch source of its own)."""
        return bool(self.top_k) or (self.top_p is not None and self.top_p < 1)

    def params(self) -> dict:
        """temperature, top_k, top_p as the rollouts use them (call on a resolved config: resolve_generation)."""
        return {"temperature": self.temperature or 1.0, "top_k": self.top_k or 0,
                "top_p": 1.0 if self.top_p is None else self.top_p}


@dataclass(frozen=True)
class OptimConfig:
    """The learner's optimizer (AdamW) and learning-rate schedule."""
    lr: float = 1e-3
    warmup_steps: int = 20
    schedule: str = "cosine"  # after warm-up: "cosine" (to lr/10 at `steps`) or "constant"
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self):
        check_numbers(self, "optim.")
        require(self.lr > 0, f"config: optim.lr must be positive, got {self.lr}")
        require(self.grad_clip > 0, f"config: optim.grad_clip must be positive, got {self.grad_clip}")
        require(self.weight_decay >= 0, f"config: optim.weight_decay must be >= 0, got {self.weight_decay}")
        _at_least(self, "optim", ["warmup_steps"], 0)
        _one_of(self, "optim", "schedule", LR_SCHEDULES)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: before training, every `every` steps, and after."""
    every: int = 75  # 0: only before and after training
    examples: int = 500
    prompts: str = ""  # JSONL held-out prompts; "": `fraction` of data.prompts (or the task's held-out set)
    fraction: float = 0.1  # share of data.prompts held out for evaluation (by a hash of the prompt)
    batch_size: int = 0  # held-out prompts per generation batch; 0: 2**24 floats / vocab (all, at vocab 100)

    def __post_init__(self):
        check_numbers(self, "eval.")
        _at_least(self, "eval", ["examples"], 1)
        _at_least(self, "eval", ["every"], 0, "0: only before and after training")
        _at_least(self, "eval", ["batch_size"], 0, "0 chooses it automatically")
        require(0 <= self.fraction < 1, f"config: eval.fraction must be in [0, 1), got {self.fraction}")


@dataclass(frozen=True)
class EngineConfig:
    """The rollout engine (the precision it runs at is the top-level `plan`)."""
    name: str = "builtin"  # "builtin" (emulated precisions), "vllm" (vllm_engine.py), "hf" (hf_engine.py): engines.py
    compile: bool = False  # builtin engine: torch.compile its forward (faster decoding, ~1 min to compile)

    def __post_init__(self):
        _one_of(self, "engine", "name", ENGINES)
        require(not self.compile or engines.kind(self.name).compiles, f"engine.compile applies to the builtin engine, "
                f"not {self.name}", "drop engine.compile")


@dataclass(frozen=True)
class AsyncConfig:
    """The async schedule (schedule: async): a rollout worker process samples while the trainer trains."""
    max_staleness: int = 1  # most optimizer steps a rollout's weights may lag the learner's
    prefetch: int = -1  # batches the worker may sample ahead of the one being trained; -1: max_staleness
    stale_policy: str = "requeue"  # a rollout older than max_staleness is re-sampled ("requeue") or "drop"ped
    recompute_fraction: float = 1.0  # share of each batch (its first rollouts) whose q the worker recomputes
    worker_threads: int = 1  # the rollout worker's threads (the trainer gets threads - worker_threads)
    worker_timeout: float = 120.0  # seconds without a message from a busy worker before it counts as hung
    max_worker_restarts: int = 2  # a dead or hung worker is restarted this many times, then the run stops
    backend: str = "process"  # the rollout workers: "process" (one of our own, this machine) or "ray" (section ray)

    def __post_init__(self):
        check_numbers(self, "async.")
        _one_of(self, "async", "stale_policy", STALE_POLICIES)
        _one_of(self, "async", "backend", BACKENDS)
        _at_least(self, "async", ["max_staleness", "max_worker_restarts"], 0)
        _at_least(self, "async", ["prefetch"], -1, "-1: max_staleness")
        require(0 <= self.recompute_fraction <= 1,
                f"config: async.recompute_fraction must be in [0, 1], got {self.recompute_fraction}")
        _at_least(self, "async", ["worker_threads"], 1)
        require(self.worker_timeout > 0, f"config: async.worker_timeout must be positive, got {self.worker_timeout}")

    @property
    def lookahead(self) -> int:
        """Batches the async worker may sample beyond the one being trained."""
        return self.max_staleness if self.prefetch < 0 else self.prefetch


@dataclass(frozen=True)
class RayConfig:
    """The Ray backend (async.backend: ray, ray_backend.py): rollout workers as Ray actors, the learner here."""
    address: str = ""  # "": a local cluster started for the run; "auto": the `ray start` cluster here; or HOST:PORT
    workers: int = 1  # rollout actors; each samples its shards of every batch (sampling.shards)
    worker_cpus: float = 1.0  # Ray resources each rollout actor reserves
    worker_gpus: float = 0.0
    connect_timeout: float = 60.0  # seconds to wait for the cluster to answer, and for an actor to start
    teacher: bool = False  # the teacher's forward on a scoring actor of its own (its output layer stays here)
    teacher_cpus: float = 1.0  # Ray resources the teacher actor reserves
    teacher_gpus: float = 0.0

    def __post_init__(self):
        check_numbers(self, "ray.")
        _at_least(self, "ray", ["workers"], 1)
        require(self.teacher_cpus >= 0 and self.teacher_gpus >= 0 and self.teacher_cpus + self.teacher_gpus > 0,
                f"config: ray.teacher_cpus and ray.teacher_gpus must be >= 0, not both 0 (got {self.teacher_cpus}, "
                f"{self.teacher_gpus})", "e.g. ray.teacher_cpus=1")
        require(self.worker_cpus >= 0 and self.worker_gpus >= 0 and self.worker_cpus + self.worker_gpus > 0,
                f"config: ray.worker_cpus and ray.worker_gpus must be >= 0, not both 0 (got {self.worker_cpus}, "
                f"{self.worker_gpus})", "e.g. ray.worker_cpus=1")
        require(self.connect_timeout > 0, f"config: ray.connect_timeout must be positive, got {self.connect_timeout}")


@dataclass(frozen=True)
class GuardConfig:
    """The runtime admission check on the live rollouts (guard.py)."""
    every: int = 0  # every this many steps; 0: off
    action: str = "warn"  # on REJECT: "warn", "fallback" (a safer plan from then on, guard.safer_plan), "stop"
    thresholds: str = ""  # a thresholds file from `opd calibrate`; "": the shipped opd/thresholds.json
    limit: float = 0.0  # > 0: this limit on the rollout-vs-learner nsr (admission.py), not the calibrated one

    def __post_init__(self):
        check_numbers(self, "guard.")
        _one_of(self, "guard", "action", GUARD_ACTIONS)
        _at_least(self, "guard", ["every"], 0, "0 turns it off")
        require(self.limit >= 0, f"config: guard.limit must be >= 0, got {self.limit}", "0 uses the calibrated limit")


@dataclass(frozen=True)
class ComputeConfig:
    """Devices, dtypes and how full-vocabulary work is split (memory)."""
    device: str = "auto"  # learner and rollout engine: auto (CUDA when present, else CPU), cpu, cuda, cuda:N
    teacher_device: str = ""  # the teacher's device; "": the same as `device`
    dtype: str = "float32"  # learner compute: float32, or bf16 (autocast; float32 master weights and optimizer)
    teacher_dtype: str = "float32"  # the teacher's weights and compute: float32 or bf16
    micro_batch_size: int = 0  # rollouts per learner/teacher forward (gradients accumulated); 0: the whole batch
    chunk_tokens: int = 0  # tokens per chunk of full-vocabulary work (chunked.py); 0: 2**24 floats / vocab

    def __post_init__(self):
        check_numbers(self, "compute.")
        check_name(self.device, "compute.device")
        if self.teacher_device:
            check_name(self.teacher_device, "compute.teacher_device")
        check_dtype_name(self.dtype, "compute.dtype")
        check_dtype_name(self.teacher_dtype, "compute.teacher_dtype")
        _at_least(self, "compute", ["micro_batch_size", "chunk_tokens"], 0, "0 chooses it automatically")


@dataclass(frozen=True)
class TeacherConfig:
    """The teacher: its checkpoint, and who scores the student's tokens for it (teacher.py). `teacher: DIR` in a file
    (or --set teacher=DIR) is short for `teacher: {path: DIR}`."""
    path: str = ""  # HF checkpoint folder of the teacher ("": the pair of `family`; give student with it)
    # who scores: "trainer" = its full-precision forward here; "builtin" = the built-in engine under `plan`, scoring
    # by prefill; "vllm" = vLLM's prompt log-probs
    engine: str = "trainer"
    plan: str | dict = ""  # the teacher engine's precision plan (plan.py); "" = float32
    topk: int = 0  # the teacher returns only its k most likely tokens (and the sampled one); 0 = whole rows
    check: float = 0.25  # share of each batch the trainer's teacher also scores, for teacher_mismatch/*

    def __post_init__(self):
        check_numbers(self, "teacher.")
        _one_of(self, "teacher", "engine", TEACHER_ENGINES)
        require(isinstance(self.plan, (str, dict)),
                f"config: teacher.plan must be a string or a mapping, got {self.plan!r:.60}")
        require(self.engine != "trainer" or not self.plan,
                f"config: teacher.plan {self.plan!r:.60} needs an inference engine for the teacher",
                "set teacher.engine=builtin (or vllm), or drop teacher.plan")
        require(self.topk >= 0, f"config: teacher.topk must be >= 0, got {self.topk}",
                "0 = the teacher's whole distributions")
        require(0 <= self.check <= 1, f"config: teacher.check must be in [0, 1], got {self.check}")

    @property
    def served(self) -> bool:
        """Someone other than the trainer's own teacher scores (an engine, or a top-k cut): checked against it."""
        return self.engine != "trainer" or self.topk > 0


SECTIONS = {"teacher": TeacherConfig, "data": DataConfig, "sampling": SamplingConfig, "loss": LossConfig, "optim": OptimConfig,
            "eval": EvalConfig, "engine": EngineConfig, "async": AsyncConfig, "ray": RayConfig, "guard": GuardConfig,
            "compute": ComputeConfig}  # a config file's sections (their YAML keys) and their types


def attribute(key: str) -> str:
    """A section's attribute name on TrainConfig: its key, or key_ where the key is a Python keyword (async)."""
    return key + "_" if keyword.iskeyword(key) else key


@dataclass
class TrainConfig:
    """One OPD run. Run-wide settings at the top; the rest in sections (SECTIONS), each checking its own values;
    __post_init__ checks what spans sections."""
    family: str = "llama"  # a built-in pair (llama, qwen3) or a real one (smollm2, qwen2.5-coder), when student/teacher are empty
    student: str = ""  # HF checkpoint folder of the student (and teacher.path the teacher's)
    task: str = "chain"  # the built-in task: training prompts and held-out evaluation unless data.prompts is given
    steps: int = 150
    batch_size: int = 64  # prompts (= rollouts) per optimizer step
    seed: int = 0
    plan: str | dict = "forward=bf16 kv=bf16"  # rollout precision plan (plan.py): BF16 rollouts; "" = float32
    noise_seed: int = 0  # the plan's weight-noise draws
    schedule: str = "sync"  # "async": a rollout worker process samples while the trainer trains (section async)
    threads: int = 2  # CPU threads for the whole run (async: split between the worker and the trainer)
    exact_kl: bool = True  # also log the exact per-position KL(p_rollout || p_train) (needs the engine's distributions)
    save_every: int = 50  # 0: only at the end (and on Ctrl-C)
    max_bad_steps: int = 5  # stop after this many non-finite losses/gradients in a row
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)

    def __post_init__(self):
        check_numbers(self, "")
        for key, cls in SECTIONS.items():
            require(isinstance(getattr(self, attribute(key)), cls), f"config: {key} must be a mapping, "
                    f"got {getattr(self, attribute(key))!r:.60}", f"e.g. {key}: {{...}}")
        require(self.family in FAMILIES + REAL_PAIRS, f"unknown family {self.family!r}",
                f"use one of {', '.join(FAMILIES + REAL_PAIRS)} (a built-in pair or a real one)")
        require(bool(self.student) == bool(self.teacher.path), "give both student and teacher, or neither",
                "neither: the built-in pair of `family`")
        get_task(self.task)
        for name in ("steps", "batch_size", "threads", "max_bad_steps"):
            require(getattr(self, name) > 0, f"config: {name} must be positive, got {getattr(self, name)}")
        require(self.save_every >= 0, f"config: save_every must be >= 0, got {self.save_every}")
        require(isinstance(self.plan, (str, dict)), f"config: plan must be a string or a mapping, got {self.plan!r}")
        require(self.schedule in SCHEDULES, f"unknown schedule {self.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
        # what spans sections
        require(not self.data.prompts or self.eval.prompts or self.eval.fraction > 0,
                "config: a prompt file needs held-out prompts for evaluation", "set eval.fraction > 0 or eval.prompts")
        require(not (self.guard.every and self.schedule == "async" and self.async_.recompute_fraction == 0),
                "config: the runtime guard reads the rollouts' numerics mismatch (q vs mu), which an async run "
                "only has with async.recompute_fraction > 0", "set async.recompute_fraction (e.g. 0.25) or guard.every=0")
        require(self.batch_size % max(self.compute.micro_batch_size, 1) == 0,
                f"config: compute.micro_batch_size {self.compute.micro_batch_size} does not divide batch_size "
                f"{self.batch_size}", "use a divisor of batch_size (gradients are accumulated over equal "
                "micro-batches), or 0")
        require(self.schedule != "async" or self.threads > self.async_.worker_threads,
                f"config: async needs more threads ({self.threads}) than the rollout worker's "
                f"({self.async_.worker_threads})", "the trainer gets threads - async.worker_threads; on 2 cores use "
                "threads=2 async.worker_threads=1")
        require(self.async_.backend != "ray" or self.schedule == "async",
                "config: async.backend ray is the async schedule's", "set schedule=async")
        require(not self.ray.teacher or self.async_.backend == "ray",
                "config: ray.teacher needs the Ray backend", "set schedule=async and async.backend=ray")
        require(engines.kind(self.engine.name).truncated_raw or not self.sampling.truncates, f"config: engine "
                f"{self.engine.name} with sampling.top_k {self.sampling.top_k or 0} / top_p {self.sampling.top_p or 1}: "
                "it returns the truncated log-probs only, so the rollouts' numerics mismatch could not be told from "
                "the truncation",
                "sample untruncated (top_k 0, top_p 1: OPD's on-policy default), or use engine builtin")
        self._check_teacher_side()
        require(self.shards <= self.batch_size, f"config: sampling.shards {self.shards} is more than batch_size "
                f"{self.batch_size}", "each sub-batch needs a prompt; leave sampling.shards at 0 (one per worker)")

    def _check_teacher_side(self) -> None:
        require(not self.ray.teacher or not self.teacher.served,
                "config: ray.teacher runs the trainer's teacher, whole, on an actor, not teacher.engine "
                f"{self.teacher.engine} or a top-k teacher", "drop ray.teacher, or teacher.engine / teacher.topk")
        k, loss = self.teacher.topk, self.loss
        if not k:
            return
        require(loss.name in TOPK_TEACHER_LOSSES, f"config: loss.name {loss.name} needs the teacher's whole "
                f"distribution, but teacher.topk={k} gives only its top {k} log-probs", "use loss.name sampled_rkl, "
                "topk_fkl or topk_rkl_tail (and loss.topk <= teacher.topk), or teacher.topk=0")
        require(loss.name != "topk_rkl" or loss.topk_support == "teacher", "config: loss topk_rkl on the student's "
                f"top-k needs the teacher's log-probs there, but teacher.topk={k} gives only the teacher's top {k}",
                "set loss.topk_support=teacher, or use topk_fkl / topk_rkl_tail")
        require(not loss.name.startswith("topk") or loss.topk <= k, f"config: loss.topk {loss.topk} is more than "
                f"the teacher returns (teacher.topk={k})", f"set loss.topk <= {k}, or raise teacher.topk")

    @property
    def rollout_workers(self) -> int:
        """The processes that sample: 1 (this one, or the async worker), or ray.workers Ray actors."""
        return self.ray.workers if self.schedule == "async" and self.async_.backend == "ray" else 1

    @property
    def shards(self) -> int:
        """Sub-batches per batch (sampling.shards; 0: one per rollout worker)."""
        return self.sampling.shards or self.rollout_workers

    @property
    def new_tokens(self) -> int:
        return self.sampling.max_new_tokens or (FILE_PROMPT_TOKENS if self.data.prompts
                                                else get_task(self.task).max_new_tokens)

    def to_dict(self) -> dict:
        """The config as its YAML file would hold it (sections under their keys)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name.removesuffix("_") if f.name.endswith("_") else f.name] = \
                asdict(value) if f.name.rstrip("_") in SECTIONS else value
        return out


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


# Each setting that was a top-level key before the config had sections -> its name now.
MOVED = {old: f"{section}.{new}" for section, names in {
    "data": "prompts prompt_key answer_key chat max_prompt_tokens long_prompts scoring",
    "sampling": "max_new_tokens temperature top_k top_p",
    "optim": "lr warmup_steps lr_schedule:schedule weight_decay grad_clip",
    "eval": "eval_every:every eval_examples:examples eval_prompts:prompts eval_fraction:fraction "
            "eval_batch_size:batch_size",
    "engine": "engine:name engine_compile:compile",
    "async": "max_staleness prefetch stale_policy recompute_fraction worker_threads worker_timeout max_worker_restarts",
    "guard": "guard_every:every guard_action:action guard_thresholds:thresholds guard_limit:limit",
    "compute": "device teacher_device dtype teacher_dtype micro_batch_size chunk_tokens",
    "teacher": "teacher_engine:engine teacher_plan:plan teacher_topk:topk teacher_check:check",
}.items() for old, _, new in (name.partition(":") for name in names.split()) for new in [new or old]}


def moved(key: str, value) -> OpdError:
    """The error for a key from before the sections, naming its new place."""
    section, name = MOVED[key].split(".")
    text = f"{json.dumps(value)!s:.40}" if isinstance(value, (str, int, float, bool)) else "..."
    return OpdError(f"config key {key!r} is now {MOVED[key]!r}",
                    f"write {section}: {{{name}: {text}}}, or --set {MOVED[key]}={text}")


def _checked_keys(values: dict, cls, prefix: str = "") -> dict:
    names = [f.name.removesuffix("_") for f in fields(cls)]
    for key, value in values.items():
        if key in names:
            continue
        if not prefix and key in MOVED:
            raise moved(key, value)
        known = {name: prefix + name for name in names} | ({} if prefix else MOVED)  # a typo of a moved key too
        close = difflib.get_close_matches(str(key), list(known), n=1)
        raise OpdError(f"unknown config key {prefix + str(key)!r}",
                       f"did you mean {known[close[0]]}?" if close else f"valid keys: {', '.join(names)}")
    return values


PLAN_KEYS = ("plan", "teacher.plan")  # precision plans: a string, or a mapping of layers to settings strings
OPTIONAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # settings whose default is None: a value of this type


def _typed(key: str, value, default):
    """Check a YAML value against the type of the field's default (ints are accepted for floats)."""
    leaf = key.rpartition(".")[2]
    if default is None and leaf in OPTIONAL:
        return None if value is None else _typed(key, value, OPTIONAL[leaf])
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            (isinstance(value, float) or abs(value) < 1e308)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, str) and key in PLAN_KEYS:
        ok = isinstance(value, str) or (isinstance(value, dict) and all(
            isinstance(k, (str, int)) and not isinstance(k, bool) and isinstance(v, str) for k, v in value.items()))
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        ok = True
    names = {bool: "true or false", float: "a number", int: "an integer", str: "a string"}
    expected = "a string or a mapping of layers to settings strings" if key in PLAN_KEYS else names[type(default)]
    require(ok, f"config: {key} must be {expected}, got {value!r:.60}",
            f"e.g. {key}: \"kv=fp8_e4m3\"" if key in PLAN_KEYS else f"e.g. --set {key}={json.dumps(default)}")
    return value


def _checked_values(values, where: str = "config") -> dict:
    """values with their keys and types checked (no range checks yet: each section's own); errors name `where`."""
    try:
        require(isinstance(values, dict), f"config: expected a mapping of keys to values, got {type(values).__name__}",
                "write key: value lines")
        values = expand_shorthand(values)
        _checked_keys(values, TrainConfig)
        defaults = TrainConfig()
        out = {}
        for key, value in values.items():
            if key in SECTIONS:
                if key in MOVED and not isinstance(value, dict):  # engine: vllm, from before the sections
                    raise moved(key, value)
                require(isinstance(value, dict), f"config: {key} must be a mapping (a section)",
                        f"e.g. {key}: {{{fields(SECTIONS[key])[0].name}: ...}}, or --set {key}."
                        f"{fields(SECTIONS[key])[0].name}=...")
                _checked_keys(value, SECTIONS[key], f"{key}.")
                section = asdict(getattr(defaults, attribute(key)))
                out[key] = {k: _typed(f"{key}.{k}", v, section[k]) for k, v in value.items()}
            else:
                out[key] = _typed(key, value, getattr(defaults, key))
        return out
    except OpdError as e:
        if where == "config":
            raise
        raise OpdError(f"{where}: {e.problem.removeprefix('config: ')}", e.fix) from None


def expand_shorthand(values):
    """`teacher: DIR` -> `teacher: {path: DIR}` (the teacher's checkpoint, as `student: DIR` names the student's)."""
    if isinstance(values, dict) and isinstance(values.get("teacher"), str):
        return {**values, "teacher": {"path": values["teacher"]}}
    return values


def build_config(values: dict, where: str = "config") -> TrainConfig:
    """A TrainConfig from a mapping as a config file holds it (sections as nested mappings), with key, type and
    range checks."""
    out = _checked_values(values, where)
    try:
        for key, cls in SECTIONS.items():
            if key in out:
                out[attribute(key)] = cls(**out.pop(key))
        return TrainConfig(**out)
    except OpdError as e:
        problem = e.problem if where == "config" else f"{where}: {e.problem.removeprefix('config: ')}"
        raise OpdError(problem, e.fix or "each key's meaning and range: opd/config.py") from None


def migrate(values: dict) -> dict:
    """A config that opd itself saved before the config had sections (a run's config.yaml, a results line) in today's
    layout; a config a user writes with an old key is refused instead (_checked_keys names the new key)."""
    out = {}
    for key, value in expand_shorthand(values).items():
        if key in MOVED and not (key in SECTIONS and isinstance(value, dict)):
            section, name = MOVED[key].split(".")
            out.setdefault(section, {})[name] = value
        else:
            out[key] = merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def stored_teacher(values: dict) -> TeacherConfig:
    """The teacher section of a config opd stored (a results line's or a run's, of any release)."""
    section = migrate(values).get("teacher", {})
    names = {f.name for f in fields(TeacherConfig)}
    return TeacherConfig(**{k: v for k, v in section.items() if k in names})


def known_settings(values: dict) -> dict:
    """values without the keys this release does not have (top-level and in sections): a stored config from a
    release with more settings."""
    defaults = TrainConfig().to_dict()
    return {key: ({k: v for k, v in value.items() if k in defaults[key]} if key in SECTIONS and
                  isinstance(value, dict) else value) for key, value in values.items() if key in defaults}


def flatten(values: dict, prefix: str = "") -> dict:
    """{"async": {"max_staleness": 2}} -> {"async.max_staleness": 2}."""
    out = {}
    for key, value in values.items():
        if key in SECTIONS and not prefix and isinstance(value, dict):
            out.update(flatten(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


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
        if not parents and leaf == "teacher" and isinstance(value, str) and isinstance(out.get(leaf), dict):
            parents, leaf, value = [leaf], "path", value  # teacher=DIR after teacher.*: its path
        out = expand_shorthand(out)  # teacher=DIR, then teacher.engine=...
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
    return build_config(merge(expand_shorthand(values), expand_shorthand(parse_overrides(list(overrides)))))


def generation_defaults(generation: dict, **given) -> dict:
    """The sampling settings `given` (temperature, top_k, top_p), each left unset (None) taken from a checkpoint's
    generation_config.json (`generation`), else its OPTIONAL default (temperature 1, top-k and top-p off)."""
    return {name: value if value is not None else generation.get(name, OPTIONAL[name]) for name, value in given.items()}


def resolve_generation(cfg: TrainConfig, generation: dict) -> TrainConfig:
    """The config with the sampling settings the user left unset filled in: what a run actually uses, and what it
    saves and compares on resume. Training rollouts sample the student's own distribution: temperature 1, no top-k,
    no top-p (OPD is on-policy; truncation makes `mu` another policy's log-prob and enters every mismatch metric,
    which is why peers require it off, NeMo-RL #3584), whatever the checkpoint's generation_config.json says, so a
    checkpoint's defaults never change the estimator silently; a note names the settings left unused. Set
    sampling.temperature / top_k / top_p to sample otherwise (the truncation is then measured apart: metrics.py's
    sampling/). max_new_tokens: the config's, else generation_config.json's, else the task's or FILE_PROMPT_TOKENS."""
    given = cfg.sampling
    unused = {k: generation[k] for k in ("temperature", "top_k", "top_p") if getattr(given, k) is None and
              generation.get(k) not in (None, OPTIONAL[k])}
    if unused:
        import sys
        text = ", ".join(f"{k} {v}" for k, v in unused.items())
        print(f"opd: note: the checkpoint's generation_config.json sets {text}: not used for training rollouts, "
              "which sample the student's own distribution (set sampling.* to use them)", file=sys.stderr)
    chosen = {k: OPTIONAL[k] if getattr(given, k) is None else getattr(given, k) for k in OPTIONAL}
    new_tokens = given.max_new_tokens or generation.get("max_new_tokens") or cfg.new_tokens
    return replace(cfg, sampling=replace(given, max_new_tokens=int(new_tokens), temperature=float(chosen["temperature"]),
                                         top_k=int(chosen["top_k"]), top_p=float(chosen["top_p"])))


def dump_config(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
