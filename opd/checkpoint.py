"""Hugging Face checkpoint folders: `config.json` + `model.safetensors` (or sharded with an index) + `tokenizer.json`.

Folders we save load in `transformers.AutoModelForCausalLM` and vLLM; Llama, Qwen2 and Qwen3 folders saved by
transformers load here.

Saving is atomic: everything is written and fsynced into a temporary sibling folder `.<name>.tmp-*`, then a manifest
(`opd_manifest.json`: each file's size and SHA-256) is written last, and the folder is renamed into place. A crash
never leaves a half-written checkpoint under the real name. Loading a folder that has a manifest checks every file
against it first, so a checkpoint that was cut short or changed after saving (an interrupted copy, a damaged disk)
is refused with one line instead of being loaded. Folders without a manifest (saved by transformers) load unchecked.
`recover_checkpoint` finishes a save that a crash interrupted between its two renames.

Every JSON file of a folder is read as data (schema.py: UTF-8, no key given twice) and checked against a strict
schema of the keys opd reads (`HFConfig`, `GenerationSchema`, `ManifestSchema`, `IndexSchema`): a wrong type or an
out-of-range value is one line naming the file and the key, never a traceback later or a silent default. Relations
the schemas cannot see are checked by name too: heads that do not divide, ids outside the vocabulary, and the sizes
config.json implies against the shapes in the weights' headers (read before any tensor is built). A malformed
manifest means a damaged checkpoint, like a file that does not match it.
"""
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

import torch
from pydantic import AfterValidator, ConfigDict, Field
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from opd.errors import OpdError, require
from opd.model import ModelConfig, Transformer, empty_model
from opd.rope import check_scaling
from opd.schema import Schema, check, read_json, read_object
from opd.tokenizer import GENERATION_KEYS, TextTokenizer

MANIFEST = "opd_manifest.json"
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


def _inside(name: str) -> str:
    """A file name read from a folder's own index or manifest must name a file of that folder: a name that climbs out
    (`../x`, `/etc/x`) or that the file system cannot take (a NUL, a lone surrogate) is refused, never opened."""
    path = PurePosixPath(name)
    if not name or "\\" in name or "\x00" in name or path.is_absolute() or ".." in path.parts or name in (".", "./"):
        raise ValueError(f"{name!r} must name a file inside the checkpoint folder")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name!r} is not a valid file name") from None
    return name


FileName = Annotated[str, AfterValidator(_inside)]


