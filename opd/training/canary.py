"""Canary training: take a cheaper rollout plan only when the run's own evidence admits it, and drop it when the same
evidence turns against it.

The run trains on its own plan (the reference: BF16, or whatever `plan` names). Every `canary.every` steps a shadow
engine under the candidate plan (`canary.plan`) samples the same prompt batch with the same sampling seed (common
random numbers), and the OPD gradient of the shadow batch, c, is measured beside the training step's own gradient g
(before clipping, at the same weights): one pair of health/drift.py's statistic, whose horizon T is the run's
remaining steps. From `canary.min_batches` pairs on, each new pair decides:

    ADMIT      z + canary.sigmas (2) standard errors <= the cut: the candidate is promoted, the training rollouts
               come from it from the next step on
    REJECT     z - one standard error > the cut: the run stays on its plan; the shadow stops (no more cost)
    UNCERTAIN  go on; after `canary.max_batches` pairs the run stays on its plan and the shadow stops

and beside the gradient, the shadow rollouts themselves are judged by the admission check's rule (rules.decide, the
guard's thresholds or guard.limit) as `opd admit` judges a probe: the latest shadow batch's nsr and ESS (q: the
sampling weights' own log-probs, for a stale shadow a forward of its older copy; what a guard checking every step
would judge on the candidate's first step), the candidate's staleness x lr against the drift budget, and, where the
run's plan is the BF16 floor's, the run's first step as the floor (the initial student's, as the probe's floor: the
calibration's floors were measured there). Its REJECT rejects the candidate whatever the gradient says (on the
smollm2 pair the gradient statistic alone admitted 100% weight noise and an async FP8 cache at staleness 1:
benchmarks.md, "The canary on a real pair"). Why the latest batch and the first step: the gate's first version took
the mean over every shadow batch and the mean of the run's steps as the floor, and rejected the harmless FP8 cache
there (ess_frac 0.484 < 0.5 over steps 0-3, where the BF16 run's own steps read 0.56-0.61 at steps 1-2 while the
pruned student moves fast, and its floor read 3.7x the initial one). The limits are our studies' calibration: on a
model unlike theirs this gate is a prior, not a measurement of the user's recipe.

After a promotion the roles swap: every `canary.watch_every` steps the shadow samples under the run's own plan, the
training gradient is the candidate's, and the same statistic above the cut (its point estimate, on fresh pairs,
min_batches of them) falls back to the run's plan for the rest of the run. `canary.start: promoted` starts there: the run trains on the candidate
from step 0, watched by the same statistic (a runtime guard on the gradient bias rather than on the rollouts' nsr). The runtime guard (guard.py), where on, still judges the live
mismatch; its fallback ends the canary too. Every switch is a canary.jsonl event with the statistic's numbers and a
line on stderr; the summary's `canary` entry says where the run ended; canary/* metrics are logged at each pair.

A stale candidate (`canary.max_staleness` k > 0): the shadow samples with the weights k versions older (kept: k + 1
copies of the student), and a promotion switches the run to the async schedule at staleness k (a worker process from
the next prompt batch on); a fall back to the in-process engine.

Cost: a shadow step samples one more batch and takes one more backward pass (the shadow batch's), about one step's
work, until the decision (min_batches to max_batches shadow steps), then one every watch_every steps after a promotion.
Memory: the statistic's seven float32 vectors on the CPU (28 bytes a parameter: its noise comes from successive
pairs, drift.Sums) and two float32 gradients; a run they do not fit is refused before it starts.

A checkpoint keeps the phase (trainer_state.json), the statistic's sums and the shadow engine's KV scales (the trainer
state file): a resumed run continues exactly. The shadow changes nothing that trains: a run whose candidate is never
promoted trains the same weights as the run without a canary (tested); the one exception is a served teacher that
calibrates its KV scales on the first batch it scores, which then sees the shadow batch first.
"""
import copy
import json
import math
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from opd.config.runlog import write_atomic
from opd.health.drift import CUT, Sums, decide, require_memory
from opd.health.metrics import RolloutHealth, rollout_health
from opd.health.rules import FLOOR_PLAN, decide as admission, estimator_class
from opd.health.thresholds import load_thresholds
from opd.io.errors import OpdError, require
from opd.numerics.kv_cache import scales_fit
from opd.numerics.plan import Plan
from opd.training.learner import Scoring, collate, flat_gradient, numerics_mu, score_batch
from opd.training.rollouts import SyncRollouts
from opd.training.setup import engine_builder, schedule_rollouts

