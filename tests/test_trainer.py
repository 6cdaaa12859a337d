"""The synchronous OPD trainer on tiny random models: it learns, resumes exactly, logs, and refuses bad input."""
import json
import os
import signal
import math
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml

from opd.training import trainer
from opd.models.checkpoint import save_checkpoint
from opd.config.files import load_config, parse_overrides
from opd.engines.builtin import Engine
from opd.io.errors import OpdError
from opd.training.learner import collate, completion_logprobs, token_logprobs
from opd.config.runlog import read_metrics
from opd.engines.sampling import SamplingParams
from opd.training.setup import probe_setup, setup as make_run
from opd.training.trainer import run_step, train

from helpers import comparable, config, crash_at, opd


def test_opd_lowers_the_reverse_kl_to_the_teacher(pair, tmp_path):
    cfg = config(pair, steps=40, batch_size=8, optim=dict(lr=1e-2, warmup_steps=0), loss={"name": "full_rkl"})
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["after"]["eval/rkl"] < 0.5 * summary["before"]["eval/rkl"], summary
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(41))  # 40 steps + the final evaluation
    assert rows[0]["mismatch/kl_k3"] < 1e-9  # full-precision engine: no numerics mismatch
    assert rows[0]["stale/version_gap_max"] == 0 and rows[-2]["train/version"] == 40


def test_bf16_rollouts_have_a_small_measured_mismatch(pair, tmp_path):
    train(config(pair, steps=2, plan="kv=bf16 w=bf16"), tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    assert 1e-7 < rows[0]["mismatch/kl_k3"] < 1e-3
    assert 1e-7 < rows[0]["mismatch/kl_exact"] < 1e-3  # both estimates see the same small mismatch


def test_engine_compile_reaches_the_rollout_engines_that_sample_for_training(pair, tmp_path, monkeypatch):
    """Wiring only (test_engine checks the compiled engine's numerics): `engine_compile` compiles the sync
    engine, the guard's fallback engine and the async worker's, and not the admission probe's short-lived ones."""
    import opd.engines.builtin
    compiled = []
    monkeypatch.setattr(opd.engines.builtin, "compiled_forward",
                        lambda model: compiled.append(model) or partial(opd.engines.builtin.next_token_logits, model))
    cfg = config(pair, steps=2, engine=dict(compile=True), guard=dict(every=1, action="fallback", limit=1e-12),
                 plan="kv=int8 kv_scale=calibrate")
    train(cfg, tmp_path / "run", progress=False)
    assert [e["action"] for e in map(json.loads, (tmp_path / "run" / "guard.jsonl").open())][0] == "fallback"
    linears = [type(model.layers[0].mlp.up_proj).__name__ for model in compiled]  # once per engine, not per update
    assert linears == ["Linear", "QuantLinear"]  # the run's engine (the learner itself), then the fallback's copy
    compiled.clear()
    setup, plan = probe_setup(cfg, 4)
    setup.make_engine(plan)
    assert not compiled
    assert make_run(config(pair, engine=dict(compile=True), schedule="async", threads=2)).rollouts.spec.compile


def test_trainer_q_equals_engine_mu_at_full_precision(pair):
    """The learner's recomputation (right-padded, one forward) matches the engine's sampled log-probs."""
    student, _ = pair
    from opd.models.checkpoint import load_checkpoint
    model, tok = load_checkpoint(student)
    rollouts = Engine(model, tok.stop_ids, tok.pad_id).generate([[1, 20, 21], [1, 22, 23, 24, 25]], SamplingParams(12),
                                                              torch.Generator().manual_seed(0))
    batch = collate(rollouts, tok.pad_id)
    with torch.no_grad():
        q = token_logprobs(completion_logprobs(model, batch), batch.tokens)
    assert torch.allclose(q[batch.mask], batch.mu[batch.mask], atol=2e-5)


@pytest.mark.reliability
@pytest.mark.parametrize("crash", [signal.SIGINT, RuntimeError])
def test_resume_reproduces_the_uninterrupted_run(pair, tmp_path, monkeypatch, crash):
    """Ctrl-C during step 4 lets the step finish and saves a checkpoint after it; a crash in step 4 resumes from the
    periodic one at step 3 and redoes step 3. Either way the resumed run logs exactly the uninterrupted one's metrics."""
    cfg = config(pair, plan="kv=fp8_e4m3 kv_scale=calibrate", loss={"name": "sampled_rkl", "correction": "tis"})
    train(cfg, tmp_path / "straight", progress=False)

    def crashing_step(run):
        if run.state.step == 4:
            if crash is RuntimeError:
                raise crash()
            os.kill(os.getpid(), crash)  # the handler marks it; the step goes on
        return run_step(run)
    monkeypatch.setattr(trainer, "run_step", crashing_step)
    with pytest.raises(RuntimeError if crash is RuntimeError else trainer.Interrupted):
        train(cfg, tmp_path / "split", progress=False)
    saved = json.loads((tmp_path / "split" / "checkpoint" / "trainer_state.json").read_text())
    assert saved["step"] == (3 if crash is RuntimeError else 5)
    monkeypatch.setattr(trainer, "run_step", run_step)
    train(cfg, tmp_path / "split", resume=True, progress=False)
    straight, split = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in split] == [r["step"] for r in straight]
    assert comparable(split) == comparable(straight)
    assert straight[3]["mismatch/kl_k3"] > 0  # the fp8 engine's mismatch is there, and was resumed with its scales


