"""The paired trial, `opd admit --trial K`: decide from K steps of the user's own recipe (model, prompts, loss,
learning rate), with no calibration of ours on the model.

From the run's own start, K steps each of: the BF16 twin (synchronous BF16 rollouts, the run's seed), the candidate
(the run's plan and schedule, the same seed: the same prompts and sampling draws, common random numbers), and
`seeds` more BF16 runs with other seeds. All are evaluated on the same fixed held-out contexts (eval.contexts fixed:
the initial student's samples, scored exactly), so their numbers differ by their weights alone, every max(1, K // 3)
steps and at step K (`eval_steps`). At each of those evaluations, for the held-out reverse KL and the entropy,

    z = |candidate - twin| / mean over the other seeds |BF16 seed - twin|

the candidate's gap in units of the gap this recipe's own seeds open in the same steps (its learning rate and
horizon included: what a probe of the rollouts never sees); the evaluation's z is the larger of the two, and the
trial's z is the mean over its evaluations (a gap that holds counts more than one that flickers once; on the toys'
fixed-context trials, each cut fitted on the other pair, the mean over steps 2 and 4 decided 0.865 / 0.905 of the
runs right where z at step 4 alone decided 0.811 / 0.568, and over 2, 4, 6: 0.824 / 0.905 against 0.757 / 0.905;
docs/admission-results.md). The measurement's own error is the noise estimate's: the
mean of n absolute differences of normal variables has a relative standard error of sqrt(pi/2 - 1)/sqrt(n) (0.53
with 2 seeds), and z inherits it (the evaluations' noise estimates share their seeds, so averaging them does not
shrink it). REJECT where z minus its standard error exceeds the cut, ADMIT where z plus it stays under, UNCERTAIN
between (with the seeds that would decide).

The cut is provisional: fitted on one built-in pair's fixed-context trials and applied to the other (the mean z over
steps 2, 4, 6), the best cuts were 2.79 and 2.95; TRIAL_CUT rounds them. It is to be refitted on the real pairs'
trials (docs/admission-results.md, "The paired trial").

Beside z, the trial's own training steps measure the rollouts' mismatch: the candidate's mean `opd/nsr` (the engine's
log-probs against the trainer's, next to the OPD signal) over its steps, against the BF16 twin's on the same prompts
and draws. A candidate whose nsr is more than NSR_RATIO times its twin's is rejected whatever z says (a
non-finite nsr, broken rollouts, too): some mismatch harms a run only after the trial's K steps. Unitless, on the
user's model, like z. Chosen on the built-in pairs (docs/admission-results.md, "The paired trial"): with the stored
runs' probe nsr over their BF16 floor as the stand-in, fitted on one pair and applied to the other at K = 4, the best
cuts were 29.6 and 43.3; added to the product's rule (cut 3, three ways) at K = 4 it took the admitted-and-degraded
share from 2.7% to 0 (llama) and 8.1% to 2.7% (qwen3), right 0.811 / 0.784 against 0.811 / 0.757 (at K = 2 and 6
it cost llama one run each: docs/admission-results.md). On the smollm2 pair at lr 1e-4 two runs
above 30x (INT4 weights 40x, 10% weight noise 44x) trained fine, and at lr 3e-5 every run above it degraded: the
gate errs on the safe side there.
"""
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from opd.config.run import GuardConfig, TrainConfig
from opd.config.runlog import read_metrics
from opd.config.sections import CanaryConfig
from opd.health.drift import chance_other_side, record_text
from opd.health.rules import FLOOR_PLAN, estimator_class, staleness
from opd.io.errors import require
from opd.models.devices import restored_threads
from opd.training.trainer import train

TRIAL_CUT = 3.0  # provisional (module docstring)
NSR_RATIO = 30.0  # the candidate's rollout nsr over its BF16 twin's past which the trial rejects (module docstring)
# The rule's record at K = 4 (cut, gate, three ways), what `--trial` states as its error rate beside the measurement's
# own: `python studies/paired_trial.py --report studies/data/paired_trial_toys_fixed.jsonl,studies/data/
# paired_trial_smollm2.jsonl --record` (tests/test_study.py recomputes it). The built-in pairs' runs chose the cut and
# the gate; the smollm2 pair's (full_rkl at lr 1e-4 and 3e-5) fitted nothing.
TRIAL_RECORD = {
    "built-in": {"what": "the built-in pairs (where the cut was chosen)", "runs": 148, "admitted": 86,
                 "admitted_degraded": 2, "rejected": 39, "rejected_fine": 10},
    "smollm2": {"what": "the smollm2 pair (never fitted)", "runs": 42, "admitted": 13, "admitted_degraded": 3,
                "rejected": 4, "rejected_fine": 4},
}
QUANTITIES = ("rkl", "entropy")
NOISE_RSE = math.sqrt(math.pi / 2 - 1)  # relative standard error of one |N(0, s2)| as an estimate of its mean


