"""The chunked full-vocabulary path against the unchunked oracle, micro-batches against one batch, and the sizes of
the tensors every path holds: chunked == unchunked (values and gradients, float64, tolerance 1e-12 relative to O(1)
values: the same sums in another order), micro-batched == one batch, and no [batch, tokens, vocab] tensor anywhere."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opd.training import chunked
from opd.training.chunked import Source, Student, chunk_size, log_probs, output_layer, score
from opd.engines.builtin import Engine
from opd.training.evaluate import context_quality, sampled_quality
from opd.training.learner import Scoring, collate, completion_index, completion_logprobs, pack, packed_hidden, score_batch
from opd.training.losses import LossConfig, kl, opd_loss
from opd.engines.sampling import SamplingParams
from opd.data.task import Example
from opd.training.teacher import LocalTeacher
from opd.models.tokenizer import TextTokenizer

from helpers import batch_of, grads, recorded_distributions, tiny

LOSSES = [LossConfig("full_rkl"), LossConfig("fkl"), LossConfig("jsd", jsd_beta=0.3), LossConfig("topk_rkl", topk=3),
          LossConfig("topk_rkl", topk=3, topk_support="teacher"), LossConfig("topk_fkl", topk=3),
          LossConfig("topk_rkl_tail", topk=3),
          LossConfig("sampled_rkl", student_term="sampler", correction="tis"),
          LossConfig("sampled_rkl", correction="mis", cap=1.5), LossConfig("sampled_rkl")]
TOL = 1e-12


def case(M=13, d=6, dt=5, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    th, tw = torch.randn(M, dt, generator=g, dtype=torch.float64), torch.randn(V, dt, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (M,), generator=g)
    noise = 0.2 * torch.randn(M, generator=g, dtype=torch.float64)
    mu = log_probs(h.detach() @ w.detach().T).gather(-1, tokens[:, None])[:, 0] + noise
    return h, w, th, tw, tokens, mu


@pytest.mark.parametrize("cfg", LOSSES, ids=lambda c: f"{c.name}-{c.topk_support}-{c.correction}")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_loss_equals_the_unchunked_loss_in_value_and_gradient(cfg, temperature):
    h, w, th, tw, tokens, mu = case()
    ref, metrics = opd_loss(cfg, log_probs(h @ w.T, temperature)[None], log_probs(th @ tw.T)[None], tokens[None],
                            mu[None], torch.ones(1, len(tokens), dtype=torch.bool))
    want = torch.autograd.grad(ref, [h, w])
    for chunk in (1, 4, 13, 100):
        value, terms = score(Student(h, w, temperature), tokens, mu, None, cfg,
                             Source(th, lambda x: log_probs(x @ tw.T)), chunk_tokens=chunk)
        got = torch.autograd.grad(value, [h, w])
        assert value.item() == pytest.approx(ref.item(), abs=TOL)
        assert terms["loss"].mean().item() == pytest.approx(metrics["loss/value"], abs=TOL)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=TOL, rtol=0), (chunk, (a - b).abs().max())


def test_chunked_terms_equal_whole_distribution_formulas():
    """s_y, t_y, the per-token reverse KL to the teacher and the exact rollout KL, chunk by chunk vs at once."""
    h, w, th, tw, tokens, _ = case(seed=1)
    rh, rw = torch.randn(13, 4, dtype=torch.float64), torch.randn(11, 4, dtype=torch.float64)
    s, t, r = log_probs(h @ w.T, 0.8).detach(), log_probs(th @ tw.T), log_probs(rh @ rw.T)
    for chunk in (1, 5):
        _, terms = score(Student(h.detach(), w.detach(), 0.8), tokens,
                         teacher=Source(th, lambda x: log_probs(x @ tw.T)),
                         rollout=Source(rh, lambda x: log_probs(x @ rw.T)), chunk_tokens=chunk)
        assert torch.allclose(terms["s_y"], s.gather(-1, tokens[:, None])[:, 0], atol=TOL, rtol=0)
        assert torch.allclose(terms["t_y"], t.gather(-1, tokens[:, None])[:, 0], atol=TOL, rtol=0)
        assert torch.allclose(terms["rkl"], kl(s, t), atol=TOL, rtol=0)
        want = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=r),
                                                 torch.distributions.Categorical(logits=s))
        assert torch.allclose(terms["kl_exact"], want, atol=TOL, rtol=0)


def test_default_chunk_is_a_fixed_number_of_floats():
    assert chunk_size(151_936) == 110 and chunk_size(100) == 167_772 and chunk_size(100, 7) == 7


@pytest.mark.parametrize("overrides", [{}, {"layer_types": ("sliding_attention", "full_attention"),
                                              "sliding_window": 3}], ids=["full", "sliding"])
def test_packed_batch_equals_each_row_run_alone(overrides):
    """learner.pack drops the padding and runs the rows one after another (model.Segments): every completion
    position's hidden state equals that row's own forward, sliding-window layers included."""
    model = tiny(0, **overrides)
    batch, _ = batch_of(model)
    packed = pack(batch)
    assert sum(packed.lengths) < batch.input_ids.numel()  # the rows differ in length: padding was dropped
    rows, positions = completion_index(batch)
    lengths = dict(enumerate(packed.lengths))
    with torch.no_grad():
        want = torch.stack([model.hidden(batch.input_ids[r, :lengths[r]][None])[0, p]
                            for r, p in zip(rows.tolist(), positions.tolist())])
        got = packed_hidden(model, packed)
    assert torch.allclose(got, want, atol=TOL, rtol=0)


# ---- score_batch on a model: against the unchunked oracle path, and micro-batches against one batch -----------------

@pytest.mark.parametrize("cfg", [LossConfig("full_rkl"), LossConfig("jsd"), LossConfig("sampled_rkl",
                                                                                         correction="tis")],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("tied", [True, False])
def test_score_batch_equals_the_unchunked_oracle_path(cfg, tied):
    """learner.score_batch (packed completion positions, chunks, micro-batches) against completion_logprobs +
    opd_loss on whole [B, N, V] distributions: loss, metrics and every parameter's gradient."""
    student, teacher = tiny(0, tied=tied), tiny(1)
    batch, _ = batch_of(student)
    logp = completion_logprobs(student, batch, 0.9)
    ref, ref_metrics = opd_loss(cfg, logp, completion_logprobs(teacher, batch).detach(), batch.tokens, batch.mu,
                                batch.mask)
    ref.backward()
    want = grads(student)
    for micro, chunk in ((0, 0), (2, 5), (3, 1)):
        student.zero_grad(set_to_none=True)
        scores = score_batch(student, batch, LocalTeacher(teacher), Scoring(cfg, 0.9, micro, chunk), backward=True)
        assert scores.loss == pytest.approx(ref.item(), abs=TOL)
        assert scores.metrics == pytest.approx(ref_metrics, abs=TOL)
        got = grads(student)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.allclose(got[name], want[name], atol=TOL, rtol=0), (micro, chunk, name)
        pi = logp.detach().gather(-1, batch.tokens[..., None])[..., 0]
        assert torch.allclose(scores.pi[batch.mask], pi[batch.mask], atol=TOL, rtol=0)


