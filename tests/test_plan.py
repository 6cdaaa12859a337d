"""Precision plans (parsing, errors) and weight quantization (bounds, what stays full precision)."""
import pytest
import torch

from opd.engines.builtin import Engine
from opd.io.errors import OpdError
from opd.numerics.kv_cache import KVSpec
from opd.models.model import ModelConfig, Transformer
from opd.numerics.plan import LayerPrecision, Plan
from opd.engines.sampling import SamplingParams
from opd.numerics.weight_quant import (apply_weight_precision, fake_quant, fake_quant_fp8_groups,
                              quantize_linear)

CFG = ModelConfig(arch="llama", vocab_size=50, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG).init_weights(torch.Generator().manual_seed(0), std=0.1).eval()


def test_parse_everywhere_except():
    plan = Plan.parse("kv=fp8_e4m3 kv_scale=calibrate; 0,3: kv=bf16", 4)
    assert [l.kv.dtype for l in plan.layers] == ["bf16", "fp8_e4m3", "fp8_e4m3", "bf16"]
    assert all(l.kv.scale_mode == "calibrate" for l in plan.layers)  # layers 0 and 3 keep the earlier setting
    assert Plan.parse("", 4) == Plan.full(4)
    assert Plan.from_mapping({"*": "kv=fp8_e4m3 kv_scale=calibrate", "0,3": "kv=bf16"}, 4) == plan
    with pytest.raises(OpdError, match="expected a mapping"):
        Plan.from_mapping(["kv=bf16"], 4)


def test_parse_ranges_weights_noise_and_round_trip():
    plan = Plan.parse("w=int4; 1-2: noise=0.01 kv=int4 kv_group=16; 3: kv=int8 kv_scale=dynamic kv_per_head=true", 4)
    assert plan.layers[0] == LayerPrecision(weights="int4")
    assert plan.layers[1] == plan.layers[2] == LayerPrecision(KVSpec("int4", group=16), "int4", 0.01)
    assert plan.layers[3].kv == KVSpec("int8", "dynamic", per_head=True)
    assert Plan.parse(str(plan), 4) == plan and plan.changes_weights and not Plan.full(4).changes_weights
    stress = Plan.parse("kv=fp8_e4m3 key_outlier=300; 0: key_outlier=1", 4)
    assert [l.key_outlier for l in stress.layers] == [1, 300, 300, 300] and stress.changes_weights
    assert Plan.parse(str(stress), 4) == stress and "key_outlier=300" in str(stress)


def test_forward_and_kv_round_parse_and_round_trip():
    plan = Plan.parse("forward=bf16 kv=fp8_e5m2 kv_round=zero; 0: kv=bf16", 4)
    assert plan.forward == "bf16" and [l.kv.rounding for l in plan.layers] == ["nearest"] + ["zero"] * 3
    assert str(plan).startswith("forward=bf16; ") and Plan.parse(str(plan), 4) == plan
    assert Plan.parse("kv=fp8_e4m3", 4).layers[0].kv.rounding == "nearest" and Plan.parse("", 4).forward == "fp32"


@pytest.mark.parametrize("text, message", [
    ("kv=fp9", "unknown KV cache dtype"),
    ("4: kv=bf16", "layer 4 is out of range"),
    ("1-0: kv=bf16", "layer range 1-0 runs backwards"),
    ("a-b: kv=bf16", "bad layer selector"),
    ("kv fp8", "bad setting"),
    ("w=int3", "unknown weight scheme"),
    ("noise=lots", "not a number"),
    ("noise=-1", "noise must be >= 0"),
    ("noise=inf", "noise must be >= 0 and finite"),
    ("key_outlier=0", "key_outlier must be > 0"),
    ("key_outlier=nan", "key_outlier must be > 0 and finite"),
    ("kv=int8", "fixed scale"),
    ("kv=fp8_e4m3 kv_round=up", "unknown KV rounding"),
    ("kv=bf16 kv_round=zero", "kv_round=zero applies to fp8 KV caches"),
    ("forward=fp16", "unknown forward"),
    ("0: forward=bf16", "forward applies to the whole model"),
])
def test_bad_plans_are_clear_errors(text, message):
    with pytest.raises(OpdError, match=message):
        Plan.parse(text, 4)


