"""Devices and dtypes: every device test runs on the CPU and, where PyTorch sees a GPU, on CUDA (skipped otherwise);
the emulation without its CPU-only shadows (what CUDA runs) gives the same numbers; bf16 compute stays within bf16's
error of float32; loading puts a checkpoint on its device and dtype without a second copy."""
import pytest
import torch

from opd.models.checkpoint import load_checkpoint, save_checkpoint
from opd.engines.builtin import Engine
from opd.training.learner import Scoring, collate, completion_logprobs, score_batch
from opd.training.losses import LossConfig, opd_loss
from opd.engines.naive import naive_sample
from opd.config.runlog import read_metrics
from opd.engines.sampling import SamplingParams
from opd.training.teacher import LocalTeacher
from opd.models.tokenizer import TextTokenizer
from opd.training.trainer import train

from helpers import batch_of, config, grads, tiny

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="PyTorch sees no CUDA GPU here"))]
PLANS = ["kv=fp8_e4m3 w=bf16", "kv=int4 kv_group=4 w=fp8", "kv=int8 kv_scale=calibrate w=int4", "w=fp8_block noise=0.1"]

@pytest.mark.parametrize("device", DEVICES)
def test_engine_equals_the_naive_loop_on_the_device(device):
    model = tiny(0).float().to(device)
    prompts = [[1, 5, 9], [1, 7, 8, 9, 10], [1, 30]]
    params = SamplingParams(8, temperature=0.9, top_k=12)
    got = Engine(model, -1, 0).generate(prompts, params, torch.Generator(device).manual_seed(4))
    want = naive_sample(model, prompts, params, torch.Generator(device).manual_seed(4), pad_id=0)
    assert [r.completion_ids for r in got] == want.tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("plan", PLANS)
def test_the_emulation_without_shadows_is_the_same_engine(device, plan):
    """Quantized weights dequantized per call and KV caches read from their codes (CUDA's default) give exactly the
    tokens and log-probs of the kept dequantized copies (the CPU's default)."""
    runs = []
    for shadows in (True, False):
        model = tiny(0).float().to(device)  # update_weights writes into it
        engine = Engine(model, -1, 0, plan, shadows=shadows)
        runs.append(engine.generate([[1, 5, 9], [1, 7, 8]], SamplingParams(10), 3, return_hidden=True))
        engine.update_weights({k: v * 1.01 for k, v in model.state_dict().items()}, 1)  # in place, shared or not
        runs.append(engine.generate([[1, 5, 9]], SamplingParams(10), 3))
    for a, b in zip(runs[:2], runs[2:]):
        assert [(r.completion_ids, r.logprobs) for r in a] == [(r.completion_ids, r.logprobs) for r in b]
    assert torch.equal(runs[0][0].hidden, runs[2][0].hidden)


@pytest.mark.parametrize("device", DEVICES)
def test_the_bf16_forward_with_bf16_matmuls_is_the_shadowed_one_up_to_summation_order(device):
    """forward=bf16 without shadows runs bf16 layers (a GPU's bf16 GEMMs); with them, float32 GEMMs of the same bf16
    values (the CPU's default): both accumulate in float32, so they differ only where a summation order moves a
    bf16 rounding. On the same tokens, their mean difference is under a tenth of the bf16 forward's distance from
    float32."""
    model = tiny(0).float().to(device)
    prompts = [[1, 5, 9], [1, 7, 8, 9, 10], [1, 30]]
    rollouts = Engine(model, -1, 0, "forward=bf16 kv=bf16").generate(prompts, SamplingParams(12), 3)
    completions, params = [r.completion_ids for r in rollouts], SamplingParams(12)
    logp = {}
    for name, plan, shadows in (("shadowed", "forward=bf16 kv=bf16", True), ("bf16", "forward=bf16 kv=bf16", False),
                                ("fp32", "", True)):
        forced = Engine(model, -1, 0, plan, shadows=shadows).teacher_force(prompts, completions, params)
        logp[name] = torch.tensor([x for r in forced for x in r.raw_logprobs])
    assert (logp["shadowed"] - logp["bf16"]).abs().mean() < 0.1 * (logp["shadowed"] - logp["fp32"]).abs().mean()


