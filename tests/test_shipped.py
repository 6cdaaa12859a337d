"""The shipped pretrained pairs (opd/pairs): sound, used for the default configs, never written, and compared with a
re-created model by `opd pretrain`."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import opd.training.pretrain as pretrain_mod
from opd.models.checkpoint import MANIFEST, manifest_problem
from opd.cli import main
from opd.io.errors import OpdError
from opd.io.registry import SHIPPED_DIR
from opd.training.pretrain import (FAMILIES, ROLES, PretrainConfig, cached_problem, compare_to_shipped, pretrain,
                          shipped_entry, weight_difference)

DEFAULTS = [PretrainConfig(family=f, role=r) for f in FAMILIES for r in ROLES]


def snapshot(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def copy_shipped(cfg, dest):
    return shutil.copytree(SHIPPED_DIR / cfg.cache_name(), dest / cfg.cache_name())


@pytest.mark.parametrize("cfg", DEFAULTS, ids=lambda c: f"{c.family}-{c.role}")
def test_each_default_model_is_shipped_and_matches_its_manifest(cfg):
    folder = SHIPPED_DIR / cfg.cache_name()
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)  # no file unlisted
    assert manifest_problem(folder) is None and cached_problem(folder, cfg)[0] is None
    assert sorted(p.name for p in SHIPPED_DIR.iterdir()) == sorted(c.cache_name() for c in DEFAULTS)


def test_pretrain_returns_the_shipped_model_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain_mod, "train", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("trained")))
    before = {c.cache_name(): snapshot(SHIPPED_DIR / c.cache_name()) for c in DEFAULTS}
    for cfg in DEFAULTS:
        folder, result = pretrain(cfg, tmp_path)
        assert folder == SHIPPED_DIR / cfg.cache_name()
        assert result == json.loads((folder / "eval.json").read_text())
    assert list(tmp_path.iterdir()) == []  # the cache was not touched
    with pytest.raises(RuntimeError, match="trained"):  # re-creating (opd pretrain, --force) trains into the cache
        pretrain(DEFAULTS[0], tmp_path, shipped=False)
    with pytest.raises(RuntimeError, match="trained"):
        pretrain(DEFAULTS[0], tmp_path, force=True)
    with pytest.raises(OpdError, match="inside the shipped models' folder"):
        pretrain(DEFAULTS[0], SHIPPED_DIR / "cache", force=True)
    assert before == {c.cache_name(): snapshot(SHIPPED_DIR / c.cache_name()) for c in DEFAULTS}


def test_a_damaged_shipped_model_is_not_used(tmp_path, capsys):
    cfg = DEFAULTS[0]
    folder = copy_shipped(cfg, tmp_path)
    assert shipped_entry(cfg, tmp_path)[0] == folder
    (folder / "eval.json").write_text((folder / "eval.json").read_text().replace("0.", "1."))
    assert shipped_entry(cfg, tmp_path) is None
    assert "the shipped llama-teacher-chain-" in capsys.readouterr().err
    (folder / MANIFEST).unlink()  # no manifest: not verified, not used
    assert shipped_entry(cfg, tmp_path) is None
    assert shipped_entry(PretrainConfig(steps=7), tmp_path) is None  # not a default config: nothing shipped


def test_compare_to_shipped_equal_differs_and_none(tmp_path):
    cfg = DEFAULTS[1]
    copy = copy_shipped(cfg, tmp_path)
    result = json.loads((copy / "eval.json").read_text())
    assert compare_to_shipped(cfg, copy, result) == "equal to the shipped model (bitwise)"

    weights = load_file(str(copy / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    line = compare_to_shipped(cfg, copy, {**result, "eval/accuracy": 0.25})
    assert line.startswith("differs from the shipped model: max |w - w_shipped| 0.001, accuracy 0.250 here vs ")
    assert "AVX2, AVX-512 and AMX" in line and "\n" not in line

    shipped = copy_shipped(cfg, tmp_path / "shipped")  # a shipped model that does not match its manifest
    (shipped / "eval.json").write_text("{}")
    assert compare_to_shipped(cfg, copy, result, tmp_path / "shipped") == "the shipped model is damaged (reinstall opd)"

    other = PretrainConfig(family=cfg.family, role=cfg.role, seed=1)
    assert compare_to_shipped(other, copy, result).startswith("no shipped model")


def test_weight_difference_is_bitwise(tmp_path):
    def folder(name, **tensors):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        return tmp_path / name
    a = folder("a", w=torch.tensor([0.0, 1.0]))
    assert weight_difference(a, folder("b", w=torch.tensor([0.0, 1.0]))) == (True, 0.0)
    assert weight_difference(a, folder("c", w=torch.tensor([-0.0, 1.0]))) == (False, 0.0)  # equal as numbers only
    assert weight_difference(a, folder("d", w=torch.tensor([0.0, 1.5]))) == (False, 0.5)
    assert weight_difference(a, folder("e", w=torch.tensor([0.0, 1.0, 2.0])))[1] == float("inf")
    assert weight_difference(a, folder("f", v=torch.tensor([0.0, 1.0])))[1] == float("inf")


def test_opd_pretrain_says_whether_it_equals_the_shipped_model(tmp_path, capsys, monkeypatch):
    """The cache holds a re-created model equal to the shipped one: one line per model, no training."""
    monkeypatch.setattr(pretrain_mod, "train", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("trained")))
    cfg = PretrainConfig(family="qwen3", role="student")
    copy_shipped(cfg, tmp_path)
    status = main(["pretrain", "--family", "qwen3", "--role", "student", "--cache-dir", str(tmp_path), "--jobs", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0 and len(lines) == 2 and lines[0].endswith("vs shipped  checkpoint")
    assert lines[1].split()[:5] == ["qwen3", "student", "800640", "470", "0.566"]
    assert lines[1].endswith(f"  equal to the shipped model (bitwise)  {tmp_path / cfg.cache_name()}")
