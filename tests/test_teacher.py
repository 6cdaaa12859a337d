"""The teacher's side (teacher.py): engines that score for the teacher against the trainer's teacher (the oracle),
top-k teachers against the full-vocabulary losses, the teacher-side metrics against hand computation, the config's
refusals."""
import math

import pytest
import torch

from opd.training.chunked import Source, output_layer
from opd.io.errors import OpdError
from opd.training.learner import Scoring, completion_hidden, completion_logprobs, score_batch
from opd.training.losses import opd_loss
from opd.health.metrics import teacher_mismatch_metrics
from opd.numerics.plan import Plan
from opd.config.runlog import read_metrics
from opd.engines.sampling import SamplingParams
from opd.config.sections import LossConfig
from opd.training.teacher import (BuiltinTeacher, CheckedTeacher, LocalTeacher, Sparse, TopK, TopKTeacher, check_rows, keep_topk,
                         make_teacher, sequences)
from opd.training.trainer import train

from helpers import assert_one_line_error, batch_of, config, opd, tiny


def test_sequences_give_back_the_prompts_and_completions():
    model = tiny(0)
    batch, engine = batch_of(model)
    prompts, completions = sequences(batch)
    assert [len(c) for c in completions] == batch.mask.sum(1).tolist()
    assert all(p[0] == 1 for p in prompts)
    rollouts = engine.generate(prompts, SamplingParams(7, temperature=1.0), 3)
    assert [r.completion_ids for r in rollouts] == completions  # the same seed samples the same tokens


@pytest.mark.parametrize("plan,same", [("", True), ("kv=fp8_e4m3", True), ("forward=bf16 kv=bf16", True),
                                       ("w=fp8_block", True), ("w=fp8", False)])
def test_prefill_scoring_against_decoding_and_the_trainer(plan, same):
    """The built-in engine's prefill scoring (a teacher server's prompt log-probs) against the same engine decoding
    the tokens one at a time (teacher_force): equal up to the order of float sums (1e-4) under plans whose numbers do
    not depend on how many tokens one call holds, FP8 KV included (both read the stored FP8 keys). Per-tensor FP8
    activations (w=fp8: one dynamic scale per call) do: a prefill's scale covers the whole batch's tokens, a decode
    step's only that step's, so the two differ (a decode-vs-prefill gap of the emulated engine itself). With the
    full-precision plan prefill equals the trainer's forward."""
    model = tiny(1).float()
    batch, _ = batch_of(tiny(0))
    prompts, completions = sequences(batch)
    engine = BuiltinTeacher(LocalTeacher(model), model, Plan.parse(plan, 2), pad_id=0).engine
    prefill = engine.prefill_hidden(prompts, completions)
    decode = engine.teacher_force(prompts, completions, SamplingParams(7), return_hidden=True)
    head = output_layer(engine.model)
    assert [h.shape for h in prefill] == [(len(c), model.cfg.hidden_size) for c in completions]
    gap = torch.cat([(head(h) - head(r.hidden)).abs().flatten() for h, r in zip(prefill, decode)])
    assert (gap.max() < 1e-4) if same else (gap.mean() > 1e-3), gap.max()
    if not plan:
        trainer = completion_hidden(model, batch)
        assert torch.allclose(torch.cat(prefill), trainer, atol=1e-5)


def test_fp8_teacher_plan_moves_the_teacher_and_the_full_plan_does_not():
    """The builtin teacher engine at the full-precision plan scores what the trainer's teacher scores (1e-5); under
    an FP8 KV plan its log-probs move by a measurable amount, and the teacher-side metrics see it."""
    teacher, student = tiny(1).float(), tiny(0).float()
    batch, _ = batch_of(tiny(0))
    trainer = score_batch(student, batch, LocalTeacher(teacher))
    for plan, moved in (("", False), ("kv=fp8_e5m2", True)):
        engine = CheckedTeacher(BuiltinTeacher(LocalTeacher(teacher), teacher, Plan.parse(plan, 2), pad_id=0), 1.0)
        check = engine.begin(len(batch.versions))
        scores = score_batch(student, batch, engine, Scoring(micro_batch_size=2))
        gap = (scores.teacher - trainer.teacher)[batch.mask].abs()
        assert (gap.mean() > 1e-3) == moved, (plan, gap.mean())
        assert gap.max() < (1.0 if moved else 1e-5)
        assert torch.allclose(scores.rkl, trainer.rkl, atol=1e-5) != moved
        t, kl_exact = check.result()
        assert torch.allclose(t, trainer.teacher, atol=1e-6)  # the trainer's teacher on the checked rows
        m = teacher_mismatch_metrics(scores.teacher, t, scores.pi, batch.mask, kl_exact)
        assert (m["teacher_mismatch/kl_exact"] > 1e-5) == moved and m["teacher_mismatch/kl_exact"] > -1e-6  # float32 sums