@pytest.mark.parametrize("plan, tight", [("forward=bf16 kv=bf16 w=int4", True),
                                         ("forward=bf16 kv=bf16 noise=0.1", True),
                                         ("forward=bf16 kv=fp8_e4m3 w=fp8", False),
                                         ("forward=bf16 kv=bf16 w=fp8_block", False)])
def test_native_bf16_gemms_of_quantized_weights_agree_with_the_float32_emulation(plan, tight):
    """With engine.bf16_gemm native, a changed layer's weights are dequantized to bf16 and multiplied in bf16 GEMMs
    (what a weight-only low-bit kernel does); with float32 GEMMs, the same dequantized weights in float32. Both
    measure the same mismatch against float32 rollouts (within a factor 1.5 on these 36 tokens). Weight-only
    (int4) and noise: on the same tokens the two differ by under a tenth of the plan's own distance from float32.
    W8A8 (fp8): not so; its dynamic per-call activation scale puts every input on a grid 1/16 apart, so the last
    bits a GEMM's rounding moves flip codes in the next layer, and the two realizations differ by about half the
    plan's error (measured 0.039-0.048 against 0.080-0.089), as two real FP8 kernels' would. The native copy holds
    its shadows in bf16."""
    from opd.numerics.weight_quant import QuantLinear
    model = tiny(0).float()
    prompts = [[1, 5, 9], [1, 7, 8, 9, 10], [1, 30]]
    params = SamplingParams(12)
    completions = [r.completion_ids for r in Engine(model, -1, 0).generate(prompts, params, 2)]
    logp = {}
    for name, plan_, gemm in (("native", plan, "native"), ("float32", plan, "float32"), ("fp32", "", "float32")):
        engine = Engine(model, -1, 0, plan_, bf16_gemm=gemm)
        forced = engine.teacher_force(prompts, completions, params)
        logp[name] = torch.tensor([x for r in forced for x in r.raw_logprobs])
        if name != "fp32":
            up = engine.model.layers[0].mlp.up_proj
            assert isinstance(up, QuantLinear) and up.dequantized.dtype == (
                torch.bfloat16 if gemm == "native" else torch.float32)
    gap = lambda a, b: (logp[a] - logp[b]).abs().mean().item()  # noqa: E731
    assert 1 / 1.5 < gap("native", "fp32") / gap("float32", "fp32") < 1.5
    if tight:
        assert gap("native", "float32") < 0.1 * gap("float32", "fp32")
    # a projection with a bias (Qwen's q/k/v): the native copy holds it in bf16, also after new weights load
    w, b, x = torch.randn(64, 32), torch.randn(64), torch.randn(5, 32).to(torch.bfloat16)
    layers = [QuantLinear("int4", w, b, True, native) for native in (True, False)]
    for _ in range(2):
        assert layers[0].bias.dtype == torch.bfloat16
        assert (layers[0](x).float() - layers[1](x).float()).abs().mean() < 0.02  # bf16 roundings of outputs ~5
        for layer in layers:
            layer.load_(w * 1.01, b * 2)


def test_bf16_gemm_chooses_the_bf16_forward_s_matmuls(monkeypatch):
    """engine.bf16_gemm: "float32" keeps float32 shadows of a bf16 forward's weights on the CPU, "native" runs bf16
    layers, "auto" follows the CPU's flags (an async run's worker gets the setting: test_async.py)."""
    import opd.engines.builtin
    from opd.numerics.weight_quant import QuantLinear
    model = tiny(0).float()

    def shadowed(gemm):
        proj = Engine(model, -1, 0, "forward=bf16 kv=bf16", bf16_gemm=gemm).model.layers[0].mlp.up_proj
        return isinstance(proj, QuantLinear) and proj.dequantized is not None
    assert shadowed("float32") and not shadowed("native")
    for native in (True, False):
        monkeypatch.setattr(opd.engines.builtin, "native_bf16", lambda device, native=native: native)
        assert shadowed("auto") == (not native)


