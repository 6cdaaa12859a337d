"""Our model vs transformers' own implementation on the same checkpoint (the parity oracle)."""
import pytest
import torch
import transformers

from opd.models.checkpoint import load_checkpoint, save_checkpoint
from opd.engines.builtin import Engine
from opd.engines.naive import naive_greedy
from opd.models.model import ModelConfig, Transformer
from opd.engines.sampling import SamplingParams
from opd.models.tokenizer import TextTokenizer

VOCAB = 100
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=5000.0, tie_word_embeddings=False, attention_bias=True,
        mlp_bias=True, max_position_embeddings=256, initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=256, initializer_range=0.25,
        bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, rope_theta=1e6, tie_word_embeddings=True,
        max_position_embeddings=256, initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def hf_random_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[arch](), dtype=torch.float32).eval()
    with torch.no_grad():  # HF zero-inits biases and unit-inits norms: randomise them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def random_ids(seed: int, batch: int = 3, length: int = 17) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, prompts, n):
    """The engine at temperature 0, with no eos (-1), so every continuation runs n tokens."""
    rollouts = Engine(model, stop_ids=-1, pad_id=0).generate(prompts, SamplingParams(n, temperature=0.0),
                                                            torch.Generator())
    return [r.completion_ids for r in rollouts]


@pytest.fixture(params=list(HF_CONFIGS))
def hf_folder(request, tmp_path):
    hf = hf_random_model(request.param)
    hf.save_pretrained(tmp_path)
    TextTokenizer.builtin().save(tmp_path)
    return request.param, hf, tmp_path


def test_parity_logits_hf_save_our_load(hf_folder):
    arch, hf, folder = hf_folder
    ours, _ = load_checkpoint(folder)
    assert ours.cfg.arch == arch
    ids = random_ids(1)
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"{arch}: max |logit diff| {diff}"


def test_parity_greedy_continuations(hf_folder):
    arch, hf, folder = hf_folder
    ours, _ = load_checkpoint(folder)
    prompts = [random_ids(2, 1, n)[0].tolist() for n in (5, 9, 12)]
    ours_out = greedy(ours, prompts, 20)
    for prompt, got in zip(prompts, ours_out):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref, f"{arch}: greedy continuation differs from transformers"


OUR_CONFIGS = {  # each architecture's distinguishing switches, with untied and tied embeddings both covered
    "llama": dict(qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=False, num_kv_heads=1),
    "qwen2": dict(qkv_bias=True, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(qk_norm=True, tie_word_embeddings=False, head_dim=24),
}


@pytest.mark.parametrize("arch", list(OUR_CONFIGS))
def test_parity_our_save_hf_load(arch, tmp_path):
    cfg = ModelConfig(arch=arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=3,
                      num_heads=4, **{"num_kv_heads": 2, "head_dim": 16, **OUR_CONFIGS[arch]})
    ours = Transformer(cfg).init_weights(torch.Generator().manual_seed(3), std=0.1)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    save_checkpoint(tmp_path / "ckpt", ours, TextTokenizer.builtin())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    assert type(hf).__name__.lower().startswith(arch)
    ids = random_ids(4)
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"{arch}: max |logit diff| {diff}"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert tok("12+34=").input_ids == TextTokenizer.builtin().encode_prompt("12+34=")  # <bos> included


SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0)
VARIANTS = {  # architecture switches that change the computation: RoPE scaling, sliding windows, head_dim
    "llama-llama3-rope": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama-linear-rope-head_dim": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=1, head_dim=24,
        max_position_embeddings=256, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 3.0}),
    "qwen2-dynamic-rope": lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=2, max_position_embeddings=24,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
    "qwen3-yarn-rope": lambda: transformers.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                      "original_max_position_embeddings": 32}),
    "qwen2-sliding-window": lambda: transformers.Qwen2Config(**SMALL, num_key_value_heads=1, max_position_embeddings=256,
        use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "qwen3-sliding-window-yarn": lambda: transformers.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=24,
        max_position_embeddings=128, use_sliding_window=True, sliding_window=5, max_window_layers=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0, "original_max_position_embeddings": 64,
                         "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5}),
}