def test_exact_kl_from_hidden_states_equals_the_kl_of_the_engines_untruncated_distributions():
    """With top-k on, the exact KL is the numerics' alone: between the engine's tempered, untruncated distribution and
    the trainer's (the truncation is reported apart, metrics.truncation_metrics)."""
    student = tiny(0).float()
    engine = Engine(student, 2, 0, plan="kv=fp8_e5m2")
    params = SamplingParams(9, temperature=0.8, top_k=20)
    with recorded_distributions(engine, raw=True) as dists:
        batch = collate(engine.generate([[1, 5, 6], [1, 7]], params, 0, return_hidden=True), 0)
    scores = score_batch(student, batch, how=Scoring(temperature=0.8, chunk_tokens=3),
                         rollout=lambda h: engine.logprobs(h, params))
    want = kl(dists(batch).double(), completion_logprobs(student, batch, 0.8).double())
    assert want[batch.mask].mean() > 1e-4
    assert torch.allclose(scores.kl_exact[batch.mask].double(), want[batch.mask], rtol=1e-3, atol=1e-7)


# ---- no path holds a [batch, tokens, vocab] tensor ------------------------------------------------------------------

class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op allocates (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view of an existing tensor (detach, transpose) allocates nothing
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_path_materialises_batch_by_tokens_by_vocab():
    """With a vocabulary much larger than the model (V = 3000, d = 16), B = 8 rollouts of 40 tokens: the engine, a
    learner step with micro-batches, the probe's scoring and evaluation never make a tensor larger than the largest
    of one chunk x V, one micro-batch's rows x V (the engine's step), and the output weight V x d."""
    V, B, N, chunk = 3000, 8, 40, 8
    student, teacher = tiny(0, vocab=V).float(), tiny(1, vocab=V).float()
    bound = max(chunk * V, 2 * V, V * 16)
    assert B * N * V > 10 * bound
    engine = Engine(student, -1, 0, plan="kv=fp8_e4m3 w=bf16")
    prompts = [[1, 5 + i, 9] for i in range(B)]
    with LargestTensor() as mode:  # the engine: prefill and decode make [rows, V] logits only
        batch = collate(engine.generate(prompts[:2], SamplingParams(N), 0, return_hidden=True), 0)
    assert mode.largest <= bound, mode.largest
    batch = collate(engine.generate(prompts, SamplingParams(N), 0, return_hidden=True), 0)
    with LargestTensor() as mode:
        score_batch(student, batch, LocalTeacher(teacher), Scoring(LossConfig("jsd"), micro_batch_size=2,
                                                                   chunk_tokens=chunk),
                    rollout=lambda h: engine.logprobs(h, SamplingParams(N)), backward=True)
    assert mode.largest <= bound, mode.largest
    tok = TextTokenizer.builtin()
    with LargestTensor() as mode:
        sampled_quality(student, LocalTeacher(teacher), tok, [Example("1+1=", "", "2")] * 6, N, seed=0, batch_size=2,
                        chunk_tokens=chunk)
    assert mode.largest <= bound, mode.largest


def test_output_layer_runs_only_where_it_is_used():
    """The engine's prefill projects one position per prompt; the learner projects the completion tokens only."""
    student = tiny(0, vocab=3000).float()
    rows = []
    student.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].reshape(-1, 16).shape[0]))
    engine = Engine(student, -1, 0)
    batch = collate(engine.generate([[1] + [5] * 30, [1, 6]], SamplingParams(3), 0), 0)
    assert rows == [2, 2, 2]  # the prefill of prompts of 31 and 2 tokens, then two decode steps
    with LargestTensor() as mode:
        score_batch(student, batch)  # one chunk: every completion token, none of the 33 + 5 positions before them
    assert mode.largest == batch.num_tokens * 3000 == 6 * 3000
    assert output_layer(student)(torch.zeros(3, 16)).shape == (3, 3000)


