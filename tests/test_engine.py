"""The rollout engine against its oracles: the naive uncached sampling loop, and the trainer-side recomputation."""
import copy

import pytest
import torch

from opd.engines.builtin import Engine
from opd.io.errors import OpdError
from opd.engines.naive import naive_sample
from opd.numerics.plan import Plan
from opd.models.model import ModelConfig, Transformer
from opd.engines.sampling import SamplingParams, process_logits, sample

CFG = ModelConfig(arch="qwen3", vocab_size=50, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True)
EOS, PAD = 2, 0
PROMPTS = [[1, 5, 9], [1, 7, 8, 9, 10, 11, 12], [1, 30], [1, 4, 4, 4, 4]]


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG).init_weights(torch.Generator().manual_seed(0), std=0.3).eval()


@pytest.mark.parametrize("params", [
    SamplingParams(16, temperature=1.0),
    SamplingParams(16, temperature=0.7, top_k=10),
    SamplingParams(16, temperature=1.3, top_p=0.8),
    SamplingParams(16, temperature=0.0),
])
def test_engine_equals_naive_sampling_loop_token_for_token(model, params):
    engine = Engine(model, stop_ids=-1, pad_id=PAD)  # no eos: every row runs the full length
    got = engine.generate(PROMPTS, params, torch.Generator().manual_seed(7))
    want = naive_sample(model, PROMPTS, params, torch.Generator().manual_seed(7), pad_id=PAD)
    assert [r.completion_ids for r in got] == want.tolist()


def test_records_stop_length_and_version(model):
    engine = Engine(model, stop_ids=EOS, pad_id=PAD, version=3)
    rollouts = engine.generate(PROMPTS * 8, SamplingParams(12, temperature=1.5), torch.Generator().manual_seed(1))
    reasons = {r.finish_reason for r in rollouts}
    assert reasons == {"stop", "length"}, "pick a seed where both happen"
    for r in rollouts:
        n = len(r.completion_ids)
        assert len(r.logprobs) == len(r.raw_logprobs) == n and r.policy_version == 3
        if r.finish_reason == "stop":
            assert r.completion_ids[-1] == EOS and EOS not in r.completion_ids[:-1]
        else:
            assert n == 12 and EOS not in r.completion_ids
    engine.update_weights(model.state_dict(), version=4)
    assert engine.generate(PROMPTS[:1], SamplingParams(2), torch.Generator())[0].policy_version == 4


def teacher_forced_logits(model, prompt, completion):
    with torch.no_grad():
        return model(torch.tensor([prompt + completion]))[0, len(prompt) - 1:-1]  # [N, V]


def teacher_forced_logprobs(model, prompt, completion):
    lp = teacher_forced_logits(model, prompt, completion).float().log_softmax(-1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_raw_logprobs_equal_trainer_recomputation_and_processed_differ(model):
    """With an fp32 cache the sampler's raw log-probs (tempered, before top-k) are the trainer's q at the same
    temperature (the mismatch floor is float noise); the processed ones are the truncated distribution's."""
    engine = Engine(model, stop_ids=-1, pad_id=PAD)
    for r in engine.generate(PROMPTS, SamplingParams(20, temperature=0.6, top_k=20), torch.Generator().manual_seed(2)):
        logits = teacher_forced_logits(model, r.prompt_ids, r.completion_ids)
        tok = torch.tensor(r.completion_ids)[:, None]
        q = (logits / 0.6).log_softmax(-1).gather(1, tok)[:, 0]
        assert torch.allclose(torch.tensor(r.raw_logprobs), q, atol=1e-5)
        # processed, computed independently: temperature, then renormalise over the 20 largest logits
        scaled = logits / 0.6
        top = scaled.topk(20, dim=-1)
        in_top = (top.indices == tok).any(-1)
        assert in_top.all(), "a sampled token must lie in the top-k support"
        mu = scaled.gather(1, tok)[:, 0] - top.values.logsumexp(-1)
        assert torch.allclose(torch.tensor(r.logprobs), mu, atol=1e-5)
        assert not torch.allclose(torch.tensor(r.logprobs), torch.tensor(r.raw_logprobs), atol=1e-3)
    r = engine.generate(PROMPTS[:1], SamplingParams(10, temperature=1.0), torch.Generator())[0]
    assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(r.raw_logprobs), atol=1e-6)