class ManifestEntry(Schema):
    bytes: Annotated[int, Field(ge=0)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ManifestSchema(Schema):
    """opd_manifest.json, as save_checkpoint writes it (format 1: the only one there is)."""
    format: Literal[1]
    files: dict[FileName, ManifestEntry]


class IndexSchema(Schema):
    """model.safetensors.index.json of a sharded checkpoint: tensor name -> the file holding it."""
    weight_map: dict[str, FileName]


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


def _weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards a sharded checkpoint's index names (each once)."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return [folder / "model.safetensors"]
    where = str(index)
    require(not (folder / "model.safetensors").is_file(), f"checkpoint {folder} has both model.safetensors and "
            "model.safetensors.index.json", "keep one: the single file or the shards with their index")
    data = read_json(index, "index", "fix the index, or save the checkpoint again")
    require(isinstance(data, dict), f"{where}: expected a JSON object, got {type(data).__name__}",
            "fix the index, or save the checkpoint again")
    names = sorted(set(check(IndexSchema, data, where, "fix the index, or save the checkpoint again")
                       .weight_map.values()))
    require(bool(names), f"{where}: its weight_map names no file", "fix the index, or save the checkpoint again")
    return [folder / name for name in names]


def _open(path: Path, folder: Path):
    require(path.is_file(), f"checkpoint {folder} has no {path.name}", "save the weights next to config.json")
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise OpdError(f"cannot read {path}: {e}", "the file is truncated or corrupt; re-save it") from None


def _shapes(folder: Path, files: list[Path]) -> dict[str, tuple]:
    """Every tensor's shape, read from the files' headers only; a tensor in two files is an error (which would
    win depends on the order of reading)."""
    shapes = {}
    for path in files:
        with _open(path, folder) as f:
            for key in f.keys():
                require(key not in shapes, f"checkpoint {folder}: tensor {key} is in two weight files",
                        "remove the duplicate, or save the checkpoint again")
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return {k.removeprefix("model."): v for k, v in shapes.items()}


def _check_sizes(cfg: ModelConfig, shapes: dict[str, tuple], folder: Path) -> None:
    """The sizes config.json names against the weights' own shapes, before any tensor is built: a wrong size is named
    by its key (the generic shape check in load_model only names tensors)."""
    width = lambda name: (shapes.get(name) or (None,))[0]  # noqa: E731 (rows of a weight, None if it is absent)
    expect = [("vocab_size", cfg.vocab_size, width("embed_tokens.weight")),
              ("hidden_size", cfg.hidden_size, (shapes.get("embed_tokens.weight") or (None,))[-1]),
              ("intermediate_size", cfg.intermediate_size, width("layers.0.mlp.gate_proj.weight")),
              ("num_attention_heads x head_dim", cfg.num_heads * cfg.head_dim,
               width("layers.0.self_attn.q_proj.weight")),
              ("num_key_value_heads x head_dim", cfg.num_kv_heads * cfg.head_dim,
               width("layers.0.self_attn.k_proj.weight"))]
    fix = "the weights and config.json disagree: fix config.json, or save the checkpoint again"
    for key, value, actual in expect:
        require(actual is None or actual == value, f"checkpoint {folder}: config.json implies {key} {value}, the "
                f"weights have {actual}", fix)
    layers = {int(k.split(".")[1]) for k in shapes if k.startswith("layers.") and k.split(".")[1].isdigit()}
    require(not layers or layers == set(range(cfg.num_layers)), f"checkpoint {folder}: config.json implies "
            f"num_hidden_layers {cfg.num_layers}, the weights have {len(layers)} layers", fix)


def _read_tensors(folder: Path, files: list[Path], dtype: torch.dtype, device: torch.device) \
        -> dict[str, torch.Tensor]:
    """Every tensor of the weight files, read one at a time and converted to dtype on device, so that loading holds
    one model's worth plus one tensor, never two copies of the model."""
    tensors = {}
    for path in files:
        try:
            with _open(path, folder) as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    require(tensor.is_floating_point(), f"{path}: tensor {key} is {tensor.dtype}, not a floating-point "
                            "weight", "the file does not hold this model's weights (quantized checkpoints are not read)")
                    tensors[key] = tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError, ValueError) as e:
            raise OpdError(f"cannot read {path}: {e}", "the file is truncated or corrupt; re-save it") from None
    return tensors


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(folder: Path) -> dict:
    """The files a folder's manifest lists ({} without one); call it on a verified folder."""
    path = Path(folder) / MANIFEST
    return dict(check(ManifestSchema, read_json(path, MANIFEST), str(path)).files) if path.is_file() else {}