@pytest.mark.parametrize("name", ["topk_fkl", "topk_rkl_tail", "sampled_rkl"])
@pytest.mark.parametrize("k", [1, 5, 40])
def test_a_topk_teacher_drives_its_losses_exactly(name, k):
    """A teacher cut to its top k (and the sampled token) gives the top-k losses the same value and gradient as the
    whole teacher does (they read only its top k; the tail bucket from the k log-probs), and the sampled-token loss
    the same (it reads only the sampled token's): chunked, against the whole-batch opd_loss in float64."""
    student, teacher = tiny(0), tiny(1)
    batch, _ = batch_of(student)
    loss = LossConfig(name=name, topk=k)
    T = completion_logprobs(teacher, batch)
    s = completion_logprobs(student, batch)
    want, _ = opd_loss(loss, s, T, batch.tokens, batch.mu.double(), batch.mask)
    want.backward()
    want_grad = student.lm_head.weight.grad.clone()
    student.zero_grad()
    engine = TopKTeacher(LocalTeacher(teacher), k)
    got = score_batch(student, batch, engine, Scoring(loss, chunk_tokens=7), backward=True)
    assert math.isclose(got.loss, want.item(), rel_tol=1e-9, abs_tol=1e-12)
    assert torch.allclose(student.lm_head.weight.grad, want_grad, rtol=1e-7, atol=1e-12)


def test_keep_topk_and_the_sparse_rows():
    logp = torch.tensor([[-0.1, -3.0, -2.5, -5.0], [-4.0, -0.05, -3.5, -6.0]]).log_softmax(-1)
    cut, tail = keep_topk(logp, torch.tensor([3, 1]), 2)
    assert torch.equal(torch.isfinite(cut), torch.tensor([[True, False, True, True], [False, True, True, False]]))
    assert torch.equal(cut[torch.isfinite(cut)], logp[torch.isfinite(cut)])
    assert torch.allclose(tail, 1 - logp.exp().topk(2).values.sum(-1))
    sparse = Sparse(torch.tensor([[3, 0, 2], [1, 1, 2]]), torch.stack([logp[0, [3, 0, 2]], logp[1, [1, 1, 2]]]), 4, tail)
    assert torch.equal(sparse.rows(slice(0, 2), torch.device("cpu")), cut)
    assert TopK(Source(logp, lambda h: h), torch.tensor([3, 1]), 2).rows(slice(1, 2), torch.device("cpu")).shape == (1, 4)


def test_teacher_mismatch_metrics_by_hand():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    engine = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, 9.0, 9.0]], dtype=torch.float64)
    trainer = torch.tensor([[-1.2, -2.0, 0.0], [-0.1, 0.0, 0.0]], dtype=torch.float64)
    learner = torch.tensor([[-1.1, -1.0, 0.0], [-0.3, 0.0, 0.0]], dtype=torch.float64)
    m = teacher_mismatch_metrics(engine, trainer, learner, mask)
    d = torch.tensor([-0.2, 0.0, 0.4], dtype=torch.float64)
    assert math.isclose(m["teacher_mismatch/kl_k1"], (-d).mean().item())
    assert math.isclose(m["teacher_mismatch/kl_k3"], (d.exp() - d - 1).mean().item())
    assert math.isclose(m["teacher_mismatch/abs_dlogp_mean"], 0.2, rel_tol=1e-6)
    assert math.isclose(m["teacher_mismatch/abs_dlogp_max"], 0.4, rel_tol=1e-6)
    # A_e = [0.1, -1.0, -0.2], A = [-0.1, -1.0, 0.2]: two of three flip; nsr = 0.2 / mean(0.1, 1.0, 0.2)
    assert math.isclose(m["teacher_mismatch/adv_sign_flip"], 2 / 3)
    assert math.isclose(m["teacher_mismatch/nsr"], 0.2 / (1.3 / 3), rel_tol=1e-6)
    assert teacher_mismatch_metrics(engine, engine, learner, mask)["teacher_mismatch/nsr"] == 0


