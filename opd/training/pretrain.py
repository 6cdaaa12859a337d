"""Supervised pretraining of the built-in teacher/student pairs, cached so the demo and tests reuse them.

A pair is two models of one family (architecture) trained on the task's ground-truth completions: a teacher
trained long enough to solve the task, and a student of the same shape stopped early, which leaves room for OPD.
Families: `llama` (plain attention) and `qwen3` (QK-norm), whose different sensitivity to an FP8 KV cache the
later issues measure. Training is deterministic for a given config (which includes the thread count).

Cache: `<cache_dir>/<family>-<role>-<task>-<hash>/`, an HF checkpoint plus `pretrain.json` (the resolved config)
and `eval.json` (held-out accuracy). The hash covers the resolved config and `RECIPE_VERSION`, so a changed
recipe never reuses a stale model. A cache entry that does not match its manifest, whose eval.json is not of
`EvalSchema`'s shape or whose pretrain.json is not this config, is damaged: it is trained again, with a warning.
The cache folder itself ($OPD_CACHE, ~/.cache/opd, or --cache-dir) is checked before any training starts
(`check_cache_dir`): a file, an empty OPD_CACHE or a folder that cannot be written is one line, not a failure to save
after minutes of training.

Shipped pairs: the four default models (both families, both roles, task `chain`, default steps and seed) are part of
the package, `opd/pairs/<cache name>/`, with their manifests (~13 MB together). Training is deterministic on one
machine but not across CPU types (AVX2, AVX-512 and AMX kernels reduce floats in different orders), so models trained
on two machines differ slightly, and so would every table computed from them. For a default config the shipped
entry therefore wins over a cache entry: every machine starts from the same models. A non-default config (other
steps, seed, threads, sizes) has no shipped entry and uses the cache as before; a shipped entry that does not match
its manifest is ignored with a warning. Nothing writes into opd/pairs: `force` and `opd pretrain`, which re-create
the models, train into the cache, and `compare_to_shipped` says whether the result equals the shipped one.
"""
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import torch
import torch.nn.functional as F
from pydantic import Field, ValidationError
from safetensors.torch import load_file
from tqdm import tqdm

from opd.models.checkpoint import MANIFEST, manifest_problem, save_checkpoint
from opd.data.supervised import IGNORE, sft_batch
from opd.io.errors import OpdError, require
from opd.training.evaluate import greedy_accuracy
from opd.io.registry import SHIPPED_DIR, check_cache_dir
from opd.models.model import ModelConfig, Transformer
from opd.io.schema import Schema, parse_json, problem, read_text
from opd.config.sections import FAMILIES
from opd.data.task import get_task, held_out_examples, train_examples
from opd.models.tokenizer import TextTokenizer

RECIPE_VERSION = 1
ROLES = ("teacher", "student")
# Students are teacher-sized but stopped early: smaller models of the llama family did not learn the long-form task
# in 1,000 steps at all (dev/LOG.md), so they could not be distilled up to the teacher either.
MODEL_SIZE = dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
# Student steps sit on a sharp take-off (dev/LOG.md): llama 410 -> 18%, 415 -> 9%, 420 -> 52%; qwen3 470 -> 37%.
DEFAULT_STEPS = {("llama", "teacher"): 1500, ("qwen3", "teacher"): 1500,
                 ("llama", "student"): 420, ("qwen3", "student"): 470}





class EvalSchema(Schema):
    """eval.json of a cache entry: what `opd pretrain` prints and the trainer reads."""
    eval_accuracy: Annotated[float, Field(ge=0, le=1, alias="eval/accuracy")]
    train_params: Annotated[int, Field(ge=0, alias="train/params")]
    train_seconds: Annotated[float, Field(ge=0, allow_inf_nan=False, alias="train/seconds")]