def test_eval_entropy_is_the_students_surprise_at_its_own_samples():
    """eval/entropy: the mean -log p_student of the held-out samples, equal to the unchunked oracle's on the same
    samples, near the exact entropy of the student's distributions along them (its expectation), and 0 for a
    student that collapsed onto one token (whose reverse KL need not be high)."""
    V, N, seed = 300, 40, 3
    student, teacher, tok = tiny(0, vocab=V).double(), tiny(1, vocab=V).double(), TextTokenizer.builtin()
    examples = [Example(f"{i}+1=", "", "2") for i in range(8)]
    got = sampled_quality(student, LocalTeacher(teacher), tok, examples, N, seed=seed, batch_size=8, chunk_tokens=7)
    engine = Engine(student, tok.stop_ids, tok.pad_id)
    rollouts = engine.generate([tok.encode_prompt(ex.prompt) for ex in examples], SamplingParams(N),
                               torch.Generator().manual_seed(seed))
    batch = collate(rollouts, tok.pad_id)
    logp = completion_logprobs(student, batch)  # [B, N, V], the whole distributions
    picked = logp.gather(-1, batch.tokens[..., None])[..., 0]
    assert got["eval/entropy"] == pytest.approx(-picked[batch.mask].mean().item(), rel=1e-9)
    exact = -(logp.exp() * logp).sum(-1)[batch.mask].mean().item()
    assert got["eval/entropy"] == pytest.approx(exact, rel=0.15) and exact > 1.0
    # sampled and scored at temperature 1e-4 the student is all but deterministic, as a collapsed one is at 1
    collapsed = sampled_quality(student, LocalTeacher(teacher), tok, examples, N, seed=seed,
                                params=SamplingParams(N, temperature=1e-4), batch_size=8)
    assert collapsed["eval/entropy"] < 0.01 < got["eval/entropy"]