def test_the_engine_holds_only_what_the_plan_changes():
    model = tiny(0).float()
    assert Engine(model, -1, 0, "kv=fp8_e4m3").model is model  # a KV-only plan runs the given weights
    engine = Engine(model, -1, 0, "w=bf16; 1: w=none")
    copy = engine.model
    assert copy.embed_tokens is model.embed_tokens and copy.lm_head is model.lm_head
    assert copy.layers[1] is model.layers[1]
    stored = copy.layers[0].mlp.up_proj
    assert stored.values.dtype == torch.bfloat16 and stored.dequantized is not None  # the CPU's shadow
    assert Engine(model, -1, 0, "w=fp8", shadows=False).model.layers[0].mlp.up_proj.dequantized is None
    assert Engine(model, -1, 0, "w=fp8").model.layers[0].mlp.up_proj.codes.dtype == torch.float8_e4m3fn
    cache = Engine(model, -1, 0, "kv=fp8_e4m3", shadows=False).new_cache(2, 8)
    assert cache.shadow_bytes_per_token() == 0 and cache.bytes_per_token() == 2 * 2 * 1 * 8


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_and_micro_batches_equal_the_oracle_on_the_device(device):
    student, teacher = tiny(0).to(device), tiny(1).to(device)
    batch, _ = batch_of(student)
    cfg = LossConfig("jsd")
    ref, _ = opd_loss(cfg, completion_logprobs(student, batch), completion_logprobs(teacher, batch).detach(),
                      *(x.to(device) for x in (batch.tokens, batch.mu, batch.mask)))
    ref.backward()
    want = grads(student)
    student.zero_grad(set_to_none=True)
    scores = score_batch(student, batch, LocalTeacher(teacher), Scoring(cfg, micro_batch_size=2, chunk_tokens=5),
                         backward=True)
    assert scores.loss == pytest.approx(ref.item(), abs=1e-12)
    for name, g in grads(student).items():
        assert torch.allclose(g, want[name], atol=1e-12, rtol=0), name


def test_bf16_compute_stays_within_bf16_error_of_float32():
    """bf16 autocast (float32 master weights) against float32: bf16 keeps 8 significant bits, so each logit is off by
    ~2^-9 of its size; measured here the loss moved 0.04-0.1% and per-parameter gradients kept a cosine similarity of
    >= 0.998. Bounds: loss 1% relative, cosine 0.99; the gradients stay float32."""
    student, teacher = tiny(0, vocab=300).float(), tiny(1, vocab=300).float()
    batch, _ = batch_of(student, n=8, new_tokens=12)
    batch.mu = batch.mu.float()
    for cfg in (LossConfig("full_rkl"), LossConfig("sampled_rkl")):
        student.zero_grad(set_to_none=True)
        full = score_batch(student, batch, LocalTeacher(teacher), Scoring(cfg), backward=True)
        want = grads(student)
        student.zero_grad(set_to_none=True)
        mixed = score_batch(student, batch, LocalTeacher(teacher), Scoring(cfg, autocast=torch.bfloat16), backward=True)
        assert mixed.loss == pytest.approx(full.loss, rel=1e-2)
        for name, g in grads(student).items():
            assert g.dtype == torch.float32
            assert torch.nn.functional.cosine_similarity(g.flatten(), want[name].flatten(), 0) > 0.99, name