W = torch.randn(256, 128, generator=torch.Generator().manual_seed(1)) * 0.05


@pytest.mark.parametrize("scheme, rel_bound", [("fp8", 2 ** -4), ("fp8_block", 2 ** -4), ("int8", None),
                                               ("int4", None)])
def test_weight_fake_quant_bounds(scheme, rel_bound):
    err = (fake_quant(W, scheme) - W).abs()
    assert err.max() > 0
    if rel_bound:  # fp8 normals: half a mantissa step; tiny values: the subnormal half-step of the scale
        scale = W.abs().amax() / 448
        assert (err <= torch.maximum(rel_bound * W.abs(), scale * 2 ** -10) + 1e-9).all()
    elif scheme == "int8":
        assert (err <= W.abs().amax(1, keepdim=True) / 127 / 2 + 1e-7).all()
    else:
        g = W.reshape(256, 1, 128)
        assert (err.reshape(256, 1, 128) <= (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15 / 2 + 1e-6).all()


def test_fp8_block_scales_are_per_tile():
    w = torch.ones(256, 256)
    w[:128, :128] *= 1000.0  # one loud tile must not cost the others their precision
    q = fake_quant_fp8_groups(w * 1.01, 128, 128)
    assert torch.allclose(q[128:, 128:], torch.full((128, 128), 1.01), rtol=2 ** -4)


def test_weight_plan_touches_only_chosen_layers_and_keeps_embeddings(model):
    original = model.layers[1].mlp.up_proj.weight.clone()
    quant = apply_weight_precision(model, ["none", "int4", "none", "none"], [0, 0, 0, 0])
    assert torch.equal(model.layers[1].mlp.up_proj.weight, original)  # the learner's model is left alone
    assert torch.equal(quant.embed_tokens.weight, model.embed_tokens.weight)
    assert torch.equal(quant.layers[0].mlp.up_proj.weight, model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(quant.layers[1].mlp.up_proj.weight, model.layers[1].mlp.up_proj.weight)
    x = torch.randint(3, 50, (2, 20))
    with torch.no_grad():
        assert torch.equal(quant.layers[0](quant.embed_tokens(x), *_rope(x), None, None),
                           model.layers[0](model.embed_tokens(x), *_rope(x), None, None))


def _rope(x):
    from opd.models.model import rope_cos_sin
    return rope_cos_sin(torch.arange(x.shape[1]).expand_as(x), CFG)


def test_noise_dial_is_monotone_in_logit_error(model):
    x = torch.randint(3, 50, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(x)
        errs = [(apply_weight_precision(model, ["none"] * 4, [s] * 4)(x) - ref).abs().mean().item()
                for s in (0.0, 0.001, 0.01, 0.1)]
    assert errs[0] == 0 and errs[1] < errs[2] < errs[3]


def test_engine_rebuilds_quantized_copy_on_weight_update():
    model = Transformer(CFG).init_weights(torch.Generator().manual_seed(4), std=0.1).eval()
    engine = Engine(model, stop_ids=-1, pad_id=0, plan="w=fp8")
    assert engine.model is not engine.base
    before = engine.model.layers[0].mlp.up_proj.weight.clone()
    new = {k: v * 1.5 if "up_proj" in k else v for k, v in model.state_dict().items()}
    engine.update_weights(new, version=1)
    assert not torch.equal(engine.model.layers[0].mlp.up_proj.weight, before)
    assert engine.generate([[1, 2, 3]], SamplingParams(4), torch.Generator())[0].policy_version == 1


def test_bf16_weight_scheme_matches_a_real_bf16_matmul():
    """w=bf16 computes x_bf16 @ W_bf16 with float32 accumulation; torch's bf16 CPU matmul also accumulates in
    float32 but rounds its output to bf16, so the two agree within one bf16 rounding of the output (2^-8 relative)."""
    g = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 128, generator=g))
    x = torch.randn(8, 128, generator=g)
    ours = quantize_linear(linear, "bf16")(x)
    real = torch.nn.functional.linear(x.bfloat16(), linear.weight.bfloat16()).float()
    assert not torch.equal(ours, linear(x))
    assert ((ours - real).abs() <= 2 ** -8 * ours.abs() + 1e-6).all()
