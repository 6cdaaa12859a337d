"""From a training config to everything a run needs: the pair, the tokenizer, the prompts, the optimizer, the
rollouts (one engine in this process, or the async worker), the guard's limits. The loop (trainer.py) starts from a
`Run`; the admission probe from a `ProbeSetup` of the same config.

Nothing here trains: loading is checked (both devices before any weights load, the two tokenizers equal token for
token, no NaN/Inf weights), so a bad pair fails before minutes of work.
"""
import copy
import functools
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from opd.models import devices
from opd.health.rules import estimator_class
from opd.training.async_rollouts import AsyncRollouts, InlineRollouts
from opd.models.checkpoint import load_checkpoint
from opd.config.run import TrainConfig, resolve_generation
from opd.engines.kinds import kind, make_engine
from opd.io.errors import require
from opd.training.evaluate import check_scorer
from opd.health.guard import Guard
from opd.models.model import Transformer
from opd.numerics.plan import Plan
from opd.training.pretrain import PretrainConfig, pretrain
from opd.data.prompts import PromptSet
from opd.data.real_pairs import build_pair
from opd.training.resume import State
from opd.training.rollouts import Rollouts, SyncRollouts
from opd.engines.sampling import SamplingParams
from opd.config.sections import DataConfig, REAL_PAIRS
from opd.training.teacher import LocalTeacher, Teacher, make_teacher
from opd.models.tokenizer import TextTokenizer, first_difference
from opd.training.worker import RolloutWorker, WorkerSpec, recompute


# The probe's completions are the run's max_new_tokens long, at most this: its statistics are per-token means, and at
# real size sampling is most of its cost (benchmarks/realspeed.py: 16 x 128 tokens on the smollm2 pair, the candidate
# and the BF16 floor, 94-111 s, where the run's 512 would take ~4x that). The statistical error this leaves is
# nsr_se, a bootstrap over the rollouts (5% there).
PROBE_TOKENS = 128


@dataclass
class ProbeSetup:
    """What a probe needs from a training run: the config, the student, the run's teacher and an engine factory."""
    cfg: object  # TrainConfig
    student: torch.nn.Module
    teacher: object  # teacher.Teacher: the run's (a served one is checked against its `trainer`)
    tok: object
    make_engine: object  # (plan) -> engine
    prompts: list[list[int]] = field(default_factory=list)