PHASES = ("shadow", "promoted", "rejected", "undecided", "fallen_back")  # the first two keep a shadow engine
EVENTS = "canary.jsonl"


class Canary:
    """The canary of one run (cfg.canary.plan set). Its phase lives in run.state.canary, so a checkpoint keeps it."""

    def __init__(self, run, run_dir: Path):
        self.run, self.run_dir, self.settings = run, Path(run_dir), run.cfg.canary
        self.reference = run.plan
        try:
            self.candidate = Plan.parse(self.settings.plan, len(run.plan.layers))
        except OpdError as e:
            raise OpdError(f"config: canary.plan: {e.problem}", e.fix) from None
        require(self.candidate != self.reference or self.settings.max_staleness > 0, f"config: canary.plan "
                f"{self.settings.plan!r} is the run's own plan ({self.reference})", "name a candidate that differs "
                "from `plan`, or a canary.max_staleness")
        self.names = {str(self.candidate): self.settings.plan,
                      str(self.reference): (run.cfg.plan or "fp32") if isinstance(run.cfg.plan, str) else
                      str(self.reference)}  # the plans as the config wrote them
        self.cut = self.settings.cut or CUT
        require_memory(run.student, True, "canary training's gradient statistic",
                       "free memory, run on a machine with more, or train without a canary (opd admit --trial K "
                       "judges a candidate without these sums)")
        self.sums, self.shadow, self.saved_scales = Sums(successive=True), None, {}
        self.shadow_grad = self.trained_grad = None
        self.stale = self.settings.max_staleness  # the candidate's schedule: async at this staleness (0: sync)
        self.history: dict[int, dict] = {}  # version -> weights, the last `stale` + 1 (a stale shadow samples them)
        self.thresholds = None if run.cfg.guard.limit else load_thresholds(run.cfg.guard.thresholds)
        self.on_floor = self.reference == Plan.parse(FLOOR_PLAN, len(run.plan.layers))  # the run's steps: the floor
        # RolloutHealth of the run's first step (the BF16 floor, where the plan is BF16) and of the latest shadow batch
        self.health: dict = {"floor": None, "shadow": None}
        self.sampler, self.shadow_health = None, None

    @property
    def phase(self) -> str:
        return self.run.state.canary

    def shadow_plan(self) -> Plan:
        return self.candidate if self.phase == "shadow" else self.reference

    def train_on(self, plan: Plan, staleness: int, first_batch: int, start: bool = True) -> None:
        """The run's rollouts from now on: plan, and the async schedule at `staleness` (0: the synchronous one); a
        switch of schedule replaces the rollouts (a worker process starts or stops), sampling from `first_batch` on."""
        run = self.run
        if isinstance(run.rollouts, SyncRollouts) == (staleness == 0):
            run.use_plan(plan)
            return
        run.rollouts.close()
        run.rollouts = schedule_rollouts(run, plan, staleness or None, first_batch)
        run.plan = plan
        if start:
            run.rollouts.start(run.weights(), run.state.version, {})
            if not staleness:  # a new engine starts at version 0: it is told the weights' version
                run.rollouts.publish(run.weights(), run.state.version)

    def start(self) -> None:
        """Build the shadow engine where the phase keeps one (after a resume: with its saved KV scales); on resume,
        canary.jsonl loses the events of the steps to be re-run (they are logged again)."""
        if not self.run.state.canary:  # a fresh run (or one interrupted before its first checkpoint)
            self.run.state.canary = self.settings.start
            if self.phase == "promoted":
                self.train_on(self.candidate, self.stale, self.run.state.step)
        path = self.run_dir / EVENTS
        if path.is_file():
            kept = [e for e in map(json.loads, path.read_text().splitlines()) if e["step"] < self.run.state.step]
            write_atomic(path, "".join(json.dumps(e) + "\n" for e in kept))
        if self.phase in ("shadow", "promoted"):
            self._build_shadow()

    def _build_shadow(self) -> None:
        """The shadow engine: on the learner's own tensors, or for a stale candidate's shadow on a copy of the
        student that the older weights are loaded into (the learner's are never touched)."""
        run = self.run
        sampler = run.student
        if self.phase == "shadow" and self.stale:
            sampler = copy.deepcopy(run.student).requires_grad_(False)
            self.history.setdefault(run.state.version, _clone(run.student.state_dict()))
        self.sampler = sampler
        build = engine_builder(run.cfg, sampler, run.tok, run.student_dir, run.prompts)
        self.shadow = SyncRollouts(build, self.shadow_plan(), run.prompts, run.params, run.cfg.seed,
                                   exact_kl=False, n_shards=run.cfg.shards)
        self.shadow.start(sampler.state_dict(), run.state.version,
                          {"engine_scales": self.saved_scales} if self.saved_scales else {})

    def due(self, step: int) -> bool:
        if self.phase == "shadow":
            return step % self.settings.every == 0
        return self.phase == "promoted" and self.settings.watch_every > 0 and step % self.settings.watch_every == 0

    def before_step(self, step: int, version: int, key: tuple | None = None):
        """The shadow batch's gradient at the weights the step is about to train (when a pair is due) -> the hook
        train_step calls after its backward pass (it keeps the training gradient), or None. key: the trained batch's
        (prompt batch, attempt); the shadow samples the same prompts with the same seed (a re-sampled attempt of the
        async schedule has no pair). A stale candidate's shadow samples with the weights `stale` versions older,
        as the async schedule at that staleness does in steady state (fewer while it fills)."""
        self.shadow_grad = self.trained_grad = self.shadow_health = None
        index, attempt = key if key is not None else (step, 0)
        if self.shadow is None or not self.due(step) or attempt:
            return None
        run, start = self.run, time.perf_counter()
        self.gap = 0
        if self.phase == "shadow" and self.stale:
            older = [v for v in self.history if v <= version - self.stale]
            old = max(older) if older else min(self.history)  # the pipeline fills: none that old yet
            self.shadow.publish(self.history[old], old)
            self.gap = version - old
        else:
            self.shadow.publish(run.student.state_dict(), version)
        sampled = self.shadow.next_batch(index, version)
        batch = collate(sampled.rollouts, run.tok.pad_id)
        run.student.zero_grad(set_to_none=True)
        scores = score_batch(run.student, batch, run.teacher, Scoring.of(run.cfg), None, backward=True)
        self.shadow_grad = flat_gradient(run.student)
        if self.phase == "shadow":
            self.shadow_health = self._health(batch, scores)
        run.student.zero_grad(set_to_none=True)
        self.seconds = time.perf_counter() - start

        def keep_training_gradient():
            self.trained_grad = flat_gradient(run.student)
        return keep_training_gradient

    def _health(self, batch, scores):
        """The shadow batch's rollout health as the guard reads a training step's: the engine's mu against q, the
        log-probs of the weights that sampled (the learner's; a stale shadow's older copy, one more forward)."""
        cfg = self.run.cfg
        if scores.teacher is None:
            return None
        q = scores.pi if not self.stale else score_batch(self.sampler, batch, None, Scoring.of(cfg, loss=False)).pi
        return RolloutHealth.of(rollout_health(scores.teacher, numerics_mu(batch, cfg.sampling.truncates), q,
                                               batch.mask, cfg.loss.cap))

    def gate(self):
        """The admission check's rule on the latest shadow batch (module docstring) -> rules.Decision, or None before
        the first."""
        if self.health["shadow"] is None:
            return None
        cfg = self.run.cfg
        return admission(self.health["shadow"], self.thresholds, estimator_class(cfg.loss), self.stale,
                         cfg.guard.limit, cfg.optim.lr, self.health["floor"] if self.on_floor else None)

    def after_step(self, step: int, ok: bool, metrics: dict | None = None) -> dict:
        """Add the step's pair (a finite step's) and decide -> canary/* metrics; metrics: the step's own (the run's
        rollout health: the first one is the floor where its plan is BF16). A switch takes effect from the next step's
        rollouts."""
        if self.phase == "shadow" and ok and self.on_floor and metrics and self.health["floor"] is None:
            self.health["floor"] = RolloutHealth.of(metrics)
        if self.phase == "shadow" and self.stale and ok:  # the weights a stale shadow will sample
            version = self.run.state.version
            self.history[version] = _clone(self.run.student.state_dict())
            for v in [v for v in self.history if v < version - self.stale]:
                del self.history[v]
        if self.shadow_grad is None or self.trained_grad is None or not ok:
            self.shadow_grad = self.trained_grad = None
            return {}
        promoted = self.phase == "promoted"
        g, c = (self.shadow_grad, self.trained_grad) if promoted else (self.trained_grad, self.shadow_grad)
        self.sums.add(g, c)
        if self.shadow_health is not None:
            self.health["shadow"] = self.shadow_health
        self.shadow_grad = self.trained_grad = self.shadow_health = None
        out = {"canary/pairs": self.sums.M, "canary/promoted": float(promoted), "time/canary": self.seconds,
               "canary/shadow_version_gap": self.gap}
        if self.sums.M < self.settings.min_batches:
            return out
        numbers = self.sums.stats(max(self.run.cfg.steps - step - 1, 1))
        # promoting is the risky switch: ADMIT needs canary.sigmas standard errors of room; REJECT one; and once
        # promoted, the point estimate above the cut falls back (the run is on the candidate while evidence gathers)
        decision = decide(numbers, self.cut, sigmas=self.settings.sigmas, reject_sigmas=0.0 if promoted else 1.0)
        out |= {"canary/z": decision["z"], "canary/z_se": decision["z_se"]}
        verdict = decision["decision"]
        gate = None if promoted else self.gate()
        if gate is not None:
            out["canary/shadow_nsr"] = gate.value
        if not promoted and (verdict == "REJECT" or (gate is not None and gate.reject)):
            self._switch(step, "rejected", "reject", decision, numbers, gate)
        elif not promoted and verdict == "ADMIT":
            self._switch(step, "promoted", "promote", decision, numbers, gate)
        elif not promoted and self.sums.M >= self.settings.max_batches:
            self._switch(step, "undecided", "undecided", decision, numbers, gate)
        elif promoted and verdict == "REJECT":
            self._switch(step, "fallen_back", "fall_back", decision, numbers)
        return out | {"canary/promoted": float(self.phase == "promoted")}

    def _switch(self, step: int, phase: str, event: str, decision: dict, numbers: dict, gate=None) -> None:
        was = self.name(self.run.plan)
        self.run.state.canary = phase
        self.sums = Sums(successive=True)
        self.history.clear()
        self.health["shadow"] = None
        if phase == "promoted":
            self.close()
            self.train_on(self.candidate, self.stale, step + 1)
            self._build_shadow()
        else:
            if phase == "fallen_back":
                self.train_on(self.reference, 0, step + 1)
            self.close()
        z = f"z {decision['z']:.3g} +- {decision['z_se']:.3g} against the cut {decision['cut']:g} over " \
            f"{decision['batches']} pairs, {decision['steps']} steps to go"
        candidate, reference = self.name(self.candidate), self.name(self.reference)
        if gate is not None and (gate.reject or event != "reject"):
            said = [r for r in gate.reasons if not r.startswith(("kl_k3 ", "adv_sign_flip "))]  # the judged ones
            z += f"; its rollouts: {gate.verdict} by the admission check's rule ({'; '.join(said)})"
        line = {"promote": f"candidate {candidate} admitted ({z}): training on it from step {step + 1}",
                "reject": f"candidate {candidate} rejected ({z}): the run stays on {reference}",
                "undecided": f"candidate {candidate} undecided after {decision['batches']} pairs ({z}): the "
                             f"run stays on {reference}",
                "fall_back": f"candidate {candidate} rejected while training on it ({z}): back to "
                             f"{reference} from step {step + 1}"}[event]
        self._log({"step": step, "event": event, "from": was, "to": self.name(self.run.plan),
                   "decision": decision, "numbers": numbers} | (
                      {"rollouts": gate.to_dict()} if gate is not None else {}), line)

    def guard_fell_back(self, step: int) -> None:
        """The runtime guard switched the rollouts to a safer plan: the canary ends there."""
        if self.phase in ("shadow", "promoted"):
            self.run.state.canary = "fallen_back" if self.phase == "promoted" else "rejected"
            self.close()
            self._log({"step": step, "event": "guard", "to": self.name(self.run.plan)},
                      f"the runtime guard switched the rollouts to {self.name(self.run.plan)}: the canary stops")

    def _log(self, event: dict, line: str) -> None:
        with open(self.run_dir / EVENTS, "a") as f:
            f.write(json.dumps(_finite(event)) + "\n")
        print(f"opd: canary: step {event['step']}: {line}", file=sys.stderr)

    def summary(self) -> dict:
        events = self.run_dir / EVENTS
        n = len(events.read_text().splitlines()) if events.is_file() else 0
        return {"phase": self.phase, "candidate": self.name(self.candidate), "plan": self.name(self.run.plan),
                "events": n}

    def name(self, plan: Plan) -> str:
        """A plan as the config wrote it (the candidate, the run's plan), else its canonical text."""
        return self.names.get(str(plan), str(plan))

    def state_dict(self) -> dict:
        """The statistic's sums and the shadow engine's KV scales, for the trainer state file."""
        versions = sorted(self.history)
        return {"canary": self.sums.state_dict(),
                "canary_scales": dict(self.shadow.scales) if self.shadow is not None else {},
                "canary_history": {"versions": versions, "weights": [self.history[v] for v in versions]},
                "canary_health": {k: asdict(h) if h is not None else None for k, h in self.health.items()}}

    def load_state_dict(self, blob: dict, where: str, fix: str) -> None:
        """What state_dict saved (checked), and the plan the phase trains on (a promoted run resumes on the
        candidate)."""
        size = sum(p.numel() for p in self.run.student.parameters())
        sums = Sums.from_state(blob.get("canary", {"M": 0, "sums": []}), size, successive=True)
        scales, model = blob.get("canary_scales", {}), self.run.student.cfg
        require(sums is not None and scales_fit(scales, model.num_layers, model.num_kv_heads),
                f"{where}: its canary state does not fit this run", fix)
        history = blob.get("canary_history", {"versions": [], "weights": []})
        own = self.run.student.state_dict()
        versions, weights = history.get("versions"), history.get("weights")
        require(isinstance(versions, list) and isinstance(weights, list) and len(versions) == len(weights) and all(
            isinstance(v, int) and isinstance(w, dict) and w.keys() == own.keys() and all(
                isinstance(w[k], torch.Tensor) and w[k].shape == own[k].shape for k in own)
            for v, w in zip(versions, weights)), f"{where}: its canary state does not fit this run", fix)
        health = blob.get("canary_health", {"floor": None, "shadow": None})
        names = {f.name for f in fields(RolloutHealth)}
        require(isinstance(health, dict) and health.keys() == {"floor", "shadow"} and all(
            h is None or (isinstance(h, dict) and h.keys() == names and all(
                v is None or isinstance(v, float) for v in h.values())) for h in health.values()),
            f"{where}: its canary state does not fit this run", fix)
        self.sums, self.saved_scales = sums, scales
        self.history = dict(zip(versions, weights))
        self.health = {k: RolloutHealth(**h) if h is not None else None for k, h in health.items()}
        if self.phase == "promoted":  # the rollouts the trainer then starts with the checkpoint's batches in flight
            self.train_on(self.candidate, self.stale, self.run.state.step, start=False)

    def close(self) -> None:
        if self.shadow is not None:
            self.shadow.close()
            self.shadow = None


def _clone(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def _finite(value):
    """JSON has no NaN: a non-finite number is written as null."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value if not isinstance(value, float) or math.isfinite(value) else None
