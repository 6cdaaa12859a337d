"""Helpers shared by several test files (not a test file): running the CLI, tiny checkpoints and training configs,
crash hooks, and tiny float64 models with a sampled batch. Shared fixtures live in conftest.py."""
import contextlib
import subprocess
import sys
from pathlib import Path

import torch

from opd import make_config
from opd.models.checkpoint import save_checkpoint
from opd.config.run import TrainConfig
from opd.config.files import merge
from opd.engines.builtin import Engine
from opd.training.learner import collate
from opd.models.model import ModelConfig, Transformer
from opd.engines.sampling import SamplingParams, process_logits, raw_logprobs
from opd.models.tokenizer import TextTokenizer

# ---- the CLI in a subprocess -----------------------------------------------------------------------------------------

def opd(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "opd.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("opd: error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ---- tiny checkpoints and training runs on them ----------------------------------------------------------------------

TINY = dict(arch="llama", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
            head_dim=16, tie_word_embeddings=True, max_position_embeddings=64)


def make_checkpoint(folder: Path, seed: int, vocab_size: int = 100, **overrides) -> Path:
    cfg = ModelConfig(vocab_size=vocab_size, **(TINY | overrides))
    save_checkpoint(folder, Transformer(cfg).init_weights(torch.Generator().manual_seed(seed), std=0.2),
                    TextTokenizer.builtin())
    return folder


def config(pair, **overrides) -> TrainConfig:
    """A small run of the pair; overrides as opd.make_config takes them (sections as dicts, `async_` for async)."""
    student, teacher = pair
    values = dict(student=str(student), teacher=dict(path=str(teacher)), task="add", steps=6, batch_size=4,
                  eval=dict(every=0, examples=8), save_every=3, threads=1, plan="")
    return make_config(**merge(values, overrides))


def crash_at(at_step: int):
    """An on_step hook that raises (a simulated crash) after step `at_step` is logged."""
    def crash(step, run):
        if step == at_step:
            raise RuntimeError("simulated crash")
    return crash


def comparable(rows):
    """Metric lines without the values that depend on timing: wall-clock ones, and the async queue depth (how many
    batches were ready)."""
    return [{k: v for k, v in row.items() if not k.startswith(("time", "throughput")) and k != "async/queue_depth"}
            for row in rows]


def same_as_sync(rows, sync) -> bool:
    """An async run's metric lines equal the sync run's on every metric the sync run has (the async ones aside)."""
    return len(rows) == len(sync) and \
        comparable(sync) == [{k: v for k, v in row.items() if k in s} for row, s in zip(comparable(rows), sync)]


# ---- tiny float64 models, a batch they sampled, and what the engine drew from ----------------------------------------

def tiny(seed: int, vocab: int = 40, tied: bool = True, **overrides) -> Transformer:
    cfg = ModelConfig(arch="qwen3", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8, qk_norm=True, tie_word_embeddings=tied, **overrides)
    return Transformer(cfg).init_weights(torch.Generator().manual_seed(seed), std=0.3).double()


def batch_of(model: Transformer, n: int = 6, new_tokens: int = 7, eos: int = 2):
    engine = Engine(model, eos, 0)
    prompts = [[1] + [3 + (i * 7 + j) % 30 for j in range(2 + i % 4)] for i in range(n)]
    rollouts = engine.generate(prompts, SamplingParams(new_tokens, temperature=1.0), 3, return_hidden=True)
    batch = collate(rollouts, 0)
    batch.mu = batch.mu.double() + 0.05 * batch.mask  # a sampler a little off the learner
    return batch, engine


def grads(model: Transformer) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def recorded_distributions(engine: Engine, raw: bool = False):
    """Record the processed log-probs [B, V] of every step an engine samples from (what it drew each token from), or
    with raw=True the tempered, untruncated ones (sampling.raw_logprobs: what the exact KL compares with the trainer).
    Yields dists(batch) -> [B, N, V] aligned with learner.collate's batch of the records."""
    steps, step = [], engine._step

    def record(logits, params, generator, given=None):
        if raw:
            steps.append(raw_logprobs(logits, params))
        else:
            steps.append(process_logits(logits, params) if params.reshapes_distribution else logits.float().log_softmax(-1))
        return step(logits, params, generator, given)
    engine._step = record
    try:
        yield lambda batch: torch.stack(steps, 1)[:, :batch.tokens.shape[1]]
    finally:
        engine._step = step