def test_check_rows():
    assert [check_rows(8, f) for f in (0, 0.1, 0.25, 0.5, 1.0)] == [0, 1, 2, 4, 8]


def test_training_with_a_builtin_teacher_engine_logs_the_teacher_side(pair, tmp_path):
    """A run whose teacher is scored by the built-in engine under an FP8 KV plan trains and logs teacher_mismatch/*
    every step; with teacher.check 0 the trainer's teacher never runs and those metrics are absent (the tail mass of a
    top-k teacher stays: the engine alone gives it)."""
    cfg = config(pair, steps=3, teacher=dict(engine="builtin", plan="kv=fp8_e4m3", check=0.5))
    train(cfg, tmp_path / "a", progress=False)
    rows = read_metrics(tmp_path / "a")[:-1]
    assert len(rows) == 3
    for row in rows:
        assert row["teacher_mismatch/kl_exact"] > 0 and row["teacher_mismatch/abs_dlogp_mean"] > 0
        assert 0 <= row["teacher_mismatch/adv_sign_flip"] <= 1 and "teacher_mismatch/tail_mass" not in row
    cfg = config(pair, steps=2, teacher=dict(engine="builtin", plan="kv=bf16", topk=4, check=0),
                 loss=dict(name="topk_fkl", topk=4))
    train(cfg, tmp_path / "b", progress=False)
    for row in read_metrics(tmp_path / "b")[:-1]:
        assert not any(k.startswith("teacher_mismatch/") and k != "teacher_mismatch/tail_mass" for k in row)
        assert 0 < row["teacher_mismatch/tail_mass"] < 1


def test_the_trainer_teacher_at_k_equal_v_is_the_trainer_path(pair, tmp_path):
    """teacher.topk = V cuts nothing: the run is the plain run, metric for metric (bar the teacher-side ones)."""
    train(config(pair, steps=2, loss=dict(name="topk_fkl", topk=100)), tmp_path / "a", progress=False)
    train(config(pair, steps=2, teacher=dict(topk=100), loss=dict(name="topk_fkl", topk=100)), tmp_path / "b",
          progress=False)
    plain, cut = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    strip = lambda row: {k: v for k, v in row.items() if not k.startswith(("time", "throughput", "teacher_"))}  # noqa
    assert [strip(r) for r in plain] == [strip(r) for r in cut]
    assert cut[0]["teacher_mismatch/abs_dlogp_max"] == 0


