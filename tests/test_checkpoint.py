"""Checkpoint folders: atomic saves and clear errors for broken ones."""
import hashlib
import json

import pytest
import torch

import opd.models.checkpoint as checkpoint
from opd.models.checkpoint import load_checkpoint, save_checkpoint
from opd.io.errors import OpdError
from opd.models.model import ModelConfig, Transformer
from opd.models.tokenizer import TextTokenizer

CFG = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16)


def tiny(seed=0):
    return Transformer(CFG).init_weights(torch.Generator().manual_seed(seed))


def test_the_manifest_lists_every_file_with_its_size_and_hash(tmp_path):
    folder = save_checkpoint(tmp_path / "ckpt", tiny(), TextTokenizer.builtin(), {"extra.json": {"a": 1}},
                             {"state.bin": b"0123"})
    files = json.loads((folder / checkpoint.MANIFEST).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in folder.iterdir() if p.name != checkpoint.MANIFEST)
    assert files["state.bin"] == {"bytes": 4, "sha256": hashlib.sha256(b"0123").hexdigest()}


@pytest.mark.parametrize("damage, message", [
    ("cut", r"model.safetensors has \d+ bytes, its manifest says \d+"),
    ("flip", "model.safetensors does not match the SHA-256"),
    ("delete", "tokenizer.json is missing"),
    ("edit_config", "config.json does not match"),
    ("bad_manifest", "its opd_manifest.json is unreadable"),
])
def test_a_checkpoint_that_does_not_match_its_manifest_is_never_loaded(tmp_path, damage, message):
    folder = save_checkpoint(tmp_path / "ckpt", tiny(), TextTokenizer.builtin())
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    if damage == "cut":  # what an interrupted copy leaves: a valid header, tensors cut short
        weights.write_bytes(data[:-64])
    elif damage == "flip":  # same size, one bit changed inside a tensor: safetensors itself would load it
        weights.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif damage == "delete":
        (folder / "tokenizer.json").unlink()
    elif damage == "edit_config":
        (folder / "config.json").write_text((folder / "config.json").read_text().replace("1e-06", "1e-05"))
    elif damage == "bad_manifest":
        (folder / checkpoint.MANIFEST).write_text("{")
    with pytest.raises(OpdError, match=f"is damaged or incomplete: {message}"):
        load_checkpoint(folder)


def test_recover_finishes_a_save_interrupted_between_its_renames(tmp_path):
    save_checkpoint(tmp_path / "ckpt", tiny(0), TextTokenizer.builtin())
    (tmp_path / "ckpt").rename(tmp_path / ".ckpt.old-123")  # the old copy moved aside, the new one not yet in place
    new = save_checkpoint(tmp_path / "new", tiny(1), TextTokenizer.builtin())
    new.rename(tmp_path / ".ckpt.tmp-abc")
    half = tmp_path / ".ckpt.tmp-def"  # a save killed before its manifest: never loaded, deleted
    half.mkdir()
    (half / "config.json").write_text("{}")
    checkpoint.recover_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    model, _ = load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(model.embed_tokens.weight, tiny(1).embed_tokens.weight)
    (tmp_path / "ckpt").rename(tmp_path / ".ckpt.old-7")  # only the old copy: it comes back
    checkpoint.recover_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(checkpoint, "save_file", boom)
    with pytest.raises(OpdError, match="cannot write the checkpoint .*ckpt: disk full"):
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
    ("rope_scaling", "rope type 'longrope' is not supported"),
])
def test_broken_checkpoints_are_clear_errors(tmp_path, breakage, message):
    """Folders without a manifest (as transformers saves them) are checked field by field."""
    folder = save_checkpoint(tmp_path / "ckpt", tiny(), TextTokenizer.builtin())
    (folder / checkpoint.MANIFEST).unlink()
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
        (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "longrope"}}))
    with pytest.raises(OpdError, match=message):
        load_checkpoint(folder)
