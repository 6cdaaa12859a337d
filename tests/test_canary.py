"""Canary training (training/canary.py) on tiny random models: the shadow changes nothing that trains, a harmless
candidate is promoted and a harmful one is not, a promoted candidate falls back on the statistic's REJECT, and a run
resumed across the switches equals the uninterrupted one."""
import json

import pytest
import torch

from opd.config.runlog import read_metrics
from opd.io.errors import OpdError
from opd.models.checkpoint import load_checkpoint
from opd import make_config as opd_config
from opd.training import canary
from opd.training.trainer import train

from helpers import comparable, config, crash_at, opd

NO_DECISION = dict(min_batches=100, max_batches=100)  # pairs every step, never enough to decide


def weights(folder):
    model, _ = load_checkpoint(folder / "checkpoint")
    return model.state_dict()


def without_canary(rows):
    return [{k: v for k, v in r.items() if not k.startswith("canary/") and k != "time/canary"} for r in rows]


def events(run_dir):
    path = run_dir / "canary.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.parametrize("stale", [0, 1])
def test_a_shadow_that_never_decides_changes_nothing_that_trains(pair, tmp_path, stale):
    """The oracle: the shadow batch's sampling and backward pass leave the training run as it was without a canary
    (the same metrics and weights, bit for bit), while its pairs are taken every step; a stale candidate's shadow
    samples with the weights one version older (none older at step 0, as the async schedule while it fills)."""
    plain = config(pair, steps=4, threads=2, async_=dict(worker_threads=1))
    shadowed = config(pair, steps=4, threads=2, async_=dict(worker_threads=1),
                      canary=dict(plan="kv=fp8_e4m3", max_staleness=stale, **NO_DECISION))
    train(plain, tmp_path / "plain", progress=False)
    summary = train(shadowed, tmp_path / "canary", progress=False)
    a, b = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "canary")
    assert comparable(without_canary(b)) == comparable(a)
    assert [r.get("canary/pairs") for r in b[:4]] == [1, 2, 3, 4]
    assert [r.get("canary/shadow_version_gap") for r in b[:4]] == [0, stale, stale, stale]
    if stale:  # the older weights are in the checkpoint: a crash after step 3 resumes (from step 3) exactly
        with pytest.raises(RuntimeError):
            train(shadowed, tmp_path / "split", progress=False, on_step=crash_at(3))
        train(shadowed, tmp_path / "split", resume=True, progress=False)
        assert comparable(read_metrics(tmp_path / "split")) == comparable(b)
    for name, tensor in weights(tmp_path / "plain").items():
        assert torch.equal(tensor, weights(tmp_path / "canary")[name]), name
    assert summary["canary"]["phase"] == "shadow" and events(tmp_path / "canary") == []


