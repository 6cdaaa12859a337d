"""The config's sections: one frozen dataclass per group of settings (data, sampling, loss, optim, eval, engine,
async, ray, guard, compute, teacher), each checking its own values in __post_init__, and the choices they take.
config.py assembles them into a TrainConfig; config_file.py reads them from YAML and `--set`.
"""
import math
import re
from dataclasses import dataclass, field, fields

from opd.engines import kinds as engines
from opd.io.errors import OpdError, require
from opd.data.real_pairs import PAIRS
from opd.data.scoring import check_name as check_scoring

FAMILIES = ("llama", "qwen3")
# Device and dtype names a config may use: models/devices.py resolves them on the machine (and keeps the same names:
# tests/test_config.py ties the two), without this module loading torch.
DTYPE_NAMES = ("float32", "bf16")
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"  # the built-in pairs' model families (pretrain.py)
REAL_PAIRS = tuple(PAIRS)  # real pretrained pairs, built from registry packages (real_pairs.py)

SCHEDULES = ("sync", "async")
BACKENDS = ("process", "ray", "inline")
ENGINES = engines.NAMES  # the rollout engines' kinds (engines.KINDS)
BF16_GEMMS = ("float32", "native", "auto")  # how the built-in engine computes a bf16 forward's matmuls on a CPU
TEACHER_ENGINES = ("trainer", "builtin", "vllm")  # who scores the student's tokens for the teacher (teacher.py)
TOPK_TEACHER_LOSSES = ("sampled_rkl", "topk_fkl", "topk_rkl_tail", "topk_rkl")  # what a top-k teacher can drive
STALE_POLICIES = ("requeue", "drop")
GUARD_ACTIONS = ("warn", "fallback", "stop")
LR_SCHEDULES = ("cosine", "constant")
LONG_PROMPTS = ("refuse", "drop")
FILE_PROMPT_TOKENS = 512  # max_new_tokens with a prompt file when neither the config nor the checkpoint sets it
SEED_LIMIT = 2 ** 32  # seeds are in [0, SEED_LIMIT): sampler_seed(seed, step) must stay a 64-bit generator seed
INT_LIMIT = 2 ** 31  # any other integer setting (a count or a size) is below it


# Each loss and its estimator family, declared here with the loss: "sampled" losses take the reverse KL's gradient
# through the sampled token's log-prob (the admission check judges them by student_term and correction:
# admission.estimator_class), "full" ones compare whole (or top-k) distributions at each position.
LOSS_FAMILIES = {"sampled_rkl": "sampled", "full_rkl": "full", "topk_rkl": "full", "fkl": "full", "jsd": "full",
                 "topk_fkl": "full", "topk_rkl_tail": "full"}
LOSSES = tuple(LOSS_FAMILIES)
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

    @property
    def estimator_class(self) -> str:
        """The admission check's class: "full", or for a sampled loss "corrected" (TIS/MIS), "sampler" or "learner"
        (its student term)."""
        if LOSS_FAMILIES[self.name] == "full":
            return "full"
        if self.correction != "none":
            return "corrected"
        return "sampler" if self.student_term == "sampler" else "learner"




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
    greedy: bool = True  # also decode greedily (eval/accuracy, eval/truncated); False: the sampled quality only
    # "sampled": every evaluation samples the held-out completions anew and scores the reverse KL and entropy on them;
    # "fixed": the first evaluation's samples are kept (eval_contexts.json in the run folder) and every later one
    # scores the same contexts exactly (full-vocabulary KL and entropy at each position): no sampling noise between
    # evaluations, and none between runs that share eval.seed and their first weights; the final evaluation also
    # samples anew (eval/sampled_*); "teacher": the same, on completions the TEACHER samples once (at the first
    # evaluation, the eval seed's stream; the student's own samples are still scored at the first and final
    # evaluations, eval/sampled_*): the student where the teacher goes, a quality every run of a grid scores alike and
    # that a student's fading first tokens do not move (docs/tolerance.md, "The close real pair")
    contexts: str = "sampled"
    resample_final: bool = True  # under kept contexts (fixed, teacher): the final evaluation samples anew too
    # sampled completions per held-out prompt (sampled accuracy: pass@1 over them; reverse KL and entropy pooled over
    # their tokens; under kept contexts, that many contexts a prompt): on a few held-out prompts one sample each
    # leaves sampling noise the size of a run's effects (docs/tolerance.md, "The close real pair")
    samples: int = 1
    # the held-out samples' seed; -1: the run's seed + 1 (runs of different seeds sample differently)
    seed: int = field(default=-1, metadata={"auto": -1})

    @property
    def kept(self) -> bool:
        """The evaluation contexts are sampled once and kept (eval_contexts.json): contexts "fixed" or "teacher"."""
        return self.contexts != "sampled"

    def __post_init__(self):
        check_numbers(self, "eval.")
        _at_least(self, "eval", ["examples", "samples"], 1)
        _at_least(self, "eval", ["every"], 0, "0: only before and after training")
        _at_least(self, "eval", ["batch_size"], 0, "0 chooses it automatically")
        require(0 <= self.fraction < 1, f"config: eval.fraction must be in [0, 1), got {self.fraction}")
        _one_of(self, "eval", "contexts", ("sampled", "fixed", "teacher"))


