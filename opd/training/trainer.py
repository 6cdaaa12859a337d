"""The OPD training loop: the reference that every schedule must reproduce.

One step: the rollouts (rollouts.py: an engine in this process, or the async worker; the loop does not ask which)
give a batch sampled by the student's published weights under the precision plan -> the teacher scores every
generated token in full precision -> the learner recomputes the student's log-probs in full precision -> loss
(losses.py) -> optimizer step -> the rollouts receive the new weights and version. The learner needs `q` (the weights
that sampled) and `pi` (the current weights): in the synchronous schedule one forward gives both (staleness is zero by
construction); the async worker sends `q` with each batch, so numerics mismatch and staleness are measured apart.

Every step logs the mismatch between the rollout engine and the trainer (`mu` vs `q`, metrics.py), the distortion of
the OPD signal, the loss, gradient norm, lengths and the time split; every `eval.every` steps, held-out accuracy
(greedy and sampled) and reverse KL to the teacher. A step whose loss or gradient is not finite is skipped and
counted; `max_bad_steps` in a row stop the run. A checkpoint (HF folder + optimizer, engine scales, async batches and
the counters) is written every `save_every` steps, at the end, on SIGINT/SIGTERM (at the next step boundary) and when
the run stops with an error; `resume` continues from it exactly. The runtime guard (guard.py) checks the live
mismatch every `guard.every` steps and may switch the rollouts to a safer plan (`Rollouts.set_plan`). Loading the
pair and building the run's parts is setup.py.
"""
import json
import math
import signal
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from opd.config.run import TrainConfig
from opd.models.devices import autocast_dtype, restored_threads
from opd.io.errors import OpdError, first_line, require
from opd.training.evaluate import Sums, context_quality, greedy_accuracy, load_contexts, sampled_contexts, \
    sampled_quality, save_contexts
from opd.training.learner import Scores, Scoring, clip_gradients, collate, numerics_mu, score_batch
from opd.health.metrics import masked_mean
from opd.health.metrics import (exact_kl_metric, noise_to_signal, rollout_health, rollout_metrics, staleness_metrics,
                         teacher_mismatch_metrics, truncation_metrics)
from opd.models.model import Transformer
from opd.numerics.plan import Plan
from opd.training.resume import check_resume, load_state, save_state
from opd.config.runlog import RunLock, RunLog, check_run_dir, check_same_run, clear_run_dir, read_metrics, save_config, \
    write_atomic
