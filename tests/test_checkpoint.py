"""Checkpoint folders: atomic saves and clear errors for broken ones."""
import json

import pytest
import torch

import opd.checkpoint as checkpoint
from opd.checkpoint import load_checkpoint, save_checkpoint
from opd.errors import OpdError
from opd.model import ModelConfig, Transformer
from opd.tokenizer import TextTokenizer

CFG = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16)


def tiny(seed=0):
    return Transformer(CFG).init_weights(torch.Generator().manual_seed(seed))


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint, "save_file", boom)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path / "ckpt", tiny(), TextTokenizer.builtin())
    assert list(tmp_path.iterdir()) == []


def test_save_replaces_an_existing_checkpoint_whole(tmp_path):
    save_checkpoint(tmp_path / "ckpt", tiny(0), TextTokenizer.builtin(), {"extra.json": {"a": 1}})
    save_checkpoint(tmp_path / "ckpt", tiny(1), TextTokenizer.builtin())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert not (tmp_path / "ckpt" / "extra.json").exists()
    model, _ = load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(model.embed_tokens.weight, tiny(1).embed_tokens.weight)


@pytest.mark.parametrize("breakage, message", [
    ("no_tokenizer", "has no tokenizer.json"),
    ("bad_json", "is not valid JSON"),
    ("wrong_shape", "config.json implies"),
    ("no_eos", "no eos_token_id"),
    ("rope_scaling", "rope type 'yarn' is not supported"),
])
def test_broken_checkpoints_are_clear_errors(tmp_path, breakage, message):
    folder = save_checkpoint(tmp_path / "ckpt", tiny(), TextTokenizer.builtin())
    config = json.loads((folder / "config.json").read_text())
    if breakage == "no_tokenizer":
        (folder / "tokenizer.json").unlink()
    elif breakage == "bad_json":
        (folder / "config.json").write_text("{not json")
    elif breakage == "wrong_shape":
        (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    elif breakage == "no_eos":
        (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    elif breakage == "rope_scaling":
        (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "yarn"}}))
    with pytest.raises(OpdError, match=message):
        load_checkpoint(folder)