@pytest.mark.reliability
def test_gradient_norm_and_clipping_are_exact_on_a_large_gradient():
    """clip_gradients (the trainer's; sharded.py's clip sums the same way) against the float64 norm: exact on a
    24M-element gradient, where float32 accumulation drifts (PyTorch's CPU L2 kernel, pytorch/pytorch#169237); the
    gradients scaled to the cut as clip_grad_norm_ scales them; a non-finite gradient scales nothing."""
    from opd.training.learner import GRAD_PIECE, clip_gradients, sum_of_squares
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (24_000_000, 1000, 3)]
    for p in params:
        p.grad = torch.rand(p.shape) * 1e-3
    exact = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params))
    assert params[0].numel() > GRAD_PIECE  # summed in pieces
    big = params[0].grad
    assert sum_of_squares(big).item() == pytest.approx(big.double().pow(2).sum().item(), rel=1e-12)
    before = [p.grad.clone() for p in params]
    assert clip_gradients(params, max_norm=2 * exact) == pytest.approx(exact, rel=1e-12)  # under the cut: untouched
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
    assert clip_gradients(params, max_norm=exact / 4) == pytest.approx(exact, rel=1e-12)
    assert all(torch.allclose(p.grad, a / 4, rtol=1e-6) for a, p in zip(before, params))
    params[1].grad[0] = float("nan")
    kept = [p.grad.clone() for p in params]
    assert math.isnan(clip_gradients(params, max_norm=1e-9))
    assert all(torch.equal(a[~a.isnan()], p.grad[~p.grad.isnan()]) for a, p in zip(kept, params))


