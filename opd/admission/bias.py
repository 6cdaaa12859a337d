"""The gradient-space admission statistic (issue 57, candidate (a)): the bias a candidate's rollouts put in the OPD
gradient, against the BF16 gradient noise of the same recipe, measured on the user's own student, teacher, prompts,
loss and horizon.

For a candidate (a plan, or staleness k) on the run's initial student (after k BF16 steps of the recipe for
staleness k): g_i the OPD gradient of batch i with BF16 rollouts, c_i the same batch (same prompts, same sampling
seed: common random numbers) with the candidate's rollouts (for staleness: sampled by the student k steps earlier),
i = 1..M, d_i = c_i - g_i, and

    bias^2  = |mean d|^2 - var(d) / M      (unbiased: the coupling noise of d taken out; its standard error var(d)/M)
    noise^2 = var(g)                        (the per-batch SGD noise of BF16 rollouts)
    z = sqrt(T / 2) * bias / noise          (T the run's steps: a bias drifts T steps the same way while the gap
                                             between two BF16 seeds grows as sqrt(2 T))

in the raw gradient and in AdamW's coordinates (each coordinate over the root of its mean square over both
rollouts' gradients, the scale Adam divides by). It costs 2M gradients (about 2M / batch-size steps' worth of
rollouts and backward passes) and trains nothing. studies/gradient_bias.py measures it on the stored studies.
"""
import copy
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from opd.health.drift import Sums, require_memory
from opd.io.errors import require
from opd.numerics.plan import Plan
from opd.training.learner import Scoring, collate, flat_gradient, score_batch
from opd.training.rollouts import SyncRollouts
from opd.training.setup import engine_builder, setup
from opd.training.trainer import run_step


def gradient(run, index: int, rollouts=None) -> torch.Tensor:
    """The OPD gradient (unclipped, flattened, float32) of the run's student on prompt batch `index` sampled by
    `rollouts` (default: the run's own engine)."""
    sampled = (rollouts or run.rollouts).next_batch(index, run.state.version)
    return batch_gradient(run, collate(sampled.rollouts, run.tok.pad_id), sampled.engine_logprobs)


def batch_gradient(run, batch, engine_logprobs=None) -> torch.Tensor:
    """The OPD gradient (unclipped, flattened, float32) of the run's student on a batch of rollouts."""
    run.student.zero_grad(set_to_none=True)
    score_batch(run.student, batch, run.teacher, Scoring.of(run.cfg), engine_logprobs, backward=True)
    out = flat_gradient(run.student)
    run.student.zero_grad(set_to_none=True)
    return out


def warmed_run(cfg, steps: int, spill: str | Path | None = None, sums: bool = True):
    """setup(cfg) (synchronous) after `steps` BF16 training steps of its recipe; -> (run, the initial weights).
    sums: refused first where drift.Sums' sums do not fit (in memory, or with `spill` on that folder's disk); False
    for a caller that collects the pairs its own way."""
    run = setup(replace(cfg, schedule="sync"))
    try:
        if sums:
            require_memory(run.student, False, "the gradient-bias measurement (opd admit --self)",
                           "free memory, keep the sums on disk (--spill DIR), or use opd admit --trial K, which "
                           "keeps none", spill)
    except BaseException:
        run.rollouts.close()
        raise
    initial = {k: v.detach().clone() for k, v in run.student.state_dict().items()}
    run.rollouts.start(run.student.state_dict(), 0, {})
    for _ in range(steps):
        run_step(run)
    return run, initial


def candidate_rollouts(run, plan: Plan, weights: dict | None = None) -> SyncRollouts:
    """A second engine over the run's prompts and sampling seeds, under `plan`: on the learner's own tensors (the
    built-in engine shares them where the plan keeps full precision), or, given `weights` (an older student: a stale
    candidate), on a copy of the student holding them, so that the learner's weights are never touched."""
    student = run.student
    if weights is not None:
        student = copy.deepcopy(run.student)
        student.load_state_dict(weights)
    build = engine_builder(run.cfg, student, run.tok, run.student_dir, run.prompts)
    rollouts = SyncRollouts(build, plan, run.prompts, run.params, run.cfg.seed, exact_kl=False,
                            n_shards=run.cfg.shards)
    rollouts.start(student.state_dict(), 0, {})
    return rollouts


def measure(bf16_cfg, cand_cfg, staleness: int, batches: int, sums=None, warm: int = 0,
            spill: str | Path | None = None) -> dict:
    """The candidate's stats on the recipe's initial student (after `staleness` BF16 steps for a stale candidate,
    whose rollouts the initial student samples under the candidate's plan). A candidate that differs from the BF16
    config only in its plan and schedule is sampled by a second engine of the same set-up; any other difference
    (weight noise of another seed, another engine, ...) loads a set-up of its own. `sums`: what collects the pairs
    (default a drift.Sums; anything with add(g, c) and stats(steps)). warm: for a synchronous candidate, measure at
    the student after `warm` BF16 steps of the recipe instead of the initial one. spill: a folder where the default
    sums live as files (a student whose sums do not fit in memory: drift.Sums), removed after."""
    require(not (warm and staleness), "a warm measurement is for synchronous candidates", "use warm=0 with staleness")
    run, initial = warmed_run(bf16_cfg, staleness or warm, spill, sums is None)
    older = initial if staleness else None
    same_setup = replace(cand_cfg, plan=bf16_cfg.plan, schedule=bf16_cfg.schedule, steps=bf16_cfg.steps,
                         async_=bf16_cfg.async_) == bf16_cfg
    cand_run, other = None, None
    try:
        if same_setup:
            other = candidate_rollouts(run, Plan.parse(cand_cfg.plan, len(run.plan.layers)), older)
        else:
            cand_run = setup(replace(cand_cfg, schedule="sync", steps=bf16_cfg.steps))
            cand_run.student.load_state_dict(run.student.state_dict())
            cand_run.rollouts.start(cand_run.student.state_dict(), 0, {})
            other = candidate_rollouts(cand_run, cand_run.plan, older) if older is not None else cand_run.rollouts
        with tempfile.TemporaryDirectory(dir=spill, prefix="opd-sums-") if spill and sums is None \
                else nullcontext() as folder:
            sums = Sums(spill=folder) if sums is None else sums
            for i in [1000 + j for j in range(batches)]:  # prompt batches the warm-up did not train on
                sums.add(gradient(run, i), gradient(cand_run or run, i, other))
            numbers = sums.stats(bf16_cfg.steps)
            del sums  # unmap the files before their folder is removed (their disk is freed only then)
    finally:
        for rollouts in {id(r): r for r in (run.rollouts, other, cand_run and cand_run.rollouts) if r}.values():
            rollouts.close()
    return numbers
