"""Hugging Face checkpoint folders: `config.json` + `model.safetensors` (or sharded with an index) + `tokenizer.json`.

Folders we save load in `transformers.AutoModelForCausalLM` and vLLM; Llama, Qwen2 and Qwen3 folders saved by
transformers load here.

Saving is atomic: everything is written and fsynced into a temporary sibling folder `.<name>.tmp-*`, then a manifest
(`opd_manifest.json`: each file's size and SHA-256) is written last, and the folder is renamed into place. A crash
never leaves a half-written checkpoint under the real name. Loading a folder that has a manifest checks every file
against it first, so a checkpoint that was cut short or changed after saving (an interrupted copy, a damaged disk)
is refused with one line instead of being loaded. Folders without a manifest (saved by transformers) load unchecked.
`recover_checkpoint` finishes a save that a crash interrupted between its two renames.
"""
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from opd.errors import OpdError, require
from opd.model import ModelConfig, Transformer, empty_model
from opd.rope import check_scaling
from opd.tokenizer import GENERATION_KEYS, TextTokenizer

MANIFEST = "opd_manifest.json"
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


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


def rope_settings(d: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, the scaling parameters) from a config's `rope_parameters` (transformers 5) or `rope_scaling` and
    top-level `rope_theta`/`partial_rotary_factor` (earlier); refuses what rope.py does not compute."""
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
    return theta, rope


def attention_layers(d: dict, arch: str, layers: int, where: str) -> tuple[int, tuple]:
    """(sliding_window, layer_types): Qwen2/Qwen3's `layer_types`, or sliding from `max_window_layers` on when
    `use_sliding_window` (as transformers derives it); Llama has none."""
    if arch == "llama" or not (d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or [])):
        return 0, ()
    window = d.get("sliding_window")
    require(isinstance(window, int) and window > 0, f"{where}: sliding-window attention without a sliding_window",
            "set sliding_window to the window's length, or use_sliding_window to false")
    types = d.get("layer_types") or ["sliding_attention" if i >= d.get("max_window_layers", layers) else
                                     "full_attention" for i in range(layers)]
    return window, tuple(types)


def from_hf_config(d: dict, where: str = "config.json", generation: dict | None = None) -> ModelConfig:
    """Our ModelConfig from an HF config.json (and the generation config, whose eos_token_id is used when the
    config names none). Every field that changes what the model computes is read or refused by name."""
    require(isinstance(d, dict), f"{where}: expected a JSON object", "re-create the file")
    arch = d.get("model_type")
    require(arch in HF_CLASSES, f"{where}: model_type {arch!r} is not supported",
            f"opd reads {', '.join(HF_CLASSES)} checkpoints")
    require(d.get("hidden_act", "silu") == "silu", f"{where}: hidden_act {d.get('hidden_act')!r} is not supported",
            "only silu (SwiGLU) MLPs are implemented")
    theta, scaling = rope_settings(d, where)
    eos = stop_ids(d, generation or {})
    require(bool(eos), f"{where}: no eos_token_id", "generation needs it: add eos_token_id to config.json")
    try:
        heads, layers = d["num_attention_heads"], d["num_hidden_layers"]
        bias = bool(d.get("attention_bias", False))
        window, types = attention_layers(d, arch, layers, where)
        return ModelConfig(
            arch=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=layers, num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=theta, rope_scaling=scaling, sliding_window=window, layer_types=types,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            qkv_bias=True if arch == "qwen2" else bias, o_bias=False if arch == "qwen2" else bias,
            mlp_bias=bool(d.get("mlp_bias", False)) if arch == "llama" else False, qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos[0],
            pad_token_id=d.get("pad_token_id") if d.get("pad_token_id") is not None else eos[0])
    except KeyError as e:
        raise OpdError(f"{where}: missing field {e.args[0]!r}", "the file is not a complete model config") from None


def stop_ids(config: dict, generation: dict) -> list[int]:
    """Every stop token id: config.json's eos_token_id (an id or a list), then generation_config.json's, in order,
    each once."""
    out = []
    for source in (config, generation):
        value = source.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in out:
                out.append(i)
    return out


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise OpdError(f"{what} not found: {path}", "check the path")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpdError(f"{path} is not valid JSON ({e})", "re-create the file") from None


def _read_tensors(folder: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors file(s), read one at a time and converted to dtype on device, so that
    loading holds one model's worth plus one tensor, never two copies of the model."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(read_json(index, "index").get("weight_map", {}).values())) if index.is_file() \
        else ["model.safetensors"]
    tensors = {}
    for name in files:
        path = folder / name
        require(path.is_file(), f"checkpoint {folder} has no {name}", "save the weights next to config.json")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key).to(device=device, dtype=dtype)
        except (SafetensorError, OSError, ValueError) as e:
            raise OpdError(f"cannot read {path}: {e}", "the file is truncated or corrupt; re-save it") from None
    return tensors


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_problem(folder: Path) -> str | None:
    """None when every file the folder's manifest lists has its recorded size and hash (or there is no manifest);
    otherwise what is wrong, in a few words."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for name, want in files.items():
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, its manifest says {want['bytes']}"
        if _sha256(file) != want["sha256"]:
            return f"{name} does not match the SHA-256 in its manifest"
    return None


def verify_checkpoint(folder: Path) -> None:
    problem = manifest_problem(folder)
    require(problem is None, f"checkpoint {folder} is damaged or incomplete: {problem}",
            f"it was cut short or changed after saving: copy or save it again, or delete {MANIFEST} if you edited it "
            "on purpose")


def load_model(folder, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Transformer:
    """The checkpoint's model, in dtype on device. It is built on the meta device (no memory, no random init) and
    the file's tensors become its parameters, so loading never holds a second copy of the weights."""
    folder = Path(folder)
    require(folder.is_dir(), f"checkpoint folder not found: {folder}", "check the path, or run `opd pretrain`")
    verify_checkpoint(folder)
    cfg = from_hf_config(read_json(folder / "config.json", "config.json"), str(folder / "config.json"),
                         generation_config(folder))
    model = empty_model(cfg)
    state = {k.removeprefix("model."): v for k, v in _read_tensors(folder, dtype, torch.device(device)).items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
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
    """generation_config.json of a checkpoint folder ({} when it has none)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    data = read_json(path, "generation_config.json")
    require(isinstance(data, dict), f"{path}: expected a JSON object", "re-create the file")
    return data


def load_tokenizer(folder, cfg: ModelConfig) -> TextTokenizer:
    """The folder's tokenizer with every stop id of config.json and generation_config.json, and the generation
    defaults (tokenizer.py)."""
    folder = Path(folder)
    generation = generation_config(folder)
    config = read_json(folder / "config.json", "config.json")
    stops = stop_ids(config, generation) or [cfg.eos_token_id]
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