@dataclass(frozen=True)
class EngineConfig:
    """The rollout engine (the precision it runs at is the top-level `plan`)."""
    name: str = "builtin"  # "builtin" (emulated precisions), "vllm" (vllm_engine.py), "hf" (hf_engine.py): engines.py
    compile: bool = False  # builtin engine: torch.compile its forward (faster decoding, ~1 min to compile)
    # builtin engine, forward=bf16 plans on a CPU: "float32" GEMMs of the bf16 weights (exact bf16 products, float32
    # sums), "native" bf16 GEMMs (float32 sums too; AMX or AVX512-BF16 run them faster), or "auto": native where the
    # CPU has them. CUDA always runs bf16 GEMMs.
    bf16_gemm: str = "float32"

    def __post_init__(self):
        _one_of(self, "engine", "name", ENGINES)
        _one_of(self, "engine", "bf16_gemm", BF16_GEMMS)
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
    # the rollout workers: "process" (one of our own, this machine), "ray" (section ray), or "inline": no worker, the
    # same batches sampled in the trainer's process (the same staleness, no overlap, no second copy of the student)
    backend: str = "process"

    def __post_init__(self):
        check_numbers(self, "async.")
        _one_of(self, "async", "stale_policy", STALE_POLICIES)
        _one_of(self, "async", "backend", BACKENDS)
        _at_least(self, "async", ["max_staleness", "max_worker_restarts"], 0)
        _at_least(self, "async", ["prefetch"], -1, "-1: max_staleness")
        require(0 <= self.recompute_fraction <= 1,
                f"config: async.recompute_fraction must be in [0, 1], got {self.recompute_fraction}")
        _at_least(self, "async", ["worker_threads"], 1)
        require(self.backend != "inline" or self.prefetch <= self.max_staleness,
                f"config: async.backend inline samples at most max_staleness ({self.max_staleness}) batches ahead, "
                f"and async.prefetch is {self.prefetch}", "set async.prefetch to -1 or at most async.max_staleness")
        require(self.worker_timeout > 0, f"config: async.worker_timeout must be positive, got {self.worker_timeout}")

    @property
    def lookahead(self) -> int:
        """Batches the async worker may sample beyond the one being trained."""
        return self.max_staleness if self.prefetch < 0 else self.prefetch