def cached_problem(folder: Path, cfg: "PretrainConfig") -> tuple[str | None, dict]:
    """(None, eval.json) when the cache entry is sound; else (what is wrong, {}): it does not match its manifest,
    its eval.json is not EvalSchema's shape, or its pretrain.json is not cfg."""
    problem_ = manifest_problem(folder)
    if problem_ is not None:
        return problem_, {}
    try:
        result = parse_json(read_text(folder / "eval.json", "eval.json"), "eval.json")
        recorded = parse_json(read_text(folder / "pretrain.json", "pretrain.json"), "pretrain.json")
    except OpdError as e:
        return e.problem, {}
    try:
        EvalSchema.model_validate(result)
    except ValidationError as e:
        return f"eval.json: {problem(e)}", {}
    if recorded != json.loads(json.dumps(cfg.resolved())):
        return "its pretrain.json is another config", {}
    return None, result


@dataclass
class PretrainConfig:
    family: str = "llama"
    role: str = "teacher"
    task: str = "chain"
    steps: int = 0  # 0: the role's default
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    eval_examples: int = 500
    threads: int = 1  # torch threads: part of the config because float reductions depend on it
    model: dict = field(default_factory=dict)  # overrides of MODEL_SIZE

    def __post_init__(self):
        require(self.family in FAMILIES, f"unknown family {self.family!r}", f"use one of {', '.join(FAMILIES)}")
        require(self.role in ROLES, f"unknown role {self.role!r}", f"use one of {', '.join(ROLES)}")
        get_task(self.task)
        self.steps = self.steps or DEFAULT_STEPS[self.family, self.role]
        for name in ("steps", "batch_size", "eval_examples", "threads"):
            require(getattr(self, name) > 0, f"pretrain: {name} must be positive, got {getattr(self, name)}")
        require(self.lr > 0, f"pretrain: lr must be positive, got {self.lr}")

    def model_config(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(arch=self.family, vocab_size=vocab_size, qk_norm=self.family == "qwen3",
                           tie_word_embeddings=True, max_position_embeddings=512, **self.resolved()["model"])

    def resolved(self) -> dict:
        """The config with the model size filled in: what pretrain.json records and the hash covers."""
        return {**asdict(self), "model": {**MODEL_SIZE, **self.model}}

    def cache_name(self) -> str:
        digest = hashlib.sha256(json.dumps([RECIPE_VERSION, self.resolved()], sort_keys=True).encode()).hexdigest()
        return f"{self.family}-{self.role}-{self.task}-{digest[:10]}"


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def sft_step(model: Transformer, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
             lr: float) -> float:
    inputs, targets = batch  # [B, T] each
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    return loss.item()


def train(cfg: PretrainConfig, progress: bool = True) -> tuple[Transformer, TextTokenizer, dict]:
    """Train one model from scratch; returns it with its tokenizer and training stats."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    tok, task = TextTokenizer.builtin(), get_task(cfg.task)
    model = Transformer(cfg.model_config(tok.vocab_size))
    model.init_weights(torch.Generator().manual_seed(cfg.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    stream = train_examples(task, seed=cfg.seed)
    start, losses = time.perf_counter(), []
    bar = tqdm(range(cfg.steps), desc=f"pretrain {cfg.family} {cfg.role}", disable=not progress, leave=False)
    for step in bar:
        batch = sft_batch(tok, [next(stream) for _ in range(cfg.batch_size)])
        losses.append(sft_step(model, opt, batch, lr_at(step, cfg)))
        if step % 20 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    stats = {"train/seconds": time.perf_counter() - start, "train/final_loss": sum(losses[-20:]) / len(losses[-20:]),
             "train/params": model.num_params()}
    return model.eval(), tok, stats


def evaluate(model: Transformer, tok: TextTokenizer, cfg: PretrainConfig) -> dict:
    task = get_task(cfg.task)
    return greedy_accuracy(model, tok, held_out_examples(task, cfg.eval_examples), task.max_new_tokens)


def pretrain(cfg: PretrainConfig, cache_dir: Path | None = None, force: bool = False, progress: bool = True,
             shipped: bool = True) -> tuple[Path, dict]:
    """The checkpoint folder for cfg and its eval.json: the shipped one for a default config (with shipped), else the
    cache entry, training it first if it is not there or damaged. force: train again into the cache (never into the
    shipped folder). shipped=False: ignore the shipped models, as `opd pretrain` does to re-create them."""
    if shipped and not force:
        found = shipped_entry(cfg)
        if found is not None:
            return found
    root = check_cache_dir(cache_dir, write=False)
    folder = root / cfg.cache_name()
    if (folder / "eval.json").is_file() and not force:
        damage, result = cached_problem(folder, cfg)
        if damage is None:
            return folder, result
        print(f"pretrain: the cached {folder.name} is damaged ({damage}): training it again", file=sys.stderr)
    check_cache_dir(root)  # before minutes of training, not at the save after them
    model, tok, stats = train(cfg, progress)
    start = time.perf_counter()
    result = {**evaluate(model, tok, cfg), "eval/seconds": time.perf_counter() - start, **stats}
    save_checkpoint(folder, model, tok, {"pretrain.json": cfg.resolved(), "eval.json": result})
    return folder, result


def shipped_entry(cfg: PretrainConfig, shipped_dir: Path = SHIPPED_DIR) -> tuple[Path, dict] | None:
    """(folder, eval.json) of the shipped model for cfg; None when cfg is not a default config, or (with a warning)
    when the shipped files do not match their manifest. Only read: the folder may be part of a read-only install."""
    folder = shipped_dir / cfg.cache_name()
    if not folder.is_dir():
        return None
    damage, result = cached_problem(folder, cfg) if (folder / MANIFEST).is_file() else (f"{MANIFEST} is missing", {})
    if damage is None:
        return folder, result
    print(f"pretrain: the shipped {folder.name} is damaged ({damage}): using the cache instead (reinstall opd to "
          "restore it)", file=sys.stderr)
    return None


def weight_difference(a: Path, b: Path) -> tuple[bool, float]:
    """(bitwise equal, max |difference|) of the weights of two checkpoint folders, tensor for tensor. Different
    tensor names, shapes or dtypes: (False, inf)."""
    wa, wb = load_file(str(Path(a) / "model.safetensors")), load_file(str(Path(b) / "model.safetensors"))
    if wa.keys() != wb.keys() or any(wa[k].shape != wb[k].shape or wa[k].dtype != wb[k].dtype for k in wa):
        return False, math.inf
    # bytes, not values: -0.0 == 0.0 and NaN != NaN as numbers
    equal = all(torch.equal(wa[k].flatten().view(torch.uint8), wb[k].flatten().view(torch.uint8)) for k in wa)
    diff = max((float((wa[k].double() - wb[k].double()).abs().max()) for k in wa if wa[k].numel()), default=0.0)
    return equal, diff


def compare_to_shipped(cfg: PretrainConfig, folder: Path, result: dict, shipped_dir: Path = SHIPPED_DIR) -> str:
    """One line: does the model re-created for cfg in `folder` (eval.json `result`) equal the shipped one?"""
    if not (shipped_dir / cfg.cache_name()).is_dir():
        return "no shipped model (only the default steps, seed, threads and sizes are shipped)"
    entry = shipped_entry(cfg, shipped_dir)
    if entry is None:
        return "the shipped model is damaged (reinstall opd)"
    equal, diff = weight_difference(folder, entry[0])
    if equal:
        return "equal to the shipped model (bitwise)"
    shipped_accuracy = entry[1]["eval/accuracy"]
    return (f"differs from the shipped model: max |w - w_shipped| {diff:.2g}, accuracy {result['eval/accuracy']:.3f} "
            f"here vs {shipped_accuracy:.3f} shipped (training is deterministic per CPU type, not across AVX2, "
            "AVX-512 and AMX: that is why the pairs are shipped; runs use them)")