def test_fp8_kv_engine_mismatch_is_small_but_real(model):
    prompts = PROMPTS * 4
    gaps = {}
    for dtype in ("fp32", "fp8_e4m3", "fp8_e5m2"):
        engine = Engine(model, stop_ids=-1, pad_id=PAD, plan=f"kv={dtype}")
        deltas = []
        for r in engine.generate(prompts, SamplingParams(24), torch.Generator().manual_seed(3)):
            q = teacher_forced_logprobs(model, r.prompt_ids, r.completion_ids)
            deltas.append((q - torch.tensor(r.raw_logprobs)).abs())
        gaps[dtype] = torch.cat(deltas).mean().item()
    assert gaps["fp32"] < 1e-5 < gaps["fp8_e4m3"] < gaps["fp8_e5m2"] < 0.5


def max_logprob_gap(got, want) -> float:
    return max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.raw_logprobs + g.logprobs,
                                                                     w.raw_logprobs + w.logprobs))


@pytest.mark.slow
def test_compiled_engine_equals_eager_engine(model):
    """compile=True against the eager engine (~1.5 min: two compilations). Float32: the same tokens and log-probs
    to float tolerance (fused reductions add in another order), also after a weight update; once built, the engine
    compiles nothing more for other batch and prompt sizes or new weights. The default BF16 plan: its
    compiled-vs-eager differences are far below the BF16-vs-float32 mismatch that plan exists to emulate."""
    from torch._dynamo.utils import counters
    prompts = PROMPTS * 4
    eager, compiled = Engine(copy.deepcopy(model), EOS, PAD), Engine(copy.deepcopy(model), EOS, PAD, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    noisy = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
             for k, v in model.state_dict().items()}
    for i, params in enumerate((SamplingParams(24, temperature=1.0), SamplingParams(24, temperature=0.7, top_p=0.9))):
        if i == 1:
            eager.update_weights(noisy, 1)
            compiled.update_weights(noisy, 1)
        want, got = (e.generate(prompts, params, torch.Generator().manual_seed(i)) for e in (eager, compiled))
        assert {r.finish_reason for r in want} == {"stop", "length"}, "ragged stops are part of the check"
        assert [r.completion_ids for r in got] == [r.completion_ids for r in want]
        assert [r.policy_version for r in got] == [i] * len(got)
        assert max_logprob_gap(got, want) < 1e-4
    assert counters["stats"]["unique_graphs"] == graphs, "the built engine compiled again"

    plan = "kv=bf16 w=bf16"
    eager, compiled = Engine(model, EOS, PAD, plan), Engine(model, EOS, PAD, plan, compile=True)
    want, got = (e.generate(prompts, SamplingParams(24), torch.Generator().manual_seed(5)) for e in (eager, compiled))
    same = [(g, w) for g, w in zip(got, want) if g.completion_ids == w.completion_ids]
    assert len(same) >= 0.75 * len(want)
    gap = torch.tensor([abs(a - b) for g, w in same for a, b in zip(g.raw_logprobs, w.raw_logprobs)]).mean()
    mismatch = torch.cat([(teacher_forced_logprobs(model, w.prompt_ids, w.completion_ids)
                           - torch.tensor(w.raw_logprobs)).abs() for w in want]).mean()
    assert gap < 0.1 * mismatch, (gap, mismatch)


