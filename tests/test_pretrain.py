"""Shortened pretraining runs: the real recipe at a small size."""
import json
import math

import pytest
import torch

import opd.training.pretrain as pretrain_mod
from opd.models.checkpoint import load_checkpoint
from opd.training.pretrain import PretrainConfig, evaluate, pretrain, train


def test_pretrain_reduces_loss():
    """A short run cuts the completion loss from ln(vocab) to well below it. (Accuracy needs thousands of steps
    even on 3-digit addition; the full runs' accuracies are in docs/pairs.md and dev/LOG.md.)"""
    cfg = PretrainConfig(family="llama", role="student", task="add", steps=200, lr=1e-2)
    _, tok, stats = train(cfg, progress=False)
    assert stats["train/final_loss"] < 0.35 * math.log(tok.vocab_size)


def test_pretrain_is_deterministic_per_seed():
    cfg = PretrainConfig(family="qwen3", role="student", task="chain", steps=4)
    a, _, _ = train(cfg, progress=False)
    b, _, _ = train(cfg, progress=False)
    c, _, _ = train(PretrainConfig(family="qwen3", role="student", task="chain", steps=4, seed=1), progress=False)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.state_dict().values(), c.state_dict().values()))


def test_pretrain_caches_checkpoint_and_results(tmp_path, monkeypatch):
    cfg = PretrainConfig(family="qwen3", role="student", task="add", steps=30, eval_examples=50)
    folder, result = pretrain(cfg, tmp_path, progress=False)
    assert folder.parent == tmp_path and folder.name.startswith("qwen3-student-add-")
    assert json.loads((folder / "eval.json").read_text()) == result
    assert json.loads((folder / "pretrain.json").read_text())["steps"] == 30
    model, tok = load_checkpoint(folder)
    assert model.cfg.qk_norm and evaluate(model, tok, cfg)["eval/accuracy"] == result["eval/accuracy"]

    monkeypatch.setattr(pretrain_mod, "train", lambda *a, **k: pytest.fail("cache hit expected, trained again"))
    assert pretrain(cfg, tmp_path) == (folder, result)
    other = PretrainConfig(family="qwen3", role="student", task="add", steps=31, eval_examples=50)
    assert other.cache_name() != cfg.cache_name()

    weights = folder / "model.safetensors"  # a damaged cache entry is trained again, not loaded
    weights.write_bytes(weights.read_bytes()[:1000])
    monkeypatch.undo()
    again, result_again = pretrain(cfg, tmp_path, progress=False)
    assert again == folder and result_again["eval/accuracy"] == result["eval/accuracy"]
    assert load_checkpoint(folder)[0].cfg.qk_norm