from opd.training.setup import Run, setup


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then constant or cosine decay to a tenth of the peak at `steps`."""
    if step < cfg.optim.warmup_steps:
        return cfg.optim.lr * (step + 1) / cfg.optim.warmup_steps
    if cfg.optim.schedule == "constant":
        return cfg.optim.lr
    frac = min(1.0, (step - cfg.optim.warmup_steps) / max(1, cfg.steps - cfg.optim.warmup_steps))
    return cfg.optim.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def evaluate(run: Run, cfg: TrainConfig, run_dir: Path | None = None, final: bool = False) -> dict:
    """Held-out quality of the learner at full precision (the rollout plan is not used here) on the run's held-out
    examples (prompts.py): greedy (unless eval.greedy is off) and sampled accuracy under `scoring` (none: no
    accuracy), and the reverse KL to the teacher and the entropy on the student's own samples, or, under
    eval.contexts "fixed", on the first evaluation's samples, or under "teacher" on the teacher's samples drawn at
    the first evaluation (kept in run_dir/eval_contexts.json; the first (under "teacher") and the final evaluation
    sample the student anew too: eval/sampled_rkl, eval/sampled_entropy)."""
    student = run.shard.full_model if run.shard is not None else run.student  # whole weights (sharded.py)
    teacher, tok, start = run.teacher.trainer, run.tok, time.perf_counter()
    examples = run.prompts.held_out
    batch_size = cfg.eval.batch_size  # 0: chunked.chunk_size (all 500 prompts at once at the built-in vocabulary)
    greedy = greedy_accuracy(student, tok, examples, cfg.new_tokens, batch_size, scoring=cfg.data.scoring) \
        if cfg.eval.greedy else {"eval/n": len(examples)}
    autocast = autocast_dtype(cfg.compute.dtype)
    seed = cfg.eval.seed if cfg.eval.seed >= 0 else cfg.seed + 1

    drawn = [ex for ex in examples for _ in range(cfg.eval.samples)]  # eval.samples completions a prompt

    def sample(keep=None, sums=None) -> dict:
        return sampled_quality(student, teacher, tok, drawn, cfg.new_tokens, seed, run.params, batch_size,
                               cfg.compute.micro_batch_size, cfg.compute.chunk_tokens, cfg.data.scoring, autocast, keep,
                               sums)

    if cfg.eval.kept and run_dir is not None:
        path, quality = run_dir / "eval_contexts.json", {}
        if path.exists():
            contexts = load_contexts(path)
            require([r.prompt_ids for r in contexts] == [tok.encode_prompt(ex.prompt) for ex in drawn],
                    f"{path}: its evaluation contexts are not this run's held-out prompts",
                    "give eval_contexts.json of a run with the same pair, prompts and eval settings")
        else:  # the first evaluation: its samples (or the teacher's) become the contexts
            require(run.state.step == 0, f"{path} is missing: this run's later evaluations would score other contexts "
                    "than its first", "restore the file from where it was, or start the run anew")
            if cfg.eval.contexts == "teacher":
                contexts = sampled_contexts(teacher.model, tok, drawn, run.params, seed, batch_size, autocast)
                quality = _renamed(sample())
            else:
                contexts, sums = [], Sums()
                quality = _renamed(sample(contexts, sums)) | sums.exact()  # the samples scored once: the contexts
            save_contexts(path, contexts)
        if final and cfg.eval.resample_final and "eval/sampled_rkl" not in quality:
            quality = _renamed(sample())
        if "eval/rkl" not in quality:
            quality |= context_quality(student, teacher, contexts, tok.pad_id, run.params.temperature or 1.0,
                                       batch_size, cfg.compute.micro_batch_size, cfg.compute.chunk_tokens, autocast)
    else:
        quality = sample()
    return {**{k: v for k, v in greedy.items() if k in ("eval/accuracy", "eval/truncated", "eval/n", "eval/scored")},
            **quality, "time/eval": time.perf_counter() - start}


def _renamed(sampled: dict) -> dict:
    """sampled_quality's numbers beside the fixed contexts' own: eval/rkl -> eval/sampled_rkl, entropy likewise."""
    return {("eval/sampled_" + k.split("/")[1] if k in ("eval/rkl", "eval/entropy") else k): v
            for k, v in sampled.items()}


def step_metrics(batch, scores: Scores, cfg: TrainConfig, version: int) -> dict:
    """Mismatch, importance-weight, distortion, staleness and length metrics of one batch (no gradients).
    scores.pi [B, N]: the current learner's log-probs of the sampled tokens. q, under the weights that sampled, comes
    with the rows that carry it (async); a row sampled by the current weights has q = pi; the q-based metrics cover
    the rows where q is known (all of them, unless async recomputes only a fraction)."""
    pi, t_y = scores.pi, scores.teacher
    truncates = cfg.sampling.truncates
    mu, mask = numerics_mu(batch, truncates), batch.mask
    current = torch.tensor([v == version for v in batch.versions])
    carried = batch.has_q if batch.has_q is not None else torch.zeros_like(current)
    q = torch.where(carried[:, None], batch.q, pi) if batch.q is not None else pi
    known = mask & (carried | current)[:, None]
    out = {**rollout_health(t_y, mu, q, known, cfg.loss.cap), **staleness_metrics(batch.versions, version, q, pi,
                                                                                  known, mu, mask)}
    out["stale/total_nsr"] = noise_to_signal(t_y, mu, pi, mask)
    if batch.kl_exact is not None:
        out["mismatch/kl_exact"] = masked_mean(batch.kl_exact.double(), mask & carried[:, None]).item()
    elif scores.kl_exact is not None and (known & ~carried[:, None]).any():
        out |= exact_kl_metric(scores.kl_exact, known)
    if truncates:
        out |= truncation_metrics(batch.mu, batch.raw, mask)
    lengths = batch.mask.sum(1).tolist()
    return out | rollout_metrics(lengths, [n >= cfg.new_tokens for n in lengths])


def teacher_side_metrics(check, batch, scores: Scores) -> dict:
    """teacher_mismatch/* (metrics.py) on the rollouts the trainer's teacher checked; the engine's tail mass over the
    whole batch."""
    tails = {"teacher_mismatch/tail_mass": scores.teacher_tails.double().mean().item()} \
        if scores.teacher_tails is not None and scores.teacher_tails.numel() else {}
    n = check.rows
    if not n:
        return tails
    trainer, kl_exact = check.result()
    return teacher_mismatch_metrics(scores.teacher[:n], trainer, scores.pi[:n], batch.mask[:n], kl_exact) | tails | \
        {"time/teacher_check": check.seconds}


def train_step(student: Transformer, teacher, opt: torch.optim.Optimizer, batch, cfg: TrainConfig,
               lr: float, version: int, rollout=None, on_grad=None, shard=None, rows=None,
               pad_id: int = 0, tokens: int = 0) -> tuple[dict, bool]:
    """One learner update on a batch of rollouts -> (metrics, whether the update was applied). teacher: who scores
    for the teacher (teacher.Teacher; a served one is checked against the trainer's on the batch's first rows).
    rollout: hidden rows -> the engine's log-probs, for the exact KL (sync, builtin engine). on_grad: called with no
    arguments after a finite backward pass, before clipping (the canary keeps the gradient there). shard: this rank
    of a sharded learner (sharded.Sharding), `batch` its sub-batch of rollouts `rows` (padded with pad_id) of a whole
    batch of `tokens` tokens: the loss is the whole batch's,
    the gradient summed over the ranks, the metrics (on rank 0; {} elsewhere) the whole batch's."""
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    served = teacher is not teacher.trainer
    check = teacher.begin(batch.tokens.shape[0]) if served else None
    # sharded: each token weighted by ranks / the whole batch's tokens, since FSDP averages the ranks' gradients
    # (gloo has no pre-scaled sum), so the average is the whole batch's gradient
    total = tokens / shard.world if shard is not None else None
    scores = score_batch(student, batch, teacher, Scoring.of(cfg), rollout, backward=True, total_tokens=total)
    loss = shard.total(scores.loss) / shard.world if shard is not None else scores.loss
    metrics = {}
    ok = math.isfinite(loss)
    if ok and on_grad is not None:
        on_grad()
    if ok:
        if shard is not None:
            shard.sum_replicated_grads(student)
            grad_norm = shard.clip(student, cfg.optim.grad_clip)
        else:
            grad_norm = clip_gradients(student.parameters(), cfg.optim.grad_clip)
        ok = math.isfinite(grad_norm)
        metrics["train/grad_norm"] = grad_norm
    if ok:
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    with torch.no_grad():
        if shard is not None:
            batch, scores = shard.whole_batch(rows, scores, loss, pad_id)
            if batch is None:  # not rank 0
                return {}, ok
        metrics = dict(scores.metrics) | metrics | step_metrics(batch, scores, cfg, version)
        if check is not None:
            metrics |= teacher_side_metrics(check, batch, scores)
    metrics |= {"train/lr": lr, "time/teacher": scores.teacher_seconds,
                "time/train": time.perf_counter() - start - scores.teacher_seconds}
    return metrics, ok


def run_step(run: Run) -> dict:
    """Step `run.state.step`: sample, score, update, publish. Returns the step's metrics."""
    cfg, state = run.cfg, run.state
    start = time.perf_counter()
    sampled = run.rollouts.next_batch(state.step, state.version)
    rollouts, sample_metrics, rollout = sampled.rollouts, sampled.metrics, sampled.engine_logprobs
    batch = collate(rollouts, run.tok.pad_id)
    tokens = run.shard.total(batch.num_tokens) if run.shard is not None else batch.num_tokens  # the whole batch's
    on_grad = run.canary.before_step(state.step, state.version, sampled.key) if run.canary is not None else None
    metrics, ok = train_step(run.student, run.teacher, run.opt, batch, cfg, lr_at(state.version, cfg), state.version,
                             rollout, on_grad, run.shard, rollouts, run.tok.pad_id, int(tokens))
    state.step += 1
    if ok:
        state.version += 1
        state.bad_steps = 0
        sync = time.perf_counter()
        run.rollouts.publish(run.weights(), state.version)
        metrics["time/sync"] = time.perf_counter() - sync
    else:
        state.bad_steps += 1
        state.skipped += 1
    if run.canary is not None:  # after the publish: a switch re-makes the engine on the newest weights
        metrics |= run.canary.after_step(state.step - 1, ok, metrics)
    elapsed = time.perf_counter() - start
    return metrics | sample_metrics | {"train/skipped_steps": state.skipped, "train/version": state.version,
                                        "time/step": elapsed,
                      "throughput/tokens_per_s": tokens / elapsed}


def train(cfg: TrainConfig, run_dir: Path, resume: bool = False, overwrite: bool = False,
          progress: bool = True, on_step=None, before: dict | None = None, contexts: Path | None = None) -> dict | None:
    """Run (or continue) one OPD run in run_dir; returns the summary (also written to summary.json).
    on_step(step, run), if given, is called after each logged step (tests use it to inject faults). before, if given,
    is the initial student's held-out evaluation, measured earlier (a sweep shares it across runs): not measured again.
    contexts: under kept eval.contexts ("fixed", "teacher"), another run's eval_contexts.json to evaluate on instead of
    sampling them (a run from the same start with the same eval.seed: a sweep or a paired trial samples them once).
    The run directory is locked for this process (runlog.RunLock) and its rules are checked before the models load;
    a resume is checked against the checkpoint (check_resume) before anything is written, so a refused command leaves
    the folder as it was. With compute.learner_ranks > 1 this process is one rank of a sharded learner (sharded.py:
    launched by `opd train` or torchrun): rank 0 writes the run directory and returns the summary, the others None."""
    run_dir = Path(run_dir)
    shard = None
    if cfg.sharded_learner:
        from opd.training import sharded
        require(sharded.launched() or cfg.compute.learner_ranks == 1, f"compute.learner_ranks "
                f"{cfg.compute.learner_ranks}: the learner's ranks are processes of one job", "run `opd train` (it "
                "launches them) or torchrun --nproc-per-node N -m opd.cli train ...")
        shard = sharded.start(cfg)
    leader = shard is None or shard.leader
    try:
        with RunLock(run_dir) if leader else nullcontext(), restored_threads():
            if leader:
                check_run_dir(run_dir, resume, overwrite)
            run = setup(cfg, shard)
            cfg = run.cfg  # with the sampling settings resolved (config.resolve_generation): what is saved and compared
            try:
                if cfg.canary.plan:
                    from opd.training.canary import Canary  # only a canary run needs it
                    run.canary = Canary(run, run_dir)
                    if not cfg.guard.every and leader:
                        print("opd: note: a canary without the runtime guard (guard.every 0): on a real pair the "
                              "canary has promoted harmful candidates (docs/training.md, \"Canary training\"); set "
                              "guard.every=1 guard.action=fallback", file=sys.stderr)
                saved = {}
                if resume:
                    check_same_run(run_dir, cfg)
                    run.state, saved = load_state(run_dir, run)
                    check_resume(run_dir, cfg, run.state)
                    from opd.training.sharded import rank_state
                    saved = rank_state(saved, shard.rank if shard else 0, shard.world if shard else 1, run_dir)
                elif overwrite and leader:
                    clear_run_dir(run_dir)
                if leader:
                    save_config(run_dir, cfg)
                if shard is not None:
                    shard.full_model.load_state_dict(run.student.state_dict())
                    run.opt = shard.shard(run.student, run.opt)
                run.rollouts.start(run.weights(), run.state.version, saved)
                if run.canary is not None:
                    run.canary.start()
                return _train(run, cfg, run_dir, progress and leader, on_step, before, contexts)
            finally:
                run.rollouts.close()
                run.teacher.close()
                if run.canary is not None:
                    run.canary.close()
    except RuntimeError as e:
        from opd.training import sharded
        if shard is None or not sharded.collective_failure(e):
            raise
        raise OpdError(f"learner rank {shard.rank}: another rank stopped or could not be reached during a collective "
                       f"({first_line(e):.200})", "the last checkpoint stands: --resume continues from it") from None
    finally:
        if shard is not None:
            from opd.training import sharded
            sharded.stop()


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM during training. at_boundary: raised between two steps, where the state is consistent and is
    saved; else a second signal that stopped a step midway (nothing is saved: the last checkpoint stands). summary:
    the signal came during the final evaluation, which finished, so the run is complete and this is its summary (a
    sweep records it, then stops instead of starting the next run)."""

    def __init__(self, signum: int, at_boundary: bool, summary: dict | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.at_boundary, self.summary = signum, at_boundary, summary


@contextmanager
def step_boundary_signals():
    """SIGINT (Ctrl-C) and SIGTERM stop training at the next step boundary: a signal only marks the stop, and the loop
    raises `Interrupted` once the step's metrics are logged, so the saved state and metrics.jsonl agree and --resume
    continues exactly (a step cut midway could leave the optimizer updated and the step unlogged). A second signal stops
    at once, without saving. Yields the list of signals received. Only the main thread can install handlers; elsewhere
    signals keep their default behaviour."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        if received:
            raise Interrupted(signum, at_boundary=False)
        received.append(signum)
        print(f"\nopd: {signal.Signals(signum).name}: stopping after this step and saving (again: stop at once)",
              file=sys.stderr)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def guard_due(run: Run, step: int, metrics: dict) -> bool:
    """Whether the guard checks after this step. A sharded learner's rank 0 holds the whole batch's metrics and keeps
    the guard's window; the other ranks only count the steps."""
    if run.shard is None or run.shard.leader:
        return run.guard.observe(step, metrics)
    return bool(run.guard.every) and (step + 1) % run.guard.every == 0


def guard_check(run: Run, step: int, run_dir: Path) -> tuple[dict, Plan | None]:
    """run.guard.check; on a sharded learner rank 0 checks and every rank gets its outcome (the plan to fall back to,
    or the error that stops the run), so that all of them switch, or stop, at the same step."""
    if run.shard is None:
        return run.guard.check(step, run.plan, run_dir)
    outcome, out = None, {}
    if run.shard.leader:
        try:
            out, safer = run.guard.check(step, run.plan, run_dir)
            outcome = ("plan", str(safer) if safer is not None else None)
        except OpdError as e:
            outcome = ("stop", e.problem, e.fix)
    outcome = run.shard.broadcast(outcome)
    if outcome[0] == "stop":
        raise OpdError(outcome[1], outcome[2])
    return out, Plan.parse(outcome[1], len(run.plan.layers)) if outcome[1] is not None else None


def fall_back(run: Run, plan: Plan) -> None:
    """The guard's `fallback`: plan from now on (recorded in the state, so a resumed run keeps it)."""
    run.state.fallback, run.state.fallback_plan = True, str(plan)
    run.use_plan(plan)


def _train(run: Run, cfg: TrainConfig, run_dir: Path, progress: bool, on_step, before: dict | None,
           contexts: Path | None = None) -> dict:
    leader = run.shard is None or run.shard.leader
    log = RunLog(run_dir, run.state.step) if leader else NoLog()
    if leader:
        run.guard.resume(run_dir, run.state.step)
    kept = run_dir / "eval_contexts.json"
    if run.state.step == 0 and leader and cfg.eval.kept and contexts is not None and not kept.exists():
        save_contexts(kept, load_contexts(Path(contexts)))
    if run.state.step > 0:
        before = _first_eval(run_dir)
    elif leader and (before is None or (cfg.eval.kept and not kept.exists())):
        before = evaluate(run, cfg, run_dir)  # (a shared `before` has no contexts: they are sampled here)
    bar = tqdm(range(run.state.step, cfg.steps), desc=f"opd {cfg.family if not cfg.student else 'train'}",
               disable=not progress, initial=run.state.step, total=cfg.steps)
    with step_boundary_signals() as received:
        return _loop(run, cfg, run_dir, on_step, log, before, bar, received)


def _loop(run: Run, cfg: TrainConfig, run_dir: Path, on_step, log: RunLog, before, bar, received) -> dict:
    """The steps, then the final evaluation and the summary. On an error or a signal the state is saved only where it
    agrees with the log (every step the state has taken is logged): otherwise the last checkpoint stands."""
    last_eval, logged = before, run.state.step
    leader = run.shard is None or run.shard.leader
    try:
        for step in bar:
            metrics = dict(before or {}) if step == 0 else {}
            if step > 0 and cfg.eval.every and step % cfg.eval.every == 0 and leader:
                metrics |= (last_eval := evaluate(run, cfg, run_dir))
            metrics |= run_step(run)
            if guard_due(run, step, metrics):
                try:
                    out, safer = guard_check(run, step, run_dir)
                    metrics |= out
                    if safer is not None:
                        fall_back(run, safer)
                        if run.canary is not None:
                            run.canary.guard_fell_back(step)
                except OpdError:  # guard.action stop (or the fallback failed): the step was taken; log it, then stop
                    log.write(step, metrics)
                    logged = step + 1
                    raise
            log.write(step, metrics)
            logged = step + 1
            if leader:  # the other ranks of a sharded learner have no metrics of the whole batch
                bar.set_postfix(rkl=f"{metrics['loss/rkl_sampled']:.4f}",
                                kl_k3=f"{metrics.get('mismatch/kl_k3', 0):.1e}",
                                acc=f"{last_eval['eval/accuracy']:.3f}" if last_eval and isinstance(
                                    last_eval.get("eval/accuracy"), float) else "-")
            if run.state.bad_steps >= cfg.max_bad_steps:
                raise OpdError(f"the loss or gradient was not finite for {run.state.bad_steps} steps in a row "
                               f"(last at step {step})", "lower lr, check the checkpoints for NaN/Inf weights, "
                               "or raise max_bad_steps")
            if cfg.save_every and run.state.step % cfg.save_every == 0 and run.state.step < cfg.steps:
                log.sync()  # the log reaches the disk before the checkpoint that counts its steps
                save_state(run_dir, run)
            if on_step is not None:
                on_step(step, run)
            if run.shard is not None and run.shard.any(bool(received)):  # every rank stops at the same boundary
                raise Interrupted(received[0] if received else signal.SIGTERM, at_boundary=True)
            if received:
                raise Interrupted(received[0], at_boundary=True)
    except (Interrupted, OpdError) as e:
        interrupted = isinstance(e, Interrupted)
        try:
            if run.state.step == logged and not (interrupted and not e.at_boundary):
                log.sync()
                # at a step boundary after a signal: exactly, with the async batches in flight collected; after an
                # error (the worker may be gone): what has arrived
                save_state(run_dir, run, wait=interrupted)
        except OpdError:
            pass  # cannot save either (the disk is full): the first error is the one to report
        finally:
            log.close()
        raise
    after = evaluate(run, cfg, run_dir, final=True) if leader else {}
    log.write(cfg.steps, after)
    log.close()
    save_state(run_dir, run, wait=False)
    if not leader:
        return None
    summary = {"before": before, "after": after, "steps": run.state.step, "skipped_steps": run.state.skipped,
               "plan": str(run.plan), "schedule": cfg.schedule, "guard_fallback": run.state.fallback,
               **_seconds(read_metrics(run_dir))}
    summary |= {f"async/{k}": v for k, v in run.rollouts.counts.items()}
    if run.canary is not None:
        summary["canary"] = run.canary.summary()
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    if received:  # it came during the final evaluation: the run is complete; whoever called train stops here
        raise Interrupted(received[0], at_boundary=True, summary=summary)
    return summary


class NoLog:
    """A sharded learner's ranks other than 0 log nothing (rank 0 logs the whole batch's metrics)."""

    def write(self, step: int, metrics: dict) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def _first_eval(run_dir: Path) -> dict | None:
    rows = read_metrics(run_dir)
    return {k: v for k, v in rows[0].items() if k.startswith("eval/")} if rows else None


def _seconds(rows: list[dict]) -> dict:
    return {key: sum(row.get(key) or 0 for row in rows) for key in ("time/step", "time/eval")}