def manifest_problem(folder: Path) -> str | None:
    """None when every file the folder's manifest lists has its recorded size and hash (or there is no manifest);
    otherwise what is wrong, in a few words. A manifest that is not valid JSON or not of ManifestSchema's shape is
    itself damage: the folder was changed after saving."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = read_json(path, MANIFEST)
        require(isinstance(data, dict), f"expected a JSON object, got {type(data).__name__}")
        files = check(ManifestSchema, data, str(path)).files
    except OpdError as e:
        return f"its {MANIFEST} is unreadable ({e.problem.removeprefix(f'{path}: ')})"
    for name, want in files.items():
        file = Path(folder) / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want.bytes:
            return f"{name} has {size} bytes, its manifest says {want.bytes}"
        if _sha256(file) != want.sha256:
            return f"{name} does not match the SHA-256 in its manifest"
    return None


def verify_checkpoint(folder: Path) -> None:
    problem = manifest_problem(folder)
    require(problem is None, f"checkpoint {folder} is damaged or incomplete: {problem}",
            f"it was cut short or changed after saving: copy or save it again, or delete {MANIFEST} if you edited it "
            "on purpose")


def read_config(folder: Path) -> dict:
    """config.json of a checkpoint folder, as a JSON object (its keys are checked by from_hf_config)."""
    path = Path(folder) / "config.json"
    try:
        data = read_json(path, "config.json", CONFIG_FIX)
    except OpdError as e:  # the wording opd has always printed (and scripts may match): "<path> is not valid JSON"
        raise OpdError(e.problem.replace(f"{path}: not valid JSON", f"{path} is not valid JSON"), e.fix) from None
    require(isinstance(data, dict), f"{path}: expected a JSON object, got {type(data).__name__}", CONFIG_FIX)
    return data


def load_model(folder, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Transformer:
    """The checkpoint's model, in dtype on device. It is built on the meta device (no memory, no random init) and
    the file's tensors become its parameters, so loading never holds a second copy of the weights."""
    folder = Path(folder)
    require(folder.is_dir(), f"checkpoint folder not found: {folder}", "check the path, or run `opd pretrain`")
    verify_checkpoint(folder)
    where = str(folder / "config.json")
    cfg = from_hf_config(read_config(folder), where, generation_config(folder))
    files = _weight_files(folder)
    _check_sizes(cfg, _shapes(folder, files), folder)
    model = empty_model(cfg)
    state = {k.removeprefix("model."): v for k, v in _read_tensors(folder, files, dtype, torch.device(device)).items()}
    if cfg.tie_word_embeddings and "lm_head.weight" in state:  # transformers would drop it: only if it is a copy
        require(torch.equal(state["lm_head.weight"], state.get("embed_tokens.weight", state["lm_head.weight"])),
                f"{where}: tie_word_embeddings is true but the weights' lm_head.weight differs from embed_tokens."
                "weight",
                "set tie_word_embeddings to false, or save the checkpoint again")
        state.pop("lm_head.weight")
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    require(not missing and not unexpected,
            f"checkpoint {folder} does not match its config.json: missing {missing[:3]}, unexpected {unexpected[:3]}",
            "the weights and config.json come from different models")
    for k, v in model.state_dict().items():
        if k in state:
            require(state[k].shape == v.shape, f"checkpoint {folder}: tensor {k} has shape {tuple(state[k].shape)}, "
                    f"config.json implies {tuple(v.shape)}", "the weights and config.json disagree")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def generation_config(folder) -> dict:
    """generation_config.json of a checkpoint folder, checked against GenerationSchema ({} when it has none)."""
    return read_object(Path(folder) / "generation_config.json", GenerationSchema,
                       "fix generation_config.json, or delete it to use opd's defaults", optional=True)