def test_a_harmless_candidate_is_promoted_and_trains_from_the_next_step(pair, tmp_path):
    """BF16 rollouts under a float32 run, with a cut no bias reaches: ADMIT at the second pair, and from the step
    after it the training rollouts carry the bf16 engine's mismatch (before it, the float32 engine has none)."""
    cfg = config(pair, steps=5, canary=dict(plan="forward=bf16 kv=bf16", min_batches=2, cut=1e6))
    summary = train(cfg, tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    [event] = events(tmp_path / "run")
    assert event["event"] == "promote" and event["step"] == 1 and event["decision"]["decision"] == "ADMIT"
    assert event["numbers"]["M"] == 2 and event["to"] == "forward=bf16 kv=bf16"
    kl = [r["mismatch/kl_k3"] for r in rows[:5]]
    assert max(kl[:2]) < 1e-9 < 1e-6 < min(kl[2:])  # float32 engine: rounding only; bf16: its mismatch
    assert summary["canary"] == {"phase": "promoted", "candidate": "forward=bf16 kv=bf16",
                                 "plan": "forward=bf16 kv=bf16", "events": 1}
    assert rows[1]["canary/promoted"] == 1.0 and rows[0]["canary/promoted"] == 0.0


@pytest.mark.parametrize("candidate, event", [("noise=1.0", "reject"), ("forward=bf16 kv=bf16", "promote")])
def test_at_the_shipped_cut_bf16_is_promoted_and_full_weight_noise_is_rejected(tmp_path, candidate, event):
    """The built-in llama pair under the first study's sampled_mu recipe (lr 1e-4, 5 warm-up steps; 24 steps of 16
    here): weight noise of 100% on every layer (degraded in that study, z 6-31 there) is rejected and the run never
    leaves its plan, the shadow stopping at the decision; BF16 rollouts under the float32 run are promoted."""
    cfg = opd_config(family="llama", task="chain", steps=24, batch_size=16, threads=1, plan="", save_every=0,
                     loss=dict(name="sampled_rkl", student_term="sampler"), optim=dict(lr=1e-4, warmup_steps=5),
                     eval=dict(every=0, examples=8), canary=dict(plan=candidate, min_batches=4))
    summary = train(cfg, tmp_path / "run", progress=False)
    [first] = events(tmp_path / "run")
    decision = first["decision"]
    assert first["event"] == event and first["step"] == 3 and first["numbers"]["M"] == 4
    rows = read_metrics(tmp_path / "run")[:24]
    if event == "reject":
        assert decision["z"] - decision["z_se"] > decision["cut"] == 2.88
        assert all("canary/pairs" not in r for r in rows[4:])
        assert all(r["mismatch/kl_k3"] < 1e-9 for r in rows)  # the training rollouts never left the float32 plan
        assert summary["canary"]["phase"] == "rejected"
    else:
        assert decision["z"] + decision["z_se"] <= decision["cut"]
        assert all(r["mismatch/kl_k3"] > 1e-6 for r in rows[4:]) and summary["canary"]["phase"] == "promoted"
        assert [("canary/pairs" in r) for r in rows[4:9]] == [True, False, False, False, True]  # watched every 4


def scripted(numbers, cut, sigmas=1.0, **_):
    """decide() by the steps left: ADMIT while more than 3 remain, REJECT after (a promotion, then a fall back)."""
    verdict = "ADMIT" if numbers["T"] > 3 else "REJECT"
    return {"decision": verdict, "z": 0.0, "z_se": 0.0, "cut": cut, "sigmas": sigmas, "batches": numbers["M"],
            "steps": numbers["T"]}


def test_a_promoted_candidate_falls_back_and_a_resume_across_both_switches_is_exact(pair, tmp_path, monkeypatch):
    """Promoted at step 1 (two pairs), watched every step, rejected at step 4: trains on the candidate at steps 2-4
    and on the run's plan again from step 5. A crash after step 3 resumes from the checkpoint at step 3 (promoted,
    one watch pair in its sums) and logs the uninterrupted run's metrics and events."""
    monkeypatch.setattr(canary, "decide", scripted)
    cfg = config(pair, steps=8, canary=dict(plan="forward=bf16 kv=bf16", min_batches=2, watch_every=1))
    train(cfg, tmp_path / "straight", progress=False)
    assert [(e["event"], e["step"]) for e in events(tmp_path / "straight")] == [("promote", 1), ("fall_back", 4)]
    kl = [r["mismatch/kl_k3"] for r in read_metrics(tmp_path / "straight")[:8]]
    assert [k > 1e-6 for k in kl] == [False, False, True, True, True, False, False, False]
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "split", progress=False, on_step=crash_at(3))
    saved = json.loads((tmp_path / "split" / "checkpoint" / "trainer_state.json").read_text())
    assert saved["step"] == 3 and saved["canary"] == "promoted"
    summary = train(cfg, tmp_path / "split", resume=True, progress=False)
    assert comparable(read_metrics(tmp_path / "split")) == comparable(read_metrics(tmp_path / "straight"))
    assert events(tmp_path / "split") == events(tmp_path / "straight")
    assert summary["canary"]["phase"] == "fallen_back" and summary["canary"]["plan"] == "fp32"


def test_starting_promoted_is_a_runtime_guard_on_the_same_statistic(pair, tmp_path, monkeypatch):
    """canary.start promoted: the candidate trains from step 0, the run's plan is the watched shadow, and the
    statistic's REJECT falls back (scripted: at the pair where 3 steps remain)."""
    monkeypatch.setattr(canary, "decide", scripted)
    cfg = config(pair, steps=6, canary=dict(plan="forward=bf16 kv=bf16", min_batches=2, watch_every=1,
                                            start="promoted"))
    summary = train(cfg, tmp_path / "run", progress=False)
    assert [(e["event"], e["step"]) for e in events(tmp_path / "run")] == [("fall_back", 2)]
    kl = [r["mismatch/kl_k3"] for r in read_metrics(tmp_path / "run")[:6]]
    assert [k > 1e-6 for k in kl] == [True, True, True, False, False, False]
    assert summary["canary"]["phase"] == "fallen_back"


def test_a_stale_candidate_is_promoted_into_the_async_schedule_and_resumes_exactly_across_both_switches(
        pair, tmp_path, monkeypatch):
    """The seed recipe as a canary: FP8 KV at staleness 1. Promoted at step 1, the run continues in the async
    schedule (a worker process; from step 2 on the rollouts trained at step s were sampled by version s - 1 once the
    pipeline fills), falls back to synchronous float32 at step 4; a crash after step 3 resumes from the checkpoint at
    step 3, whose async batches in flight come back, to the uninterrupted run's metrics and events."""
    monkeypatch.setattr(canary, "decide", scripted)
    cfg = config(pair, steps=8, threads=2, async_=dict(worker_threads=1),
                 canary=dict(plan="kv=fp8_e4m3", max_staleness=1, min_batches=2, watch_every=1))
    train(cfg, tmp_path / "straight", progress=False)
    assert [(e["event"], e["step"]) for e in events(tmp_path / "straight")] == [("promote", 1), ("fall_back", 4)]
    rows = read_metrics(tmp_path / "straight")[:8]
    assert [r.get("stale/version_gap_mean", 0) for r in rows] == [0, 0, 0, 1, 1, 0, 0, 0]
    assert [r["mismatch/kl_k3"] > 1e-6 for r in rows] == [False, False, True, True, True, False, False, False]
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "split", progress=False, on_step=crash_at(3))
    summary = train(cfg, tmp_path / "split", resume=True, progress=False)
    assert comparable(read_metrics(tmp_path / "split")) == comparable(read_metrics(tmp_path / "straight"))
    assert events(tmp_path / "split") == events(tmp_path / "straight")
    assert summary["canary"]["phase"] == "fallen_back"