@pytest.mark.parametrize("values,message", [
    (dict(teacher=dict(topk=8), loss=dict(name="full_rkl")), "needs the teacher's whole distribution"),
    (dict(teacher=dict(topk=8), loss=dict(name="topk_fkl", topk=16)), "more than the teacher returns"),
    (dict(teacher=dict(topk=8), loss=dict(name="topk_rkl", topk=4)), "topk_support=teacher"),
    (dict(teacher=dict(plan="kv=fp8_e4m3")), "needs an inference engine for the teacher"),
    (dict(teacher=dict(engine="sglang")), "unknown teacher.engine"),
    (dict(teacher=dict(topk=-1)), "teacher.topk must be >= 0"),
    (dict(teacher=dict(check=1.5)), "teacher.check must be in [0, 1]"),
    (dict(teacher_topk=8), "config key 'teacher_topk' is now 'teacher.topk'"),
])
def test_teacher_side_settings_are_checked(pair, values, message):
    with pytest.raises(OpdError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config(pair, **values)


def test_a_vllm_teacher_is_not_asked_for_whole_rows_of_a_large_vocabulary(tmp_path):
    """A 150k vocabulary's whole rows from vLLM would be V log-probs per position: refused before vLLM starts."""
    big = tiny(0, vocab=5000).float()
    cfg = config((tmp_path, tmp_path), teacher=dict(engine="vllm"))
    with pytest.raises(OpdError, match="all 5000 log-probs"):
        make_teacher(cfg.teacher, LocalTeacher(big), big, 0, tmp_path)


def test_cli_refuses_a_topk_teacher_under_a_full_loss(pair, tmp_path):
    result = opd("train", "--set", f"student={pair[0]}", "--set", f"teacher={pair[1]}", "--run-dir", str(tmp_path / "r"),
                 "--set", "teacher.topk=8", "--set", "loss.name=full_rkl")
    assert_one_line_error(result, "teacher.topk=8", "loss.name sampled_rkl")
    assert not (tmp_path / "r").exists()


# ---- admission and guard on the teacher side -------------------------------------------------------------------

THRESHOLDS = {"metric": "nsr", "classes": {"full": {"max": 0.5, "reject": 0.8, "knee": True}},
              "teacher": {"metric": "teacher_nsr", "classes": {"full": {"max": 0.1, "reject": 0.2, "knee": True}}}}


@pytest.mark.parametrize("teacher_nsr,verdict", [(0.05, "ADMIT"), (0.15, "UNCERTAIN"), (0.3, "REJECT"),
                                                 (math.nan, "REJECT")])
def test_decide_judges_the_teacher_side_by_its_own_limit(teacher_nsr, verdict):
    from opd.health.rules import decide_numbers
    numbers = {"nsr": 0.01, "teacher_nsr": teacher_nsr, "teacher_kl_k3": 0.002}
    decision = decide_numbers(numbers, THRESHOLDS, "full")
    assert decision.verdict == verdict and decision.value == 0.01  # the student side's value stays the headline
    assert any("teacher" in r for r in decision.reasons)
    assert decide_numbers({"nsr": 0.01}, THRESHOLDS, "full").verdict == "ADMIT"  # no teacher engine: no teacher verdict


def test_decide_without_teacher_thresholds_uses_the_student_side_limit_and_says_so():
    from opd.health.rules import decide_numbers
    student_only = {"metric": "nsr", "classes": THRESHOLDS["classes"]}
    decision = decide_numbers({"nsr": 0.01, "teacher_nsr": 0.3}, student_only, "full")
    assert decision.verdict == "ADMIT" and "no teacher-side calibration" in " ".join(decision.reasons)
    assert decide_numbers({"nsr": 0.01, "teacher_nsr": 0.3}, None, "full", limit=0.2).verdict == "REJECT"  # user limit


def test_calibrate_keeps_the_two_sides_apart():
    """Teacher-side rows (their rollouts at the floor) calibrate the teacher entry only; the student side's cut is
    the one the other rows give."""
    from opd.health.thresholds import calibrate
    def row(nsr, teacher_nsr, degraded, **cfg):
        probe = {"nsr": nsr, "floor_nsr": 0.01} | ({"teacher_nsr": teacher_nsr} if teacher_nsr is not None else {})
        return {"class": "full", "staleness": 0, "probe": probe, "degraded": degraded,
                "config": {"optim": {"lr": 1e-3}} | cfg}
    student = [row(0.01, None, False), row(0.1, None, False), row(0.4, None, True), row(0.8, None, True)]
    builtin = dict(engine="builtin")
    teacher = [row(0.01, 0.02, False, teacher=builtin), row(0.01, 0.05, False, teacher=builtin),
               row(0.01, 0.3, True, teacher=builtin), row(0.01, 0.0, True, teacher_topk=1)]  # (stored before 12-03)
    both = calibrate(student + teacher)
    assert both["classes"] == calibrate(student)["classes"]
    cut = both["teacher"]["classes"]["full"]
    assert 0.05 < cut["max"] < 0.3 and cut["runs"] == 3  # the top-k row (teacher_nsr 0, degraded) is left out
    assert "teacher" not in calibrate(student)


def test_a_bad_teacher_entry_in_a_thresholds_file_is_one_line(pair, tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text('{"metric": "nsr", "classes": {"full": {"max": 0.5}}, "teacher": {"classes": {"full": {"max": -1}}}}')
    result = opd("admit", "--set", f"student={pair[0]}", "--set", f"teacher={pair[1]}", "--set", "task=add",
                 "--thresholds", str(bad))
    assert_one_line_error(result, "teacher-side limits are invalid")


def test_admit_names_teacher_side_reasons(pair):
    """`opd admit` probes the teacher engine as well: a noisy teacher plan is rejected for its teacher side (the
    student's rollouts are at full precision)."""
    common = ("--set", f"student={pair[0]}", "--set", f"teacher={pair[1]}", "--set", "task=add", "--set", "plan=",
              "--set", "teacher.engine=builtin")
    ok = opd("admit", *common, "--set", "teacher.plan=kv=bf16", "--limit", "0.5")
    assert ok.returncode == 0 and "teacher engine: teacher_nsr" in ok.stdout, ok.stdout + ok.stderr
    bad = opd("admit", *common, "--set", "teacher.plan=noise=0.5", "--limit", "0.05")
    assert bad.returncode == 1 and "teacher_nsr" in bad.stdout and bad.stdout.startswith("REJECT"), bad.stdout
    assert "the rollout plan passes; the teacher engine does not" in bad.stdout  # no rollout plan is proposed


@pytest.mark.parametrize("action", ["fallback", "stop"])
def test_the_guard_watches_the_teacher_side(pair, tmp_path, action):
    """A teacher engine far from the trainer's teacher: the guard logs a teacher-side event every check; fallback
    cannot change a teacher's numbers, so it warns and training goes on; stop stops the run with one line."""
    cfg = config(pair, steps=4, teacher=dict(engine="builtin", plan="noise=0.5", check=0.5),
                 guard=dict(every=2, action=action, limit=1e-3))
    if action == "stop":
        with pytest.raises(OpdError, match="teacher engine's mismatch"):
            train(cfg, tmp_path / "r", progress=False)
    else:
        train(cfg, tmp_path / "r", progress=False)
    from opd.config.runlog import read_guard_events
    events = read_guard_events(tmp_path / "r")
    assert events and all(e["side"] == "teacher" and e["action"] == ("stop" if action == "stop" else "warn")
                          for e in events)
    if action == "fallback":
        rows = read_metrics(tmp_path / "r")
        assert len(rows) == 5 and [r.get("guard/teacher_triggered") for r in rows[:4]] == [None, 1.0, None, 1.0]


@pytest.mark.reliability
def test_resume_with_a_calibrated_teacher_engine_is_exact(pair, tmp_path, monkeypatch):
    """A crash in step 4 of a run whose teacher engine calibrates its FP8 KV scales on its first batch: the resumed
    run loads those scales with the checkpoint and logs exactly the uninterrupted run's metrics (without them the
    first batch after the resume would calibrate other scales)."""
    import opd.training.trainer as trainer
    from helpers import comparable
    cfg = config(pair, teacher=dict(engine="builtin", plan="kv=fp8_e4m3 kv_scale=calibrate", check=0.5))
    train(cfg, tmp_path / "straight", progress=False)
    step = trainer.run_step

    def crashing_step(run):
        if run.state.step == 4:
            raise RuntimeError("simulated crash")
        return step(run)
    monkeypatch.setattr(trainer, "run_step", crashing_step)
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "split", progress=False)
    monkeypatch.setattr(trainer, "run_step", step)
    train(cfg, tmp_path / "split", resume=True, progress=False)
    straight, split = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert comparable(split) == comparable(straight)
    assert straight[4]["teacher_mismatch/kl_exact"] > 0


def test_async_at_staleness_0_with_a_teacher_engine_is_the_sync_run(pair, tmp_path):
    from helpers import same_as_sync
    common = dict(steps=3, teacher=dict(engine="builtin", plan="kv=fp8_e5m2", check=1.0), threads=2,
                  save_every=0)
    train(config(pair, **common), tmp_path / "sync", progress=False)
    train(config(pair, schedule="async", async_=dict(max_staleness=0, worker_threads=1), **common),
          tmp_path / "async", progress=False)
    sync, asynchronous = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "async")
    assert same_as_sync(asynchronous, sync) and sync[0]["teacher_mismatch/abs_dlogp_mean"] > 0


def test_teacher_study_benchmark_quick_mode():
    """The stored teacher study (studies/teacher_study.py --quick): the numbers docs/teacher.md quotes."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).parents[1] / "studies" / "teacher_study.py"
    out = subprocess.run([sys.executable, script, "--quick"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = dict(kv.split("=", 1) for kv in out.stdout.strip().splitlines()[-1].split()[1:])
    assert result["teacher_runs"] == "28" and result["teacher_admission_leave_source_out"] == "1.000"
    assert result["tolerance_ratio_llama_full_rkl"] == "2.79" and result["tolerance_ratio_qwen3_sampled_pi"] == "0.0854"