def trial_z(candidate: dict, twin: dict, others: list[dict]) -> dict:
    """Held-out numbers at step K ({"eval/rkl", "eval/entropy"} of each run) -> {"z_rkl", "z_entropy", "z", "z_se",
    "noise_seeds"}: the candidate's gap to its twin in units of the mean gap of the other BF16 seeds to the twin."""
    require(bool(others), "a paired trial needs at least one more BF16 seed", "use seeds >= 1")
    out = {}
    for name in QUANTITIES:
        key = f"eval/{name}"
        noise = sum(abs(o[key] - twin[key]) for o in others) / len(others)
        out[f"z_{name}"] = abs(candidate[key] - twin[key]) / max(noise, 1e-12)
    return out | {"z": max(out[f"z_{name}"] for name in QUANTITIES), "noise_seeds": len(others)}


def eval_steps(steps: int) -> list[int]:
    """The steps after which a K-step trial evaluates: every max(1, K // 3) steps, and K."""
    every = max(1, steps // 3)
    return sorted(set(range(every, steps + 1, every)) | {steps})


def trial_z_mean(candidate: dict, twin: dict, others: list[dict]) -> dict:
    """Held-out numbers by step ({step: {"eval/rkl", "eval/entropy"}} of each run) -> trial_z at every step all runs
    were evaluated, averaged: {"z_rkl", "z_entropy"} (the means of each), "z" (the mean of each step's larger one),
    "z_by_step", "noise_seeds"."""
    steps = sorted(set(candidate).intersection(twin, *others))
    require(bool(steps), "the trial's runs share no evaluation step", "evaluate them at the same steps")
    each = {k: trial_z(candidate[k], twin[k], [o[k] for o in others]) for k in steps}
    mean = lambda key: sum(z[key] for z in each.values()) / len(each)  # noqa: E731
    return {"z_rkl": mean("z_rkl"), "z_entropy": mean("z_entropy"), "z": mean("z"),
            "z_by_step": {k: z["z"] for k, z in each.items()}, "noise_seeds": len(others)}


def mismatch(candidate_nsr: float | None, twin_nsr: float | None, ratio: float | None = None) -> dict | None:
    """The trial's mismatch gate (module docstring; ratio: NSR_RATIO): {"nsr", "twin_nsr", "nsr_ratio", "reject"}, or
    None where the candidate's steps measured no nsr (an async candidate that recomputes no q)."""
    ratio = NSR_RATIO if ratio is None else ratio
    if candidate_nsr is None or twin_nsr is None:
        return None
    if not math.isfinite(candidate_nsr):
        return {"nsr": candidate_nsr, "twin_nsr": twin_nsr, "nsr_ratio": math.nan, "reject": True}
    times = candidate_nsr / twin_nsr if twin_nsr > 0 else (math.inf if candidate_nsr > 0 else 1.0)
    return {"nsr": candidate_nsr, "twin_nsr": twin_nsr, "nsr_ratio": times, "reject": times > ratio}


def mean_nsr(rows: list[dict]) -> float | None:
    """A run's mean opd/nsr over its training steps (a NaN, broken log-probs, stays one); None without any."""
    values = [r["opd/nsr"] for r in rows if r.get("opd/nsr") is not None]
    return sum(values) / len(values) if values else None


def decide(z: float, seeds: int, cut: float) -> dict:
    """ADMIT / REJECT / UNCERTAIN from z and its standard error with `seeds` noise seeds (z_se) against the cut;
    UNCERTAIN says how many noise seeds would decide (None: more than 64)."""
    per_seed = z * NOISE_RSE  # z_se = per_seed / sqrt(seeds)
    se = per_seed / math.sqrt(seeds)
    if z - se > cut:
        return {"decision": "REJECT", "z_se": se}
    if z + se <= cut:
        return {"decision": "ADMIT", "z_se": se}
    need = math.ceil((per_seed / max(abs(z - cut), 1e-12)) ** 2)
    return {"decision": "UNCERTAIN", "z_se": se, "seeds_to_decide": need if need <= 64 else None}


def check_trial(cfg: TrainConfig, steps: int = 4, seeds: int = 2, cut: float | None = None, propose: bool = True,
                progress=None) -> dict:
    """`opd admit --trial K` on a checked config: the paired trial (module docstring), in a temporary folder.
    propose: on REJECT, what passes the same trial (check.propose_passing: lower staleness, or the most sensitive
    layers in BF16), each try K more steps against the same twin and seeds. progress(text), if given, is told what
    runs."""
    from opd.admission.check import propose_passing
    require(1 <= steps <= 10_000, f"--trial must be a step count in [1, 10000], got {steps}", "4 or so")
    require(1 <= seeds <= 16, f"--trial-seeds must be in [1, 16], got {seeds}", "2 or so")
    require(cfg.compute.learner_ranks == 1, f"opd admit --trial trains in this process, and compute.learner_ranks is "
            f"{cfg.compute.learner_ranks}", "run the trial with --set compute.learner_ranks=1 where the student fits "
            "one device, or use opd admit --self")
    cut = TRIAL_CUT if cut is None else cut
    say = progress or (lambda text: None)
    start = time.perf_counter()
    eval_seed = cfg.eval.seed if cfg.eval.seed >= 0 else cfg.seed + 1
    at = eval_steps(steps)  # the trial reads the contexts' numbers only: no greedy decoding
    base = replace(cfg, steps=steps, save_every=0, guard=GuardConfig(), canary=CanaryConfig(),
                   eval=replace(cfg.eval, every=at[0] if len(at) > 1 else 0, contexts="fixed", seed=eval_seed,
                                resample_final=False, greedy=False))
    twin = replace(base, plan=FLOOR_PLAN, schedule="sync")
    runs = [("twin", twin), ("candidate", base)] + [(f"seed {cfg.seed + i}", replace(twin, seed=cfg.seed + i))
                                                    for i in range(1, seeds + 1)]
    after, seconds, shared, nsr, step_s = {}, {}, {}, {}, {}
    stale = staleness(cfg)
    with tempfile.TemporaryDirectory() as folder, restored_threads():
        def held_out(name: str, run_cfg: TrainConfig) -> dict:
            n = len(seconds) + 1
            say(f"trial run {n}{f'/{len(runs)}' if n <= len(runs) else ''}: {name} ({run_cfg.plan or 'fp32'}, "
                f"{run_cfg.schedule}, seed {run_cfg.seed}), {steps} steps")
            t = time.perf_counter()
            run_dir = Path(folder) / f"run{n}"
            summary = train(run_cfg, run_dir, progress=False, before=shared.get("before"),
                            contexts=shared.get("contexts"))
            seconds[name] = time.perf_counter() - t
            if not shared:  # the twin sampled them: every other run is evaluated on the same contexts
                shared.update(contexts=run_dir / "eval_contexts.json", before=summary["before"])
            rows = read_metrics(run_dir)
            nsr[name] = mean_nsr([r for r in rows if "loss/value" in r])
            times = [r["time/step"] for r in rows if "loss/value" in r and r.get("time/step")]
            step_s[name] = sum(times) / len(times) if times else None
            return {r["step"]: {k: r[k] for k in ("eval/rkl", "eval/entropy")}
                    for r in rows if "eval/rkl" in r and r["step"] > 0}

        def gated(verdict: dict, name: str) -> dict:
            """The verdict with the mismatch gate applied to run `name`'s rollouts (module docstring)."""
            gate = mismatch(nsr.get(name), nsr.get("twin"))
            if gate is None:
                return verdict
            return verdict | {"mismatch": gate} | ({"decision": "REJECT"} if gate["reject"] else {})

        for name, run_cfg in runs:
            after[name] = held_out(name, run_cfg)
        others = [after[name] for name, _ in runs[2:]]
        numbers = trial_z_mean(after["candidate"], after["twin"], others)
        verdict = gated(decide(numbers["z"], seeds, cut), "candidate")
        proposal = None
        if verdict["decision"] == "REJECT" and propose:
            def judge(candidate: TrainConfig, k: int) -> dict:
                label = f"proposal {len(seconds) - len(runs) + 1}"
                after[label] = held_out(label, replace(base, plan=candidate.plan, schedule=candidate.schedule,
                                                       async_=candidate.async_))
                z = trial_z_mean(after[label], after["twin"], others)["z"]
                return {"z": z} | gated(decide(z, seeds, cut), label)
            proposal = propose_passing(cfg, stale, judge, what="opd admit --trial")
    what = f"plan {cfg.plan or 'fp32'}" + (f" at staleness {stale}" if stale else "")
    last = {name: runs_[steps] for name, runs_ in after.items()}
    gaps = {name: [abs(o[steps][f"eval/{name}"] - last["twin"][f"eval/{name}"]) for o in others]
            for name in QUANTITIES}
    reasons = [f"{what}: after {steps} steps of this recipe its held-out reverse KL is "
               f"{last['candidate']['eval/rkl']:.5g} against {last['twin']['eval/rkl']:.5g} for BF16 rollouts with "
               f"the same prompts and draws (entropy {last['candidate']['eval/entropy']:.5g} against "
               f"{last['twin']['eval/entropy']:.5g}), on {cfg.eval.examples} held-out prompts' fixed contexts",
               f"{seeds} more BF16 seed(s) of the same recipe open gaps of "
               + ", ".join(f"{g:.3g}" for g in gaps["rkl"]) + " (reverse KL) and "
               + ", ".join(f"{g:.3g}" for g in gaps["entropy"]) + f" (entropy) in those {steps} steps",
               f"z = {numbers['z']:.2f} +- {verdict['z_se']:.2f}, the mean over the evaluations after steps "
               + ", ".join(f"{k} ({z:.2f})" for k, z in numbers["z_by_step"].items())
               + f" (reverse KL {numbers['z_rkl']:.2f}, entropy {numbers['z_entropy']:.2f} on average); the cut is "
               f"{cut:g}, provisional (docs/admission.md, \"The paired trial\")"]
    gate = verdict.get("mismatch")
    if gate is not None:
        reasons.append(f"its rollouts' nsr (the engine's log-probs against the trainer's, next to the OPD signal) "
                       f"averaged {gate['nsr']:.3g} over its steps, {gate['nsr_ratio']:.3g}x the BF16 twin's "
                       f"{gate['twin_nsr']:.3g}" + (f": more than {NSR_RATIO:g}x, REJECT whatever z says (a "
                                                    "mismatch that large may harm after the trial's steps)"
                                                    if gate["reject"] else f" (at most {NSR_RATIO:g}x passes)"))
    chance = chance_other_side(numbers["z"], verdict["z_se"], cut)
    record = TRIAL_RECORD if cut == TRIAL_CUT and steps == 4 else {}
    reasons.append(f"error rate: this measurement's noise puts z on the wrong side of the cut with chance {chance:.0%}"
                   + (record_text(record) if record else " (the rule's record is for the shipped cut at K = 4 only: "
                      "docs/admission.md, \"The paired trial\")"))
    if verdict["decision"] == "UNCERTAIN":
        more = verdict.get("seeds_to_decide")
        reasons.append("the measurement straddles the cut" + (f": about {more} BF16 seeds (--trial-seeds) would "
                                                               "decide" if more else ""))
    trial_steps = steps * len(seconds)
    total = time.perf_counter() - start
    if step_s.get("twin"):  # the whole trial (its evaluations, loads and sampling too) in the twin's training steps
        equivalent = total / step_s["twin"]
        reasons.append(f"cost: {total:.0f} s, {equivalent:.0f} of this recipe's BF16 steps ({step_s['twin']:.3g} s "
                       f"each, the twin's): {equivalent / 1000:.1%} of a 1,000-step run, "
                       f"{equivalent / max(1, cfg.steps):.1%} of this run's {cfg.steps}")
    return verdict | numbers | ({"proposal": proposal} if proposal else {}) | {
        "mode": "trial", "error_rate": {"measurement": chance, "record": record}, "plan": str(cfg.plan), "estimator_class": estimator_class(cfg.loss), "staleness": stale,
        "cut": cut, "steps": steps, "held_out": after, "reasons": reasons, "cost_steps": trial_steps,
        "cost_share": trial_steps / max(1, cfg.steps), "run_seconds": seconds, "step_seconds": step_s.get("twin"),
        "cost_step_equivalents": total / step_s["twin"] if step_s.get("twin") else None, "seconds": total}