@pytest.fixture(params=list(VARIANTS))
def variant(request, tmp_path):
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(VARIANTS[request.param](), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    TextTokenizer.builtin().save(tmp_path)
    return request.param, hf, tmp_path


def test_parity_variants_logits_cached_and_uncached(variant):
    """Each variant against transformers on 40-token sequences (beyond every window and original context): the
    uncached forward's logits, greedy decoding with the KV cache (one prompt at a time: dynamic RoPE scales with the
    batch's longest sequence, in transformers too), and our cached decoding against our uncached loop (except for
    dynamic RoPE, whose cached keys keep the rotation of the length at which they were cached, in transformers too:
    there cached and uncached decoding differ by design)."""
    name, hf, folder = variant
    ours, _ = load_checkpoint(folder)
    assert ours.cfg.rope_scaling or ours.cfg.layer_types or ours.cfg.head_dim != 16, name
    ids = random_ids(11, 2, 40)
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"{name}: max |logit diff| {diff}"
    for prompt in (random_ids(12, 1, 9)[0].tolist(), random_ids(13, 1, 14)[0].tolist()):
        got = greedy(ours, [prompt], 26)[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=26, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref, f"{name}: cached greedy decoding differs from transformers"
        if "dynamic" not in name:  # dynamic RoPE: cached keys keep the rotation of the length they were made at
            assert got == naive_greedy(ours, prompt, 26, eos_id=-1), f"{name}: cached != uncached"


def test_parity_variants_round_trip(variant, tmp_path):
    """Our saved config.json carries the scaling and the windows: transformers reads back the same model."""
    name, hf, folder = variant
    ours, tok = load_checkpoint(folder)
    save_checkpoint(tmp_path / "again", ours, tok)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    ids = random_ids(14, 2, 40)
    with torch.no_grad():
        assert (again(ids).logits - hf(ids).logits).abs().max().item() <= 1e-5, name


def test_unsupported_config_fields_are_refused_by_name(tmp_path):
    import json
    from opd.io.errors import OpdError
    hf = hf_random_model("qwen3")
    hf.save_pretrained(tmp_path)
    TextTokenizer.builtin().save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for change, message in (({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
                            ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
                            ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "ntk_alpha": 2}},
                             "unexpected key 'rope_parameters.ntk_alpha'"),
                            ({"layer_types": ["chunked_attention"] * 3, "sliding_window": 4,
                              "use_sliding_window": True}, "'chunked_attention'"),
                            ({"use_sliding_window": True, "sliding_window": None}, "without a sliding_window")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(OpdError, match=message):
            load_checkpoint(tmp_path)


def test_cached_decoding_equals_uncached_oracle():
    """Batched, left-padded, KV-cached greedy decoding == the naive loop that re-runs the whole context."""
    model = Transformer(ModelConfig(arch="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True))
    model.init_weights(torch.Generator().manual_seed(5), std=0.2).eval()
    prompts = [random_ids(6, 1, n)[0].tolist() for n in (3, 11, 7, 1)]
    batched = greedy(model, prompts, 24)
    for prompt, got in zip(prompts, batched):
        assert got == naive_greedy(model, prompt, 24, eos_id=-1)


def test_parity_sharded_bf16_checkpoint(tmp_path):
    """Real checkpoints come sharded (model.safetensors.index.json) and in bfloat16."""
    hf = hf_random_model("qwen3").to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    TextTokenizer.builtin().save(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    ours, _ = load_checkpoint(tmp_path)
    assert next(ours.parameters()).dtype == torch.float32
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = random_ids(7)
    with torch.no_grad():
        diff = (ours(ids) - reloaded(ids).logits).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (4, 1)])
def test_decode_attention_matches_sdpa(heads, kv_heads):
    import torch.nn.functional as F
    from opd.models.model import decode_attention
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q, k, v = (torch.randn(3, h, t, 16, generator=g) for h, t in ((heads, 1), (kv_heads, 9), (kv_heads, 9)))
    mask = torch.rand(3, 1, 1, 9, generator=g) > 0.3
    mask[..., -1] = True  # the token itself is always visible
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
    assert torch.allclose(decode_attention(q, k, v, mask), want, atol=1e-6)