def test_the_async_worker_recomputes_q_as_the_learner_computes():
    """With a bf16 learner, q (the sampling weights' log-probs) is the bf16-autocast forward, as the learner's pi of
    the same weights is: the numerics mismatch is measured against the policy the trainer differentiates."""
    from functools import partial
    from opd.training.worker import recompute
    student = tiny(0, vocab=300).float()
    engine = Engine(student, -1, 0, "kv=bf16 w=bf16")
    params = SamplingParams(10)
    rollouts = engine.generate([[1, 5, 9], [1, 7]], params, 0, return_hidden=True)
    batch = collate(rollouts, 0)
    recompute(student, rollouts, 0, params, 0, partial(engine.logprobs, params=params), "bf16")
    got = collate(rollouts, 0)
    learner = score_batch(student, batch, how=Scoring(autocast=torch.bfloat16), rollout=partial(engine.logprobs,
                                                                                           params=params))
    full = score_batch(student, batch)
    assert torch.equal(got.q[got.mask], learner.pi[batch.mask])
    assert torch.allclose(got.kl_exact[got.mask], learner.kl_exact[batch.mask])
    assert not torch.equal(got.q[got.mask], full.pi[batch.mask])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_run_on_the_device_with_bf16_learner_and_teacher(pair, tmp_path, device, schedule):
    """A short run with dtype bf16 and teacher_dtype bf16: master weights and optimizer state stay float32, the teacher
    is stored in bf16, and the loss comes down as in float32."""
    from opd.training.setup import setup
    cfg = config(pair, steps=8, batch_size=8, optim=dict(lr=1e-2, warmup_steps=0), loss={"name": "full_rkl"},
                 compute=dict(device=device, dtype="bf16", teacher_dtype="bf16", micro_batch_size=4), schedule=schedule,
                 **({"threads": 2, "async_": {"max_staleness": 1}} if schedule == "async" else {}))
    summary = train(cfg, tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run")
    assert rows[-2]["loss/value"] < rows[0]["loss/value"]
    assert summary["after"]["eval/rkl"] < summary["before"]["eval/rkl"]
    run = setup(cfg)
    assert {p.dtype for p in run.student.parameters()} == {torch.float32}
    assert {p.dtype for p in run.teacher.model.parameters()} == {torch.bfloat16}
    assert run.student.embed_tokens.weight.device.type == device
    run.rollouts.close()


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoints_load_onto_the_device_in_the_dtype(tmp_path, device):
    model = tiny(0, vocab=100).float()
    save_checkpoint(tmp_path / "m", model, TextTokenizer.builtin())
    loaded, _ = load_checkpoint(tmp_path / "m", torch.bfloat16, device)
    assert {(p.dtype, p.device.type) for p in loaded.parameters()} == {(torch.bfloat16, device)}
    assert loaded.lm_head.weight is loaded.embed_tokens.weight  # still tied
    x = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # bf16 weights and activations: logits within a few percent of the largest
        want, got = model(x), loaded(x.to(device)).float().cpu()
    assert (got - want).abs().max() <= 0.1 * want.abs().max()


def test_evaluation_at_bf16_compute_stays_near_float32s():
    """compute.dtype bf16: the held-out samples come from a bf16 forward and are scored under autocast (as the learner
    computes); the reverse KL and entropy stay within a few percent of float32's on the same seed (bf16's rounding,
    and the few tokens it changes)."""
    from opd.training.evaluate import sampled_quality
    from opd.data.task import Example
    student, teacher, tok = tiny(0, vocab=300).float(), tiny(1, vocab=300).float(), TextTokenizer.builtin()
    examples = [Example(f"{i}+1=", "", "2") for i in range(16)]
    got = {dtype: sampled_quality(student, LocalTeacher(teacher), tok, examples, 24, seed=3, batch_size=16,
                                  autocast=dtype) for dtype in (None, torch.bfloat16)}
    for key in ("eval/rkl", "eval/entropy"):
        assert got[torch.bfloat16][key] == pytest.approx(got[None][key], rel=0.05), key
        assert got[torch.bfloat16][key] != got[None][key]  # it did run in bf16
