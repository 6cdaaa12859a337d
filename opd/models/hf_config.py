"""A checkpoint's config.json and generation_config.json as opd reads and writes them: strict schemas of the keys opd
reads (`HFConfig`, `GenerationSchema`: types and the ranges transformers gives them), the mapping from an HF config to
opd's ModelConfig and back (architecture, attention layout, RoPE parameters), and the stop ids. checkpoint.py reads and
writes the folders.
"""
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from opd.io.errors import require
from opd.models.model import ModelConfig
from opd.models.rope import check_scaling
from opd.io.schema import Schema, check

HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CONFIG_FIX = "fix config.json, or save the checkpoint again"

# --- the schemas of a folder's JSON files: the keys opd reads, with the types and ranges transformers gives them.
# Sizes are capped at 2^31 - 1: no real dimension comes near, and a product of two stays inside the int64 sizes torch
# computes (a larger one would overflow there instead of being named here). null is accepted where transformers writes
# it (optional ids, head_dim, sliding_window, the rope fields).
Size = Annotated[int, Field(gt=0, le=(1 << 31) - 1)]
TokenId = Annotated[int, Field(ge=0, le=(1 << 31) - 1)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Theta = Annotated[float, Field(gt=1, allow_inf_nan=False)]  # a base <= 1 does not rotate (1) or inverts the scales


class RopeSchema(Schema):
    model_config = ConfigDict(strict=True, extra="forbid")  # a key rope.py does not compute is refused by name
    """`rope_parameters` / `rope_scaling`; which keys a type needs, and unknown ones, are rope.py's check_scaling."""
    rope_type: str | None = None
    type: str | None = None
    rope_theta: Theta | None = None
    factor: Positive | None = None
    original_max_position_embeddings: Size | None = None
    low_freq_factor: Positive | None = None
    high_freq_factor: Positive | None = None
    beta_fast: Positive | None = None
    beta_slow: Positive | None = None
    mscale: NonNegative | None = None  # >= 0: a negative one can make YaRN's attention factor divide by zero
    mscale_all_dim: NonNegative | None = None
    attention_factor: Positive | None = None
    truncate: bool | None = None
    partial_rotary_factor: Finite | None = None


class HFConfig(Schema):
    """config.json of a Llama / Qwen2 / Qwen3 checkpoint."""
    model_type: str
    vocab_size: Size
    hidden_size: Size
    intermediate_size: Size
    num_hidden_layers: Size
    num_attention_heads: Size
    num_key_value_heads: Size | None = None
    head_dim: Size | None = None
    hidden_act: str = "silu"
    rms_norm_eps: Positive = 1e-6
    max_position_embeddings: Size = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: Theta | None = None
    rope_parameters: RopeSchema | None = None
    rope_scaling: RopeSchema | None = None
    partial_rotary_factor: Finite | None = None
    use_sliding_window: bool | None = None
    sliding_window: Size | None = None
    max_window_layers: Annotated[int, Field(ge=0)] | None = None
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    bos_token_id: TokenId | None = None
    eos_token_id: TokenId | list[TokenId] | None = None
    pad_token_id: TokenId | None = None


class GenerationSchema(Schema):
    """generation_config.json: the defaults opd applies (ranges as SamplingParams checks them) and the stop ids."""
    temperature: NonNegative | None = None
    top_k: Annotated[int, Field(ge=0, le=(1 << 31) - 1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    max_new_tokens: Size | None = None
    do_sample: bool | None = None
    eos_token_id: TokenId | list[TokenId] | None = None
    pad_token_id: TokenId | None = None
    bos_token_id: TokenId | None = None


def to_hf_config(cfg: ModelConfig) -> dict:
    if cfg.arch == "qwen2":
        require(cfg.qkv_bias and not cfg.o_bias and not cfg.mlp_bias and not cfg.qk_norm,
                "a qwen2 model has q/k/v bias only and no QK-norm")
    else:
        require(cfg.qkv_bias == cfg.o_bias, f"{cfg.arch}: q/k/v and o biases must match (attention_bias)")
        require(cfg.qk_norm == (cfg.arch == "qwen3"), "QK-norm is what distinguishes qwen3 from llama")
        require(not (cfg.mlp_bias and cfg.arch == "qwen3"), "qwen3 has no MLP bias")
    require(cfg.arch != "llama" or not cfg.layer_types, "llama has no sliding-window attention")
    out = {
        "architectures": [HF_CLASSES[cfg.arch]], "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", **cfg.rope_scaling, "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id, "torch_dtype": "float32",
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        # transformers reads a folder without it as an old Mistral one and warns of a wrong tokenizer regex
        "transformers_version": _transformers_version(),
    }
    if cfg.arch != "qwen2":
        out["attention_bias"] = cfg.qkv_bias
    if cfg.arch == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    else:
        sliding = [i for i in range(cfg.num_layers) if cfg.sliding(i)]
        out.update(use_sliding_window=bool(sliding), sliding_window=cfg.sliding_window or None,
                   max_window_layers=sliding[0] if sliding else cfg.num_layers,
                   layer_types=list(cfg.layer_types) or ["full_attention"] * cfg.num_layers)
    return out


def _transformers_version() -> str:
    from importlib.metadata import version
    return version("transformers")  # a dependency of opd (pyproject.toml)


def rope_settings(d: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, the scaling parameters) from a config's `rope_parameters` (transformers 5) or `rope_scaling` and
    top-level `rope_theta`/`partial_rotary_factor` (earlier); refuses what rope.py does not compute. d: checked
    against HFConfig."""
    require(not (d.get("rope_parameters") and d.get("rope_scaling")), f"{where}: both rope_parameters and "
            "rope_scaling are given", "keep one of them (transformers would merge them)")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    require(not any(isinstance(v, dict) for v in rope.values()), f"{where}: per-layer-type RoPE is not supported",
            "give one rope_parameters mapping")
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    if d.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    theta = float(rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    if rope.get("rope_type", "default") == "default":
        rope = {k: v for k, v in rope.items() if k == "partial_rotary_factor"}
    check_scaling(rope, where)
    rope.pop("partial_rotary_factor", None)
    if rope.get("rope_type") == "llama3":  # the smoothing band divides by their difference
        require(rope["high_freq_factor"] > rope["low_freq_factor"], f"{where}: rope high_freq_factor "
                f"{rope['high_freq_factor']} must be greater than low_freq_factor {rope['low_freq_factor']}",
                CONFIG_FIX)
    return theta, rope


def attention_layers(c: HFConfig, arch: str, where: str) -> tuple[int, tuple]:
    """(sliding_window, layer_types): Qwen2/Qwen3's `layer_types`, or sliding from `max_window_layers` on when
    `use_sliding_window` (as transformers derives it); Llama has none."""
    if arch == "llama" or not (c.use_sliding_window or "sliding_attention" in (c.layer_types or [])):
        return 0, ()
    layers = c.num_hidden_layers
    require(c.sliding_window is not None, f"{where}: sliding-window attention without a sliding_window",
            "set sliding_window to the window's length, or use_sliding_window to false")
    first = layers if c.max_window_layers is None else c.max_window_layers
    types = c.layer_types or ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return c.sliding_window, tuple(types)


def from_hf_config(d: dict, where: str = "config.json", generation: dict | None = None) -> ModelConfig:
    """Our ModelConfig from an HF config.json (and the generation config, whose eos_token_id is used when the
    config names none). Every field that changes what the model computes is read or refused by name: its type and
    range by HFConfig, the relations between fields (heads, layers, ids inside the vocabulary) here."""
    require(isinstance(d, dict), f"{where}: expected a JSON object, got {type(d).__name__}", CONFIG_FIX)
    arch = d.get("model_type")
    require(isinstance(arch, str) and arch in HF_CLASSES, f"{where}: model_type {arch!r:.40} is not supported",
            f"opd reads {', '.join(HF_CLASSES)} checkpoints")
    c = check(HFConfig, d, where, CONFIG_FIX)
    require(c.hidden_act == "silu", f"{where}: hidden_act {c.hidden_act!r} is not supported",
            "only silu (SwiGLU) MLPs are implemented")
    theta, scaling = rope_settings(d, where)
    eos = stop_ids(d, generation or {})
    require(bool(eos), f"{where}: no eos_token_id", "generation needs it: add eos_token_id to config.json")
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    require(c.head_dim is not None or c.hidden_size % heads == 0, f"{where}: hidden_size {c.hidden_size} is not a "
            f"multiple of num_attention_heads {heads} and there is no head_dim", "set head_dim, or fix the sizes")
    head_dim = c.head_dim or c.hidden_size // heads
    require(heads % kv_heads == 0, f"{where}: num_key_value_heads {kv_heads} does not divide num_attention_heads "
            f"{heads}", CONFIG_FIX)
    require(head_dim % 2 == 0 and (head_dim > 2 or scaling.get("rope_type") != "dynamic"),
            f"{where}: head_dim {head_dim} cannot be rotated (RoPE needs an even head_dim, above 2 for dynamic RoPE)",
            CONFIG_FIX)
    require(c.layer_types is None or len(c.layer_types) == c.num_hidden_layers, f"{where}: layer_types names "
            f"{len(c.layer_types or [])} layers, num_hidden_layers is {c.num_hidden_layers}", CONFIG_FIX)
    for key in ("bos_token_id", "pad_token_id"):
        check_id(getattr(c, key), key, c.vocab_size, where)
    for i in eos:
        check_id(i, "eos_token_id", c.vocab_size, where)
    window, types = attention_layers(c, c.model_type, where)
    bias = c.attention_bias
    return ModelConfig(
        arch=c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling, sliding_window=window, layer_types=types, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        qkv_bias=True if c.model_type == "qwen2" else bias, o_bias=False if c.model_type == "qwen2" else bias,
        mlp_bias=c.mlp_bias if c.model_type == "llama" else False, qk_norm=c.model_type == "qwen3",
        bos_token_id=c.bos_token_id, eos_token_id=eos[0],
        pad_token_id=c.pad_token_id if c.pad_token_id is not None else eos[0])


def check_id(token_id: int | None, key: str, vocab_size: int, where: str) -> None:
    """A special token id must be a row of the embedding: a pad or bos id past it would index out of range."""
    require(token_id is None or token_id < vocab_size, f"{where}: {key} {token_id} is outside the vocabulary "
            f"(vocab_size {vocab_size})", "fix the id, or the checkpoint belongs to another model")


def stop_ids(config: dict, generation: dict) -> list[int]:
    """Every stop token id: config.json's eos_token_id (an id or a list), then generation_config.json's, in order,
    each once. Both are checked (HFConfig, GenerationSchema) before they get here."""
    out = []
    for source in (config, generation):
        value = source.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in out:
                out.append(i)
    return out
