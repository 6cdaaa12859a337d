"""The training config: the run-wide settings and the sections (sections.py), assembled into one TrainConfig that checks
what spans sections; read from YAML and `--set key=value` by config_file.py, saved resolved.

A YAML file holds any subset of the settings below (the rest keep their defaults). The run-wide ones are top-level
keys; the others live in sections (SECTIONS: data, sampling, loss, optim, eval, engine, async, guard, canary,
compute), each a
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
import keyword
from dataclasses import asdict, dataclass, field, fields, replace

from opd.engines import kinds as engines
from opd.io.errors import require
from opd.config.sections import (FAMILIES, FILE_PROMPT_TOKENS, REAL_PAIRS, SCHEDULES, TOPK_TEACHER_LOSSES, AsyncConfig,
                          CanaryConfig, ComputeConfig, DataConfig, EngineConfig, EvalConfig, GuardConfig, LossConfig, OptimConfig,
                          RayConfig, SamplingConfig, TeacherConfig, check_numbers)
from opd.data.task import get_task

SECTIONS = {"teacher": TeacherConfig, "data": DataConfig, "sampling": SamplingConfig, "loss": LossConfig,
            "optim": OptimConfig, "eval": EvalConfig, "engine": EngineConfig, "async": AsyncConfig, "ray": RayConfig,
            "guard": GuardConfig, "canary": CanaryConfig, "compute": ComputeConfig}  # a config file's sections (YAML keys) and their types


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
    canary: CanaryConfig = field(default_factory=CanaryConfig)
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
        require(self.schedule != "async" or self.async_.backend == "inline" or self.threads > self.async_.worker_threads,
                f"config: async needs more threads ({self.threads}) than the rollout worker's "
                f"({self.async_.worker_threads})", "the trainer gets threads - async.worker_threads; on 2 cores use "
                "threads=2 async.worker_threads=1")
        require(self.async_.backend != "ray" or self.schedule == "async",
                "config: async.backend ray is the async schedule's", "set schedule=async")
        require(not self.ray.teacher or self.async_.backend == "ray",
                "config: ray.teacher needs the Ray backend", "set schedule=async and async.backend=ray")
        require(engines.kind(self.engine.name).truncated_raw or not self.sampling.truncates, f"config: engine "
                f"{self.engine.name} with sampling.top_k {self.sampling.top_k or 0} / top_p {self.sampling.top_p or 1}"
                ": "
                "it returns the truncated log-probs only, so the rollouts' numerics mismatch could not be told from "
                "the truncation",
                "sample untruncated (top_k 0, top_p 1: OPD's on-policy default), or use engine builtin")
        self._check_teacher_side()
        require(not self.canary.plan or self.schedule == "sync", "config: canary training runs the synchronous "
                "schedule (its shadow batch and the trained one are sampled by the same weights)",
                "set schedule=sync; a stale candidate is measured before the run by `opd admit --self`")
        require(not self.canary.plan or self.canary.plan != self.plan or self.canary.max_staleness,
                f"config: canary.plan {self.canary.plan!r} is the run's own plan", "name a candidate that differs from "
                "`plan`, or a canary.max_staleness")
        require(not self.canary.max_staleness or (self.threads > self.async_.worker_threads and
                                                   self.async_.backend == "process"),
                "config: a stale canary candidate trains, once promoted, in the async schedule: a worker process "
                f"beside the trainer (threads {self.threads}, async.worker_threads {self.async_.worker_threads}, "
                f"async.backend {self.async_.backend})", "use threads > async.worker_threads and async.backend=process")
        self._check_sharded_learner()
        require(self.shards <= self.batch_size, f"config: sampling.shards {self.shards} is more than batch_size "
                f"{self.batch_size}", "each sub-batch needs a prompt; leave sampling.shards at 0 (one per worker)")

    @property
    def sharded_learner(self) -> bool:
        """The learner runs FSDP2 (training/sharded.py): over several ranks, or on one with compute.sharded."""
        return self.compute.learner_ranks > 1 or self.compute.sharded

    def _check_sharded_learner(self) -> None:
        ranks = self.compute.learner_ranks
        require(not self.ray.learner or ranks > 1, "config: ray.learner places the ranks of a sharded learner, and "
                "compute.learner_ranks is 1 (the learner runs in this process)", "set compute.learner_ranks to the "
                "ranks Ray should place (2 or more), or drop ray.learner")
        if ranks == 1 and not self.compute.sharded:
            return
        why = f"config: a learner sharded over {ranks} ranks (compute.learner_ranks) "
        require(self.async_.backend == "process", why + "runs each rank's rollout worker as a process of its own "
                "(not yet Ray actors)", "set async.backend=process")
        require(self.engine.name == "builtin", why + f"samples with the builtin engine on each rank, not "
                f"{self.engine.name}", "set engine.name=builtin")
        require(not self.teacher.served, why + "scores with the trainer's teacher on each rank (not yet a served or "
                "top-k teacher)", "drop teacher.engine / teacher.topk")
        require(not self.canary.plan, why + "has no canary training yet", "set canary.plan=''")
        require(self.batch_size % ranks == 0, f"config: batch_size {self.batch_size} does not divide over "
                f"{ranks} learner ranks", f"use a multiple of {ranks}")
        require(self.sampling.shards in (0, ranks), f"config: sampling.shards {self.sampling.shards} with {ranks} "
                "learner ranks: each rank samples one sub-batch", f"leave sampling.shards at 0 (= {ranks})")
        plan = str(self.plan)
        require("calibrate" not in plan, why + "cannot share calibrated KV scales (each rank's engine would "
                "calibrate on its own sub-batch)", "use kv_scale=fixed or dynamic")

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
        return self.sampling.shards or self.compute.learner_ranks if self.compute.learner_ranks > 1 else \
            self.sampling.shards or self.rollout_workers

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


OPTIONAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}  # settings whose default is None: a value of this type


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
