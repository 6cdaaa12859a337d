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
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

import torch
from pydantic import AfterValidator, Field
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from opd.io import wire
from opd.io.errors import OpdError, require
from opd.io.registry import sha256_of
from opd.models.hf_config import CONFIG_FIX, GenerationSchema, check_id, from_hf_config, stop_ids, to_hf_config
from opd.models.model import ModelConfig, Transformer, empty_model
from opd.io.schema import Schema, check, read_json, read_object
from opd.models.tokenizer import GENERATION_KEYS, TextTokenizer

MANIFEST = "opd_manifest.json"

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
        if sha256_of(file) != want.sha256:
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
                    extra_files: dict[str, bytes] | None = None, extra_trees: dict | None = None) -> Path:
    """Write config.json, model.safetensors, tokenizer files, any extra JSON or binary files, any trees of tensors
    (wire.encode_file, streamed to disk), and the manifest, atomically (see the module docstring)."""
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
        for name, tree in (extra_trees or {}).items():
            wire.encode_file(tree, tmp / name)
        files = {}
        for path in sorted(tmp.iterdir()):
            _fsync(path)
            files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
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