def test_fixed_context_quality_is_the_exact_kl_and_entropy_on_the_kept_samples():
    """eval.contexts fixed: context_quality on the samples sampled_quality kept equals the unchunked oracle's exact
    reverse KL and exact entropy over their positions (chunked, in batches), its KL equals sampled_quality's on the
    same samples (the first evaluation's two numbers agree), and on a changed student only the weights move it."""
    V, N, seed = 300, 40, 3
    student, teacher, tok = tiny(0, vocab=V).double(), tiny(1, vocab=V).double(), TextTokenizer.builtin()
    examples = [Example(f"{i}+1=", "", "2") for i in range(8)]
    kept = []
    sampled = sampled_quality(student, LocalTeacher(teacher), tok, examples, N, seed=seed, batch_size=8, keep=kept)
    assert len(kept) == 8
    for batch_size, chunk in ((0, 0), (3, 7)):
        got = context_quality(student, LocalTeacher(teacher), kept, tok.pad_id, batch_size=batch_size,
                              chunk_tokens=chunk)
        batch = collate(kept, tok.pad_id)
        s, t = completion_logprobs(student, batch), completion_logprobs(teacher, batch)
        assert got["eval/rkl"] == pytest.approx(kl(s, t)[batch.mask].mean().item(), rel=1e-9)
        assert got["eval/entropy"] == pytest.approx(-(s.exp() * s).sum(-1)[batch.mask].mean().item(), rel=1e-9)
        assert got["eval/rkl"] == pytest.approx(sampled["eval/rkl"], rel=1e-9)
    moved = tiny(2, vocab=V).double()
    again = context_quality(moved, LocalTeacher(teacher), kept, tok.pad_id)
    assert again == context_quality(moved, LocalTeacher(teacher), kept, tok.pad_id)  # no sampling: repeatable
    assert again["eval/rkl"] != pytest.approx(got["eval/rkl"], rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cfg", [LossConfig("full_rkl"), LossConfig("jsd", jsd_beta=0.3)], ids=lambda c: c.name)
def test_the_output_weight_cast_once_equals_autocasts_cast_in_every_matmul(monkeypatch, cfg, dtype):
    """Under a bf16 learner's autocast the output weight is cast once a call (chunked.as_multiplied) rather than by
    autocast in each chunk's matmuls: loss, log-probs and every gradient equal to the bit; a float64 weight, which
    autocast leaves alone, stays float64."""
    student, teacher = tiny(0).to(dtype), tiny(1).to(dtype)
    batch, _ = batch_of(student)
    how = Scoring(cfg, 0.9, 2, 3, torch.bfloat16)

    def run():
        student.zero_grad(set_to_none=True)
        scores = score_batch(student, batch, LocalTeacher(teacher), how, backward=True)
        return scores, grads(student)

    with torch.autocast("cpu", torch.bfloat16):
        cast = chunked.as_multiplied(student.lm_head.weight)
    assert cast.dtype == (torch.bfloat16 if dtype == torch.float32 else dtype) and not cast.requires_grad
    got, got_grads = run()
    monkeypatch.setattr(chunked, "as_multiplied", lambda weight: weight.detach())  # autocast casts it per matmul
    want, want_grads = run()
    assert got.loss == want.loss and torch.equal(got.pi, want.pi)
    assert got_grads.keys() == want_grads.keys()
    assert all(torch.equal(got_grads[name], want_grads[name]) for name in want_grads)


def test_a_scaled_backward_scales_the_chunked_gradients():
    """_ChunkedLoss.backward hands its stored gradients on as they are for loss.backward() (an incoming 1) and
    scales them otherwise."""
    h, w, th, tw, tokens, mu = case()
    source = Source(th, lambda x: log_probs(x @ tw.T))
    value, _ = score(Student(h, w), tokens, mu, None, LossConfig("full_rkl"), source, chunk_tokens=4)
    once = torch.autograd.grad(value, [h, w])
    value, _ = score(Student(h, w), tokens, mu, None, LossConfig("full_rkl"), source, chunk_tokens=4)
    thrice = torch.autograd.grad(3 * value, [h, w])
    for a, b in zip(once, thrice):
        assert torch.equal(3 * a, b)