def test_the_guards_rule_on_the_shadow_rollouts_rejects_what_the_gradient_would_promote(pair, tmp_path):
    """A cut no bias reaches (the gradient statistic admits at the second pair), and a guard limit every mismatch
    exceeds: the candidate is rejected on its shadow rollouts' nsr, the run never leaves its plan; with a limit above
    the candidate's nsr the same run promotes it. The event carries the rule's decision and the nsr it judged."""
    for limit, event in ((1e-9, "reject"), (10.0, "promote")):
        cfg = config(pair, steps=4, guard=dict(limit=limit),
                     canary=dict(plan="forward=bf16 kv=bf16", min_batches=2, cut=1e6))
        summary = train(cfg, tmp_path / event, progress=False)
        [first] = events(tmp_path / event)
        rows = read_metrics(tmp_path / event)[:4]
        assert first["event"] == event and first["step"] == 1 and first["decision"]["decision"] == "ADMIT"
        assert first["rollouts"]["nsr"] == rows[1]["canary/shadow_nsr"] > 1e-6  # the latest shadow batch's
        if event == "reject":
            assert first["rollouts"]["decision"] == "REJECT" and summary["canary"]["phase"] == "rejected"
            assert all(r["mismatch/kl_k3"] < 1e-9 for r in rows)
        else:
            assert first["rollouts"]["decision"] == "ADMIT" and summary["canary"]["phase"] == "promoted"


def test_a_stale_shadows_rollouts_are_judged_against_the_weights_that_sampled_them(pair, tmp_path):
    """The oracle for the stale shadow's q: a candidate that is the run's own float32 plan one version stale has no
    numerics mismatch, so its nsr is rounding only (were q the current weights', it would be the staleness's); at an
    lr whose drift budget (staleness x lr) is past the calibrated one the rule rejects it for its staleness."""
    cfg = config(pair, steps=4, threads=2, async_=dict(worker_threads=1), optim=dict(lr=2e-2),
                 canary=dict(plan="kv=fp32", max_staleness=1, min_batches=3, cut=1e6))
    train(cfg, tmp_path / "run", progress=False)
    [event] = events(tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert event["event"] == "reject" and event["step"] == 2 and event["rollouts"]["decision"] == "REJECT"
    assert event["rollouts"]["nsr"] < 1e-5 and any("drift" in r for r in event["rollouts"]["reasons"])
    assert [r["canary/shadow_version_gap"] for r in rows[:3]] == [0, 1, 1]


@pytest.mark.parametrize("overrides, message", [
    (dict(canary=dict(plan="kv=fp9")), "canary.plan"),
    (dict(canary=dict(plan="kv=fp8_e4m3"), schedule="async", threads=2), "synchronous"),
    (dict(canary=dict(plan="kv=fp8_e4m3", min_batches=1)), "min_batches"),
    (dict(canary=dict(plan="kv=fp8_e4m3", min_batches=8, max_batches=4)), "max_batches"),
    (dict(canary=dict(plan="kv=bf16"), plan="kv=bf16"), "the run's own plan"),
    (dict(canary=dict(plan="kv=bf16", start="later")), "canary.start"),
    (dict(canary=dict(plan="kv=bf16", max_staleness=1)), "a stale canary candidate"),
    (dict(canary=dict(plan="kv=bf16", max_staleness=-1)), "canary.max_staleness"),
])
def test_bad_canary_settings_are_one_line_errors(pair, tmp_path, overrides, message):
    with pytest.raises(OpdError, match=message):
        train(config(pair, **overrides), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_cli_takes_the_canary_section(pair, tmp_path):
    student, teacher = pair
    settings = [f"student={student}", f"teacher={teacher}", "task=add", "steps=3", "batch_size=4", "eval.every=0",
                "eval.examples=8", "threads=1", "plan=", "canary.plan=kv=fp8_e4m3", "canary.min_batches=2",
                "canary.cut=1e6"]
    out = opd("train", *[x for s in settings for x in ("--set", s)], "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    assert "opd: canary: step 1: candidate kv=fp8_e4m3 admitted" in out.stderr
    assert "opd: note: a canary without the runtime guard" in out.stderr  # guard.every 0 here
    guarded = opd("train", *[x for s in settings + ["guard.every=1"] for x in ("--set", s)], "--run-dir",
                  str(tmp_path / "guarded"))
    assert guarded.returncode == 0 and "a canary without the runtime guard" not in guarded.stderr, guarded.stderr
    bad = opd("train", "--set", "canary.every=0", "--run-dir", str(tmp_path / "bad"))
    assert bad.returncode == 2 and bad.stderr.strip().startswith("opd: error: config: canary.every must be positive")