def test_nan_loss_is_skipped_counted_and_stops_the_run(pair, tmp_path):
    """A teacher whose logits are not finite: every step is skipped and counted, max_bad_steps stop the run."""
    student, teacher = pair
    bad = tmp_path / "overflowing_teacher"  # finite weights whose logits overflow (NaN weights are refused at load)
    from opd.models.checkpoint import load_checkpoint
    model, tok = load_checkpoint(teacher)
    with torch.no_grad():
        model.norm.weight[:] = 3e38
    save_checkpoint(bad, model, tok)
    with pytest.raises(OpdError, match="not finite for 3 steps in a row"):
        train(config((student, bad), max_bad_steps=3), tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    assert [r["train/skipped_steps"] for r in rows] == [1, 2, 3] and rows[-1]["train/version"] == 0


def test_cli_train_with_yaml_config_logs_and_tensorboard(pair, tmp_path):
    student, teacher = pair
    cfg_file = tmp_path / "opd.yaml"
    cfg_file.write_text(yaml.safe_dump({"student": str(student), "teacher": str(teacher), "task": "add", "steps": 4,
                                        "batch_size": 4, "eval": {"examples": 8}, "threads": 1,
                                        "loss": {"name": "fkl"}}))
    result = opd("train", "--config", cfg_file, "--set", "optim.lr=3e-3", "--run-dir", tmp_path / "run", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "before" in result.stdout and "after" in result.stdout
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 3e-3 and saved["loss"]["name"] == "fkl" and saved["steps"] == 4
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and 0 <= summary["after"]["eval/accuracy"] <= 1
    rows = read_metrics(tmp_path / "run")
    assert all(math.isfinite(r["loss/value"]) for r in rows[:4])
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").is_file()
    from tensorboardX.proto import event_pb2
    events = list((tmp_path / "run" / "tb").glob("events.*"))
    tags = {value.tag for event in _read_events(events[0], event_pb2) for value in event.summary.value}
    assert {"loss/value", "mismatch/kl_k3", "eval/accuracy"} <= tags


def _read_events(path, event_pb2):
    """TFRecord framing: u64 length, u32 crc, payload, u32 crc."""
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        n = int.from_bytes(data[i:i + 8], "little")
        event = event_pb2.Event()
        event.ParseFromString(data[i + 12:i + 12 + n])
        out.append(event)
        i += 12 + n + 4
    return out


def test_run_directory_guards(pair, tmp_path):
    run = tmp_path / "run"
    train(config(pair, steps=2), run, progress=False)
    with pytest.raises(OpdError, match="already holds a run"):
        train(config(pair, steps=2), run, progress=False)
    with pytest.raises(OpdError, match=r"different config \(optim.lr\)"):
        train(config(pair, steps=2, optim=dict(lr=0.5)), run, resume=True, progress=False)
    train(config(pair, steps=2, optim=dict(lr=0.5)), run, overwrite=True, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(OpdError, match="holds no opd run"):
        train(config(pair), tmp_path / "other", overwrite=True, progress=False)
    with pytest.raises(OpdError, match="nothing to resume"):
        train(config(pair), tmp_path / "new", resume=True, progress=False)


@pytest.mark.parametrize("text,message", [
    ("lrr: 0.1\n", "unknown config key 'lrr'.*did you mean optim.lr"),
        ("lr: 0.1\n", "config key 'lr' is now 'optim.lr'.*--set optim.lr=0.1"),
        ("optim: {lr: 0.1, warmup: 2}\n", "unknown config key 'optim.warmup'.*did you mean optim.warmup_steps"),
        ("async: 2\n", "async must be a mapping"),
    ("loss: {nme: fkl}\n", "unknown config key 'loss.nme'"),
    ("steps: ten\n", "steps must be an integer"),
    ("loss: {name: rkl}\n", "unknown loss 'rkl'"),
    ("- 1\n", "expected a mapping"),
    ("steps: [\n", "not valid YAML"),
])
def test_bad_config_files(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(OpdError, match=message):
        load_config(path)


def test_overrides_parse_as_yaml_values():
    assert parse_overrides(["optim.lr=0.0003", "loss.name=fkl", "exact_kl=false", "plan=kv=fp8_e4m3"]) == \
        {"optim": {"lr": 3e-4}, "loss": {"name": "fkl"}, "exact_kl": False, "plan": "kv=fp8_e4m3"}
    with pytest.raises(OpdError, match="expected key=value"):
        parse_overrides(["lr"])


def test_exact_kl_off_leaves_the_estimates(pair, tmp_path):
    train(config(pair, steps=1, plan="kv=bf16", exact_kl=False), tmp_path / "run", progress=False)
    row = read_metrics(tmp_path / "run")[0]
    assert "mismatch/kl_exact" not in row and row["mismatch/kl_k3"] > 0


def test_eval_without_greedy_decoding_keeps_the_sampled_quality(pair, tmp_path):
    summary = train(config(pair, steps=1, eval=dict(every=0, examples=4, greedy=False)), tmp_path / "run",
                    progress=False)
    for row in (summary["before"], summary["after"]):
        assert row["eval/rkl"] > 0 and row["eval/entropy"] > 0 and row["eval/n"] == 4
        assert "eval/accuracy" not in row and "eval/truncated" not in row


def test_fixed_eval_contexts_are_the_first_evaluations_samples_shared_across_seeds_and_resumes(pair, tmp_path):
    """eval.contexts fixed: the first evaluation samples the held-out completions once (eval_contexts.json) and every
    evaluation scores those contexts; at the start the fixed and sampled numbers are the same samples' (equal KL), the
    final evaluation samples anew too; runs of two training seeds with one eval.seed score the same contexts from the
    same start (equal `before`); a run cut at step 3 and resumed evaluates as the straight run did."""
    fixed = dict(every=2, examples=4, greedy=False, contexts="fixed", seed=7)
    runs = {}
    for name, seed in (("a", 0), ("b", 1)):
        runs[name] = train(config(pair, steps=4, seed=seed, eval=fixed), tmp_path / name, progress=False)
    a, b = runs["a"], runs["b"]
    assert a["before"]["eval/rkl"] == pytest.approx(a["before"]["eval/sampled_rkl"], rel=1e-9)
    assert a["before"] == {**b["before"], "time/eval": a["before"]["time/eval"]}
    assert (tmp_path / "a" / "eval_contexts.json").read_text() == (tmp_path / "b" / "eval_contexts.json").read_text()
    assert "eval/sampled_rkl" in a["after"] and "eval/sampled_rkl" not in read_metrics(tmp_path / "a")[2]
    assert a["after"]["eval/rkl"] != a["before"]["eval/rkl"] and a["after"]["eval/rkl"] != b["after"]["eval/rkl"]
    with pytest.raises(RuntimeError):
        train(config(pair, steps=4, eval=fixed), tmp_path / "split", progress=False, on_step=crash_at(2))
    train(config(pair, steps=4, eval=fixed), tmp_path / "split", resume=True, progress=False)
    assert comparable(read_metrics(tmp_path / "split")) == comparable(read_metrics(tmp_path / "a"))
    with pytest.raises(OpdError, match="eval.contexts"):
        config(pair, eval=dict(contexts="random"))
    # another run's contexts are taken as they are (no sampling, no final resampling here), unless they are not this
    # run's held-out prompts
    given = train(config(pair, steps=4, eval=fixed | {"resample_final": False}), tmp_path / "given", progress=False,
                  contexts=tmp_path / "a" / "eval_contexts.json")
    assert "eval/sampled_rkl" not in given["before"] and "eval/sampled_rkl" not in given["after"]
    assert given["after"]["eval/rkl"] == a["after"]["eval/rkl"]
    other = json.loads((tmp_path / "a" / "eval_contexts.json").read_text())
    other["contexts"][0]["prompt_ids"][-1] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(OpdError, match="not this run's held-out prompts"):
        train(config(pair, steps=1, eval=fixed), tmp_path / "refused", progress=False, contexts=tmp_path / "other.json")
    # a resumed run whose contexts went missing is refused, not evaluated on new ones
    with pytest.raises(RuntimeError):
        train(config(pair, steps=4, eval=fixed), tmp_path / "lost", progress=False, on_step=crash_at(2))
    (tmp_path / "lost" / "eval_contexts.json").unlink()
    with pytest.raises(OpdError, match="eval_contexts.json is missing"):
        train(config(pair, steps=4, eval=fixed), tmp_path / "lost", resume=True, progress=False)


def test_eval_samples_draws_that_many_completions_a_prompt_in_one_stream(pair, tmp_path):
    """eval.samples k: the sampled evaluation is sampled_quality over each held-out prompt k times in a row (one
    generator stream, the eval seed), and under contexts fixed the kept contexts are those k x prompts samples."""
    from opd.training.evaluate import sampled_quality
    from opd.models.devices import autocast_dtype
    cfg = config(pair, steps=1, eval=dict(every=0, examples=4, greedy=False, contexts="fixed", seed=7, samples=2))
    summary = train(cfg, tmp_path / "run", progress=False)
    run = make_run(cfg)
    doubled = [ex for ex in run.prompts.held_out for _ in range(2)]
    want = sampled_quality(run.student, run.teacher.trainer, run.tok, doubled, cfg.new_tokens, 7, run.params,
                           autocast=autocast_dtype(cfg.compute.dtype), micro_batch_size=cfg.compute.micro_batch_size)
    assert summary["before"]["eval/sampled_rkl"] == pytest.approx(want["eval/rkl"], rel=1e-6)
    kept = json.loads((tmp_path / "run" / "eval_contexts.json").read_text())["contexts"]
    assert [c["prompt_ids"] for c in kept] == [run.tok.encode_prompt(ex.prompt) for ex in doubled]
    once = train(config(pair, steps=1, eval=dict(every=0, examples=4, greedy=False, seed=7)), tmp_path / "once",
                 progress=False)
    assert once["before"]["eval/rkl"] != pytest.approx(summary["before"]["eval/rkl"], rel=1e-6)
    with pytest.raises(OpdError, match="eval.samples must be positive"):
        config(pair, eval=dict(samples=0))


def test_the_readme_yaml_example_is_a_valid_config(tmp_path):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "example.yaml"
    path.write_text(block)
    cfg = load_config(path)
    assert cfg.family == "qwen3" and cfg.loss.correction == "tis" and cfg.plan == "kv=fp8_e4m3"


@pytest.mark.parametrize("name", ["topk_fkl", "topk_rkl_tail"])
def test_a_top_k_teacher_loss_trains(pair, tmp_path, name):
    """The losses that need only the teacher's top-k log-probs (a served teacher's answer) bring the student towards
    the teacher as the full-vocabulary ones do (k = 8 of 100 tokens here)."""
    cfg = config(pair, steps=30, batch_size=8, optim=dict(lr=1e-2, warmup_steps=0), loss={"name": name, "topk": 8})
    summary = train(cfg, tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    assert rows[-2]["loss/value"] < rows[0]["loss/value"]
    assert summary["after"]["eval/rkl"] < summary["before"]["eval/rkl"]


def test_truncated_sampling_is_reported_apart_from_the_numerics(pair, tmp_path):
    """A float32 engine has no numerics mismatch; top-p 0.7 still moves mu by -log(kept mass): that goes to
    sampling/*, not into mismatch/* (which compares the untruncated log-probs with q)."""
    train(config(pair, steps=2, sampling=dict(top_p=0.7)), tmp_path / "run", progress=False)
    row = read_metrics(tmp_path / "run")[0]
    assert row["mismatch/kl_k3"] < 1e-9 and row["mismatch/kl_exact"] < 1e-6 and row["opd/nsr"] < 1e-5  # float noise
    assert row["sampling/kl_k3"] > 1e-3 and 0 < row["sampling/kept_mass"] < 1 and row["sampling/shift_mean"] > 0


def test_a_checkpoints_sampling_defaults_do_not_reach_training(pair, tmp_path, capfd):
    """generation_config.json's temperature/top-k/top-p are the publisher's inference defaults: training samples
    the student's own distribution unless the config says otherwise (the note names what was left unused)."""
    import shutil
    student = tmp_path / "student"
    shutil.copytree(pair[0], student)
    (student / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    run = make_run(config((student, pair[1])))
    assert (run.cfg.sampling.temperature, run.cfg.sampling.top_k, run.cfg.sampling.top_p) == (1.0, 0, 1.0)
    assert "generation_config.json sets temperature 0.7, top_k 20, top_p 0.8: not used for training" in \
        capfd.readouterr().err
    run = make_run(config((student, pair[1]), sampling=dict(top_k=5)))
    assert (run.cfg.sampling.temperature, run.cfg.sampling.top_k, run.cfg.sampling.top_p) == (1.0, 5, 1.0)


def test_vllm_with_truncated_sampling_is_refused(pair):
    with pytest.raises(OpdError, match="engine vllm with sampling.top_k 0 / top_p 0.9.*use engine builtin"):
        config(pair, engine=dict(name="vllm"), sampling=dict(top_p=0.9))


def test_the_per_parameter_adamw_step_equals_the_multi_tensor_one(pair, tmp_path, monkeypatch):
    """setup uses AdamW(foreach=False) for its memory; the runs it gives are the multi-tensor step's, to the bit."""
    rows, real, made = {}, torch.optim.AdamW, []
    for foreach in (True, False):
        def adamw(*args, forced=foreach, **kwargs):
            made.append(real(*args, **{**kwargs, "foreach": forced}))
            return made[-1]
        monkeypatch.setattr(torch.optim, "AdamW", adamw)
        train(config(pair, steps=4, plan="kv=fp8_e4m3", optim=dict(lr=1e-2)), tmp_path / str(foreach), progress=False)
        rows[foreach] = comparable(read_metrics(tmp_path / str(foreach)))
    assert [opt.defaults["foreach"] for opt in made] == [True, False]
    assert rows[True] == rows[False] and len(rows[True]) == 5


def test_the_sharded_learner_on_one_rank_trains_what_the_plain_learner_trains(pair, tmp_path):
    """compute.sharded on one rank (training/sharded.py's path: FSDP2 over the blocks, a process group of one over a
    file store, no socket): the same losses, gradient norms and weights as the plain learner within float rounding;
    its checkpoint is the plain one's format (the 2-rank oracles are tests/test_sharded.py's, in a network
    namespace)."""
    from safetensors.torch import load_file
    plain, sharded = config(pair, steps=3), config(pair, steps=3, compute=dict(sharded=True))
    train(plain, tmp_path / "plain", progress=False)
    train(sharded, tmp_path / "sharded", progress=False)
    a, b = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "sharded")
    for x, y in zip(a[:3], b[:3]):
        for key in ("loss/value", "loss/rkl_sampled", "train/grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-5), key
    wa, wb = (load_file(str(tmp_path / r / "checkpoint" / "model.safetensors")) for r in ("plain", "sharded"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


def test_teacher_eval_contexts_are_the_teachers_samples_scored_as_fixed_contexts(pair, tmp_path):
    """eval.contexts teacher: the first evaluation samples the TEACHER once on the held-out prompts (the eval seed's
    stream, as sample_batches draws it with the teacher's model), keeps them (eval_contexts.json), and every evaluation
    scores the student on them (context_quality on the kept contexts: the oracle); the student's own samples are
    scored at the first and the final evaluation (eval/sampled_*: the sampled mode's numbers); a run cut at step 2 and
    resumed evaluates as the straight run did."""
    from opd.models.devices import autocast_dtype
    from opd.training.evaluate import context_quality, load_contexts, sample_batches
    ev = dict(every=2, examples=4, greedy=False, contexts="teacher", seed=7)
    cfg = config(pair, steps=4, eval=ev)
    summary = train(cfg, tmp_path / "t", progress=False)
    run = make_run(cfg)
    autocast = autocast_dtype(cfg.compute.dtype)
    drawn = [r for _, batch in sample_batches(run.teacher.trainer.model, run.tok, run.prompts.held_out, run.params, 7,
                                              autocast=autocast) for r in batch]
    kept = load_contexts(tmp_path / "t" / "eval_contexts.json")
    assert [(r.prompt_ids, r.completion_ids) for r in kept] == [(r.prompt_ids, r.completion_ids) for r in drawn]
    want = context_quality(run.student, run.teacher.trainer, kept, run.tok.pad_id, run.params.temperature or 1.0,
                           micro_batch_size=cfg.compute.micro_batch_size, autocast=autocast)
    assert summary["before"]["eval/rkl"] == pytest.approx(want["eval/rkl"], rel=1e-6)
    assert summary["before"]["eval/entropy"] == pytest.approx(want["eval/entropy"], rel=1e-6)
    fixed = train(config(pair, steps=4, eval=ev | {"contexts": "fixed"}), tmp_path / "f", progress=False)
    own = load_contexts(tmp_path / "f" / "eval_contexts.json")  # the student's samples: other contexts
    assert [r.completion_ids for r in own] != [r.completion_ids for r in kept]
    assert summary["before"]["eval/sampled_rkl"] == pytest.approx(fixed["before"]["eval/rkl"], rel=1e-9)
    assert summary["before"]["eval/rkl"] != pytest.approx(fixed["before"]["eval/rkl"], rel=1e-6)
    assert "eval/sampled_rkl" in summary["after"] and summary["after"]["eval/rkl"] != summary["before"]["eval/rkl"]
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "split", progress=False, on_step=crash_at(2))
    train(cfg, tmp_path / "split", resume=True, progress=False)
    assert comparable(read_metrics(tmp_path / "split")) == comparable(read_metrics(tmp_path / "t"))