# generation_config.json settings opd does not apply, with the value at which that changes nothing: rollouts sample
# from the plain (temperature / top-k / top-p) distribution, since OPD is on-policy; a note names any other value
NOT_APPLIED = {"do_sample": True, "repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
               "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "length_penalty": 1.0, "num_beams": 1}


def note_not_applied(generation: dict, where: str) -> None:
    for key, neutral in NOT_APPLIED.items():
        if generation.get(key, neutral) not in (neutral, None):
            print(f"opd: note: {where}: {key} {generation[key]!r} is not applied (opd samples with temperature, top_k "
                  "and top_p only)", file=sys.stderr)


def load_tokenizer(folder, cfg: ModelConfig) -> TextTokenizer:
    """The folder's tokenizer with every stop id of config.json and generation_config.json, and the generation
    defaults (tokenizer.py)."""
    folder = Path(folder)
    generation = generation_config(folder)
    note_not_applied(generation, str(folder / "generation_config.json"))
    config = read_config(folder)
    stops = stop_ids(config, generation) or [cfg.eos_token_id]
    where = str(folder / "generation_config.json")
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = generation.get(key)
        for i in value if isinstance(value, list) else [value]:
            check_id(i, key, cfg.vocab_size, where)
    defaults = {k: generation[k] for k in GENERATION_KEYS if generation.get(k) is not None}
    pad = config.get("pad_token_id") if config.get("pad_token_id") is not None else generation.get("pad_token_id")
    return TextTokenizer.load(folder, cfg.bos_token_id, stops, pad, defaults)


def load_checkpoint(folder, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") \
        -> tuple[Transformer, TextTokenizer]:
    model = load_model(folder, dtype, device)
    tok = load_tokenizer(folder, model.cfg)
    require(tok.vocab_size <= model.cfg.vocab_size,
            f"checkpoint {folder}: tokenizer has {tok.vocab_size} tokens but the model only {model.cfg.vocab_size}",
            "the tokenizer belongs to another model")
    top = max(tok.vocab().values(), default=0)  # ids need not be dense: one past the embedding would index out of it
    require(top < model.cfg.vocab_size, f"checkpoint {folder}: the tokenizer has token id {top}, past the model's "
            f"vocabulary of {model.cfg.vocab_size}", "the tokenizer belongs to another model")
    return model, tok


def hf_state_dict(state_dict: dict, tied: bool) -> dict:
    """Our parameter names -> the HF checkpoint's (`model.` prefix, no `lm_head` when tied), float32, contiguous."""
    return {(k if k.startswith("lm_head.") else "model." + k): v.detach().float().cpu().contiguous()
            for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}


def save_checkpoint(folder, model: Transformer, tokenizer: TextTokenizer, extra_json: dict | None = None,
                    extra_files: dict[str, bytes] | None = None) -> Path:
    """Write config.json, model.safetensors, tokenizer files, any extra JSON or binary files, and the manifest,
    atomically (see the module docstring)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(to_hf_config(model.cfg), indent=2))
        state = hf_state_dict(model.state_dict(), model.cfg.tie_word_embeddings)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(tmp)
        for name, payload in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(payload, indent=2))
        for name, payload in (extra_files or {}).items():
            (tmp / name).write_bytes(payload)
        files = {}
        for path in sorted(tmp.iterdir()):
            _fsync(path)
            files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        (tmp / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=2))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        _replace_dir(tmp, folder)
        _fsync(folder.parent)
    except (OSError, SafetensorError) as e:  # a full disk, an unwritable folder: one line
        shutil.rmtree(tmp, ignore_errors=True)
        raise OpdError(f"cannot write the checkpoint {folder}: {e}",
                       "free some disk space or choose a writable location; the previous checkpoint is unchanged") \
            from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(src: Path, dst: Path) -> None:
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        dst.rename(old)
    src.rename(dst)  # a crash between the two renames leaves no `dst`: recover_checkpoint repairs that
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_checkpoint(folder) -> None:
    """For the owner of `folder` (a resuming run): finish a save that a crash interrupted, and clear the leftovers.
    If `folder` is missing but a complete copy is beside it (the new one written, or the old one moved aside), that
    copy takes its place: the new one first. Incomplete copies (no manifest yet, or files that do not match it) are
    deleted, never loaded."""
    folder = Path(folder)
    if not folder.parent.is_dir():
        return
    leftovers = [*sorted(folder.parent.glob(f".{folder.name}.tmp-*")),
                 *sorted(folder.parent.glob(f".{folder.name}.old-*"))]
    for candidate in leftovers:
        if not folder.exists() and (candidate / MANIFEST).is_file() and manifest_problem(candidate) is None:
            candidate.rename(folder)
        else:
            shutil.rmtree(candidate, ignore_errors=True)