@dataclass(frozen=True)
class RayConfig:
    """The Ray backend (async.backend: ray, ray_backend.py): rollout workers as Ray actors, the learner here; and Ray
    placing a sharded learner's ranks (ray.learner, ray_ranks.py)."""
    address: str = ""  # "": a local cluster started for the run; "auto": the `ray start` cluster here; or HOST:PORT
    workers: int = 1  # rollout actors; each samples its shards of every batch (sampling.shards)
    worker_cpus: float = 1.0  # Ray resources each rollout actor reserves
    worker_gpus: float = 0.0
    connect_timeout: float = 60.0  # seconds to wait for the cluster to answer, and for an actor to start
    teacher: bool = False  # the teacher's forward on a scoring actor of its own (its output layer stays here)
    teacher_cpus: float = 1.0  # Ray resources the teacher actor reserves
    teacher_gpus: float = 0.0
    learner: bool = False  # a sharded learner's ranks (compute.learner_ranks) placed by Ray, not started here
    learner_cpus: float = 1.0  # Ray resources each learner rank reserves (its bundle of the placement group)
    learner_gpus: float = 0.0

    def __post_init__(self):
        check_numbers(self, "ray.")
        _at_least(self, "ray", ["workers"], 1)
        require(self.teacher_cpus >= 0 and self.teacher_gpus >= 0 and self.teacher_cpus + self.teacher_gpus > 0,
                f"config: ray.teacher_cpus and ray.teacher_gpus must be >= 0, not both 0 (got {self.teacher_cpus}, "
                f"{self.teacher_gpus})", "e.g. ray.teacher_cpus=1")
        require(self.worker_cpus >= 0 and self.worker_gpus >= 0 and self.worker_cpus + self.worker_gpus > 0,
                f"config: ray.worker_cpus and ray.worker_gpus must be >= 0, not both 0 (got {self.worker_cpus}, "
                f"{self.worker_gpus})", "e.g. ray.worker_cpus=1")
        require(self.learner_cpus >= 0 and self.learner_gpus >= 0 and self.learner_cpus + self.learner_gpus > 0,
                f"config: ray.learner_cpus and ray.learner_gpus must be >= 0, not both 0 (got {self.learner_cpus}, "
                f"{self.learner_gpus})", "e.g. ray.learner_cpus=1")
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
class CanaryConfig:
    """Canary training (training/canary.py): the run trains on its own plan while a candidate plan samples the same
    prompts with the same seeds beside it; the candidate is promoted when the gradient-bias statistic (health/drift.py)
    admits it, and dropped again when the same statistic, watched after the switch, rejects it."""
    plan: str = ""  # the candidate's rollout plan (plan.py); "": off
    max_staleness: int = 0  # the candidate's schedule: async at this staleness (the async section's worker settings)
    every: int = 1  # a shadow batch every this many steps before the decision
    min_batches: int = 4  # pairs of gradients before any decision
    max_batches: int = 16  # pairs without a decision: the run stays on its own plan and stops shadowing
    cut: float = 0.0  # the cut on z; 0: the shipped one (health/drift.py CUT)
    sigmas: float = 2.0  # a promotion needs z + sigmas * se <= cut (a rejection z - se > cut; after a promotion the
    #                      fall back z > cut): promoting is the risky switch
    watch_every: int = 4  # after a promotion: a shadow batch of the run's own plan every this many steps; 0: none
    start: str = "shadow"  # "shadow": on the run's plan until the candidate is admitted; "promoted": on the candidate
    #                        from step 0, watched (the runtime guard on the gradient statistic: falls back on REJECT)

    def __post_init__(self):
        check_numbers(self, "canary.")
        _one_of(self, "canary", "start", ("shadow", "promoted"))
        require(isinstance(self.plan, str), f"config: canary.plan must be a plan string, got {self.plan!r:.60}",
                "e.g. canary.plan='kv=fp8_e4m3'")
        _at_least(self, "canary", ["every", "min_batches"], 1, "")
        _at_least(self, "canary", ["watch_every"], 0, "0 stops watching after a promotion")
        _at_least(self, "canary", ["max_staleness"], 0, "0: the synchronous schedule")
        require(self.min_batches >= 2, f"config: canary.min_batches must be >= 2, got {self.min_batches}",
                "the statistic needs two pairs for its noise")
        require(self.max_batches >= self.min_batches, f"config: canary.max_batches ({self.max_batches}) is below "
                f"canary.min_batches ({self.min_batches})", "raise canary.max_batches")
        require(self.cut >= 0, f"config: canary.cut must be >= 0, got {self.cut}", "0 uses the shipped cut")
        require(self.sigmas >= 0, f"config: canary.sigmas must be >= 0, got {self.sigmas}", "2 is the default")


@dataclass(frozen=True)
class ComputeConfig:
    """Devices, dtypes and how full-vocabulary work is split (memory)."""
    device: str = "auto"  # learner and rollout engine: auto (CUDA when present, else CPU), cpu, cuda, cuda:N
    teacher_device: str = ""  # the teacher's device; "": the same as `device`
    dtype: str = "float32"  # learner compute: float32, or bf16 (autocast; float32 master weights and optimizer)
    teacher_dtype: str = "float32"  # the teacher's weights and compute: float32 or bf16
    micro_batch_size: int = 0  # rollouts per learner/teacher forward (gradients accumulated); 0: the whole batch
    chunk_tokens: int = 0  # tokens per chunk of full-vocabulary work (chunked.py); 0: 2**24 floats / vocab
    learner_ranks: int = 1  # processes the learner is sharded over (FSDP2, training/sharded.py); 1: not sharded
    sharded: bool = False  # the sharded learner's code path on one rank too (a check of it, e.g. on one GPU)

    def __post_init__(self):
        check_numbers(self, "compute.")
        check_name(self.device, "compute.device")
        if self.teacher_device:
            check_name(self.teacher_device, "compute.teacher_device")
        check_dtype_name(self.dtype, "compute.dtype")
        check_dtype_name(self.teacher_dtype, "compute.teacher_dtype")
        _at_least(self, "compute", ["micro_batch_size", "chunk_tokens"], 0, "0 chooses it automatically")
        _at_least(self, "compute", ["learner_ranks"], 1, "1: the learner in one process")


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


def check_name(name: str, what: str = "device") -> None:
    """A device name a config may use (whether this machine has it: devices.resolve, when a run is set up)."""
    require(isinstance(name, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", name) is not None,
            f"config: unknown {what} {name!r}", f"use {DEVICE_FORMS}")


def check_dtype_name(name: str, what: str = "dtype") -> None:
    require(name in DTYPE_NAMES, f"config: unknown {what} {name!r}", f"use one of {', '.join(DTYPE_NAMES)}")


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
        elif "seed" in f.name and value != f.metadata.get("auto"):  # auto: the value that means "chosen for you"
            require(0 <= value < SEED_LIMIT, f"config: {name} must be in [0, 2**32), got {value}",
                    "-1 chooses it" if "auto" in f.metadata else "")
        else:
            require(abs(value) < INT_LIMIT, f"config: {name} is out of range, got {value}", "use a value below 2**31")