def test_process_logits_top_k_top_p_hand_computed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = process_logits(logits, SamplingParams(temperature=1.0, top_k=2)).exp()
    assert torch.allclose(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # the smallest set whose mass reaches top_p: {0.5, 0.3} for 0.7, {0.5, 0.3, 0.15} for 0.85
    nucleus = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7)).exp()
    assert torch.allclose(nucleus, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    nucleus = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.85)).exp()
    assert torch.allclose(nucleus, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    hot = process_logits(logits, SamplingParams(temperature=2.0)).exp()
    assert torch.allclose(hot, torch.tensor([[0.5, 0.3, 0.15, 0.05]]).sqrt() / torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt().sum())


def test_sampler_frequencies_match_probabilities():
    """20,000 draws from a fixed distribution: every frequency within 4 standard errors of its probability."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logprobs = p.log().expand(20000, 4)
    draws = sample(logprobs, SamplingParams(), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / 20000).sqrt()).all(), freq


def test_sampler_never_draws_a_token_of_zero_mass(monkeypatch):
    """Top-k/top-p leave tokens at -inf, inside the vocabulary and at its end: over 20,000 draws none is drawn, the
    rest at their frequencies; a uniform draw that rounds up to the total mass takes the last token with mass, not
    one past the vocabulary."""
    p = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0, 0.0])
    logprobs = p.log().expand(20000, 7)
    draws = sample(logprobs, SamplingParams(), torch.Generator().manual_seed(1))
    freq = torch.bincount(draws, minlength=7).float() / 20000
    assert (freq[p == 0] == 0).all(), freq
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / 20000).sqrt()).all(), freq
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.ones(*shape, dtype=kw["dtype"]))
    assert sample(p.log().expand(3, 7), SamplingParams(), torch.Generator()).tolist() == [4, 4, 4]


def test_engine_rejects_bad_requests(model):
    engine = Engine(model, stop_ids=EOS, pad_id=PAD)
    with pytest.raises(OpdError, match="exceeds the model's context"):
        engine.generate([[1] * 500], SamplingParams(100), torch.Generator())
    with pytest.raises(OpdError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(OpdError, match="int4 KV group 32 does not divide head_dim 16"):
        Engine(model, EOS, PAD, plan="1: kv=int4")
    with pytest.raises(OpdError, match="precision plan has 3 layers"):
        Engine(model, EOS, PAD, plan=Plan.full(3))


def test_bf16_forward_engine_equals_an_uncached_bf16_forward(model):
    """forward=bf16: the engine's teacher-forced log-probs (KV-cached, one token a step) against the oracle, the
    same tokens through the model's bf16 copy in one uncached forward. They differ only in the float32 attention's
    summation order (SDPA vs the decode matmul), which can move a bf16 rounding by one step: the mean difference
    must be under a tenth of the bf16 forward's own distance from float32 (seen: ~1/40), and the copy all bf16."""
    from opd.numerics.weight_quant import bf16_copy
    engine = Engine(model, -1, PAD, "forward=bf16 kv=bf16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}  # norms, embeddings, head
    assert engine.model.layers[0].self_attn.q_proj.values.dtype == torch.bfloat16  # projections: bf16 storage
    rollouts = engine.generate(PROMPTS, SamplingParams(12), 0)
    forced = engine.teacher_force(PROMPTS, [r.completion_ids for r in rollouts], SamplingParams(12))
    assert [r.logprobs for r in forced] == [r.logprobs for r in rollouts]  # teacher forcing == generation
    oracle = bf16_copy(model)
    cached = torch.cat([torch.tensor(r.raw_logprobs) for r in rollouts])
    uncached = torch.cat([teacher_forced_logprobs(oracle, r.prompt_ids, r.completion_ids) for r in rollouts])
    fp32 = torch.cat([teacher_forced_logprobs(model, r.prompt_ids, r.completion_ids) for r in rollouts])
    assert (cached - uncached).abs().mean() < 0.1 * (cached - fp32).abs().mean()


def test_bf16_forward_copy_follows_weight_updates(model):
    engine = Engine(copy.deepcopy(model), -1, PAD, "forward=bf16 kv=fp8_e4m3 kv_round=zero; 1: w=int8")
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    engine.update_weights(new, version=1)
    assert torch.equal(engine.model.embed_tokens.weight, new["embed_tokens.weight"].to(torch.bfloat16))
    assert torch.equal(engine.model.layers[0].mlp.up_proj.values, new["layers.0.mlp.up_proj.weight"].to(torch.bfloat16))
    assert torch.equal(engine.model.norm.weight, new["norm.weight"].to(torch.bfloat16))
    assert engine.model.layers[1].mlp.up_proj.scheme == "int8"  # the plan's changed layer keeps its scheme