def load_pair(cfg: TrainConfig) -> tuple[Transformer, Transformer, TextTokenizer, Path]:
    """(student, teacher, tokenizer, the student's folder): the given checkpoints, or the built-in pair of
    cfg.family (shipped, or pretrained on first use and cached). The student is float32 (the master weights) on
    `compute.device`, the teacher in `compute.teacher_dtype` on `compute.teacher_device`; both devices are checked before anything is
    loaded."""
    compute = cfg.compute
    device = devices.resolve(compute.device)
    teacher_device = devices.resolve(compute.teacher_device, "teacher_device") if compute.teacher_device else device
    devices.resolve_dtype(compute.dtype, device)
    teacher_dtype = devices.resolve_dtype(compute.teacher_dtype, teacher_device, "teacher_dtype")
    student_dir, teacher_dir = pair_folders(cfg)
    student, tok = load_checkpoint(student_dir, torch.float32, device)
    teacher, teacher_tok = load_checkpoint(teacher_dir, teacher_dtype, teacher_device)
    check_same_tokenizer(student, tok, teacher, teacher_tok)
    for role, model, folder in (("student", student, student_dir), ("teacher", teacher, teacher_dir)):
        bad = next((name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
        require(bad is None, f"the {role} checkpoint {folder} has NaN/Inf weights ({bad})",
                "use an undamaged checkpoint: every step would be skipped as non-finite")
    return student, teacher.eval().requires_grad_(False), tok, student_dir


def pair_folders(cfg: TrainConfig) -> tuple[Path, Path]:
    """(student folder, teacher folder): the given checkpoints, a real pair (built from registry packages on first
    use, real_pairs.py), or the built-in pair of cfg.family (shipped, or pretrained on first use and cached)."""
    if cfg.student:
        return Path(cfg.student), Path(cfg.teacher.path)
    if cfg.family in REAL_PAIRS:
        return build_pair(cfg.family)
    return tuple(pretrain(PretrainConfig(family=cfg.family, role=role, task=cfg.task))[0]
                 for role in ("student", "teacher"))


def teacher_folder(cfg: TrainConfig) -> Path:
    """The teacher's checkpoint folder (built or pretrained and cached by load_pair)."""
    return pair_folders(cfg)[1]


def with_pair_defaults(cfg: TrainConfig) -> TrainConfig:
    """A real pair's default prompts: HumanEval (humaneval.py) through the chat template, scored by running the code,
    unless the config names its own prompt file."""
    if cfg.student or cfg.family not in REAL_PAIRS or cfg.data.prompts:
        return cfg
    from opd.data.humaneval import prompt_file
    scoring = "humaneval" if cfg.data.scoring == DataConfig().scoring else cfg.data.scoring
    return replace(cfg, data=replace(cfg.data, prompts=str(prompt_file()), chat=True, scoring=scoring))


def check_same_tokenizer(student: Transformer, tok: TextTokenizer, teacher: Transformer,
                         teacher_tok: TextTokenizer) -> None:
    """OPD compares the two models' log-probs of the same token ids: their vocabularies must be the same, token for
    token (the student's tokenizer, chat template and stop ids are the ones used)."""
    fix = "distill between models that share one tokenizer (cross-tokenizer distillation is not supported)"
    difference = first_difference(tok.vocab(), teacher_tok.vocab())
    require(difference is None, f"student and teacher tokenizers differ at {difference}", fix)
    require(student.cfg.vocab_size == teacher.cfg.vocab_size, f"student and teacher output layers differ in size "
            f"({student.cfg.vocab_size} vs {teacher.cfg.vocab_size} rows) although their tokenizers agree", fix)


def parse_plan(cfg: TrainConfig, num_layers: int) -> Plan:
    return Plan.from_mapping(cfg.plan, num_layers) if isinstance(cfg.plan, dict) else Plan.parse(cfg.plan, num_layers)


def engine_builder(cfg: TrainConfig, student: Transformer, tok: TextTokenizer, student_dir: Path, prompts: PromptSet):
    """plan -> the config's rollout engine for the student (engines.make_engine), sized for the run's sequences."""
    return lambda plan: make_engine(cfg.engine.name, student, tok.stop_ids, tok.pad_id, plan, model_dir=student_dir,
                                    seed=cfg.seed, noise_seed=cfg.noise_seed, compile=cfg.engine.compile,
                                    bf16_gemm=cfg.engine.bf16_gemm, **engine_size(cfg, prompts))


def engine_size(cfg: TrainConfig, prompts: PromptSet) -> dict:
    """What one generate call holds: sequences of the longest prompt + max_new_tokens, one shard of a batch."""
    return {"context": prompts.longest + cfg.new_tokens, "max_seqs": -(-cfg.batch_size // cfg.shards)}


@dataclass
class Run:
    """Everything one step needs; resume.save_state/load_state persist what changes between steps."""
    cfg: TrainConfig
    student: Transformer
    teacher: Teacher  # who scores for the teacher (teacher.py); its `trainer` is the full-precision one (evaluation)
    tok: TextTokenizer
    rollouts: Rollouts  # sync (an engine here) or async (a worker process): the same methods
    plan: Plan
    opt: torch.optim.Optimizer
    prompts: PromptSet
    params: SamplingParams
    state: State
    student_dir: Path
    guard: Guard  # the runtime admission check (cfg.guard.every > 0)
    canary: object = None  # canary.Canary (cfg.canary.plan set), made by the trainer, which knows the run folder
    shard: object = None  # sharded.Sharding: this process is one rank of a sharded learner (compute.learner_ranks)

    def weights(self) -> dict:
        """The student's whole weights, to publish to the rollout engine (gathered from the shards: a collective)."""
        return self.shard.refresh(self.student) if self.shard is not None else self.student.state_dict()

    def use_plan(self, plan: Plan) -> None:
        """Sample under plan from now on (the guard's fallback, or one a resumed run recorded)."""
        self.plan = plan
        self.rollouts.set_plan(plan)


def setup(cfg: TrainConfig, shard=None) -> Run:
    """Load the pair and build the optimizer and the rollouts (an async worker starts in `Rollouts.start`, once the
    weights to start from are known). shard (sharded.Sharding): this process is one rank of a sharded learner; the
    student is still whole here (the trainer shards it once a checkpoint is loaded), its rollout engine runs on a
    whole copy, sampling this rank's sub-batch, and the threads are shared among the ranks."""
    asynchronous = cfg.schedule == "async"
    new_worker = RolloutWorker
    if asynchronous and cfg.async_.backend == "ray":  # the cluster first: its errors come before the models load
        from opd.training.ray_backend import RayWorkers, connect
        connect(cfg.ray, cfg.async_.worker_threads)
        new_worker = functools.partial(RayWorkers, settings=cfg.ray)
    inline = asynchronous and cfg.async_.backend == "inline"  # no worker process: every thread is the trainer's
    threads = cfg.threads - cfg.async_.worker_threads if asynchronous and not inline else cfg.threads
    torch.set_num_threads(max(1, threads // shard.world) if shard is not None else threads)
    cfg = with_pair_defaults(cfg)
    student, teacher, tok, student_dir = load_pair(cfg)
    cfg = resolve_generation(cfg, tok.generation)
    context = min(student.cfg.context, teacher.cfg.context)
    prompts = PromptSet(cfg, tok, context, cfg.new_tokens)
    check_scorer(cfg.data.scoring, prompts.held_out)
    trainer_teacher = LocalTeacher(teacher)
    if asynchronous and cfg.ray.teacher and cfg.async_.backend == "ray":  # its body to an actor, its head stays
        from opd.training.ray_backend import RemoteTeacher
        trainer_teacher = RemoteTeacher(teacher, cfg.ray, cfg.async_.worker_threads, cfg.async_.worker_timeout)
    scorer = make_teacher(cfg.teacher, trainer_teacher, teacher, tok.pad_id, teacher_folder(cfg), seed=cfg.seed,
                          noise_seed=cfg.noise_seed, chunk_tokens=cfg.compute.chunk_tokens, **engine_size(cfg, prompts))
    plan = parse_plan(cfg, student.cfg.num_layers)
    if cfg.engine.compile:
        print("opd: engine.compile: the rollout engine compiles before step 0 (about a minute on a cold cache)",
              file=sys.stderr)
    # foreach=False: the multi-tensor step's temporaries are a copy of every parameter (~2 GB for a 0.5B student, on
    # top of its 8 GB of weights, gradients and moments); the per-parameter step computes the same numbers (tested)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.optim.weight_decay, foreach=False)
    exact_kl = cfg.exact_kl and kind(cfg.engine.name).hidden_states  # needs the engine's distributions
    if cfg.exact_kl and not exact_kl:
        print(f"opd: exact_kl off: engine {cfg.engine.name} returns the sampled tokens' log-probs only; mismatch/kl_k3 "
              "estimates the same KL", file=sys.stderr)
    params = SamplingParams(cfg.new_tokens, **cfg.sampling.params())
    if shard is not None:  # the whole student: the in-process engine samples with it, rank 0 evaluates and saves it
        shard.full_model = copy.deepcopy(student).requires_grad_(False)
    if inline:
        settings = cfg.async_
        rescore = functools.partial(recompute, student, pad_id=tok.pad_id, params=params,  # the learner's model
                                    chunk_tokens=cfg.compute.chunk_tokens, dtype=cfg.compute.dtype,
                                    micro_batch_size=cfg.compute.micro_batch_size)
        rollouts = InlineRollouts(engine_builder(cfg, student, tok, student_dir, prompts), plan, prompts, params,
                                  cfg.seed, exact_kl, cfg.shards, settings.max_staleness, settings.lookahead,
                                  settings.recompute_fraction, rescore)
    elif asynchronous:
        settings = cfg.async_
        rollouts = AsyncRollouts(worker_spec(cfg, student, tok, plan, params, exact_kl, student_dir, prompts), prompts,
                                 cfg.seed, settings.max_staleness, settings.lookahead, settings.stale_policy,
                                 settings.worker_timeout, settings.max_worker_restarts, student.lm_head, cfg.shards,
                                 new_worker, rank=shard.rank if shard is not None else None)
    else:
        sampler = shard.full_model if shard is not None else student
        rollouts = SyncRollouts(engine_builder(cfg, sampler, tok, student_dir, prompts), plan, prompts, params, cfg.seed,
                                exact_kl, cfg.shards, rank=shard.rank if shard is not None else None)
    guard = Guard(cfg.guard, estimator_class(cfg.loss), cfg.engine.name, asynchronous,
                  calibrate=not cfg.sharded_learner)
    return Run(cfg, student, scorer, tok, rollouts, plan, opt, prompts, params, State(), student_dir, guard,
               shard=shard)


def schedule_rollouts(run: Run, plan: Plan, staleness: int | None, first_batch: int = 0) -> Rollouts:
    """New rollouts for a running run (not started): under `plan`, the async schedule with max_staleness (and
    lookahead) `staleness` in a worker process of its own, dispatching prompt batches from `first_batch` on, or with
    staleness None the in-process engine on the learner's tensors; the torch threads set for it. Canary training
    (canary.py) switches a run's schedule with it."""
    cfg = run.cfg
    exact_kl = cfg.exact_kl and kind(cfg.engine.name).hidden_states
    if staleness is None:
        torch.set_num_threads(cfg.threads)
        return SyncRollouts(engine_builder(cfg, run.student, run.tok, run.student_dir, run.prompts), plan, run.prompts,
                            run.params, cfg.seed, exact_kl, cfg.shards)
    torch.set_num_threads(cfg.threads - cfg.async_.worker_threads)
    settings = cfg.async_
    out = AsyncRollouts(worker_spec(cfg, run.student, run.tok, plan, run.params, exact_kl, run.student_dir,
                                    run.prompts), run.prompts, cfg.seed, staleness, staleness, settings.stale_policy,
                        settings.worker_timeout, settings.max_worker_restarts, run.student.lm_head, cfg.shards)
    out.next_index = first_batch
    return out


def worker_spec(cfg: TrainConfig, model: Transformer, tok, plan: Plan, params: SamplingParams, return_hidden: bool,
                model_dir: str | Path, prompts: PromptSet) -> WorkerSpec:
    """The async rollout worker's settings, from the config (worker.py)."""
    settings = cfg.async_
    return WorkerSpec(asdict(model.cfg), tok.stop_ids, tok.pad_id, plan, cfg.noise_seed, params, settings.worker_threads,
                      return_hidden, recompute=settings.lookahead > 0, recompute_fraction=settings.recompute_fraction,
                      engine=cfg.engine.name, model_dir=str(model_dir), compile=cfg.engine.compile,
                      device=str(model.embed_tokens.weight.device), chunk_tokens=cfg.compute.chunk_tokens,
                      dtype=cfg.compute.dtype, micro_batch_size=cfg.compute.micro_batch_size,
                      bf16_gemm=cfg.engine.bf16_gemm, **engine_size(cfg, prompts))


def probe_setup(cfg: TrainConfig, n: int) -> tuple[ProbeSetup, Plan]:
    """The admission probe of a training config: its pair, an engine factory, its first n training prompts, sampled to
    the run's max_new_tokens, at most PROBE_TOKENS (probe.py)."""
    torch.set_num_threads(cfg.threads)
    cfg = with_pair_defaults(cfg)
    student, teacher, tok, student_dir = load_pair(cfg)
    cfg = resolve_generation(cfg, tok.generation)
    context = min(student.cfg.context, teacher.cfg.context)
    run_tokens = cfg.new_tokens
    cfg = replace(cfg, sampling=replace(cfg.sampling, max_new_tokens=min(run_tokens, PROBE_TOKENS)))
    probe_cfg = replace(cfg, batch_size=n, sampling=replace(cfg.sampling, shards=1),
                        engine=replace(cfg.engine, compile=False))  # 16 rollouts: compiling costs more than it saves
    prompt_set = PromptSet(probe_cfg, tok, context, run_tokens)  # the prompts the run fits beside its completions
    scorer = make_teacher(cfg.teacher, LocalTeacher(teacher), teacher, tok.pad_id, teacher_folder(cfg), seed=cfg.seed,
                          noise_seed=cfg.noise_seed, chunk_tokens=cfg.compute.chunk_tokens,
                          **engine_size(probe_cfg, prompt_set))
    return ProbeSetup(cfg, student, scorer, tok, engine_builder(probe_cfg, student, tok, student_dir, prompt_set),
                      prompt_set.batch(0)), parse_plan(cfg, student.cfg.num_layers)
