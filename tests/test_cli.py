"""The CLI end to end: a shortened pretrain, eval and generate. (Bad input through the CLI: test_bad_input.py.)"""
import json

import pytest
import torch

from opd.models.checkpoint import save_checkpoint
from opd.models.model import ModelConfig, Transformer
from opd.models.tokenizer import TextTokenizer

from helpers import opd


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "tiny"
    cfg = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    save_checkpoint(folder, Transformer(cfg).init_weights(torch.Generator().manual_seed(0)), TextTokenizer.builtin())
    return folder


def test_eval_on_prompt_file(tmp_path, tiny_checkpoint):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=", "answer": 4}\n{"prompt": "hi"}\n')
    result = opd("eval", "--model", tiny_checkpoint, "--prompts", prompts, "--max-new-tokens", 8)
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    assert metrics["eval/n"] == 3 and metrics["eval/scored"] == 2 and 0 <= metrics["eval/accuracy"] <= 1


def test_pretrain_shortened_run_through_cli(tmp_path):
    """Both families' students, in two parallel jobs, then again from the cache."""
    args = ("pretrain", "--role", "student", "--task", "add", "--steps", 15, "--cache-dir", tmp_path, "--jobs", 2)
    first = opd(*args)
    assert first.returncode == 0, first.stderr
    rows = [line.split() for line in first.stdout.splitlines()[1:]]
    assert [(r[0], r[1], r[3]) for r in rows] == [("llama", "student", "15"), ("qwen3", "student", "15")]
    for row in rows:
        assert (tmp_path / row[-1].split("/")[-1] / "model.safetensors").is_file()
        assert 0.0 <= float(row[4]) <= 1.0
    again = opd(*args)
    assert again.returncode == 0 and again.stdout == first.stdout


def test_generate_with_plan_prints_records(tiny_checkpoint):
    result = opd("generate", "--model", tiny_checkpoint, "--prompt", "1+2=", "--prompt", "30+4=", "--plan",
                 "kv=fp8_e4m3 kv_scale=calibrate; 0: w=int8", "--max-new-tokens", 6, "--json", "--seed", 3)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["1+2=", "30+4="]
    for r in records:
        assert len(r["completion_ids"]) == len(r["logprobs"]) == len(r["raw_logprobs"]) <= 6
        assert r["finish_reason"] in ("stop", "length") and r["policy_version"] == 0
        assert r["kv_bytes_per_token"] == 2 * 1 * 16 * 1  # one layer, K and V, 1 kv head x 16 dims, 1 byte each


def test_eval_under_a_plan_reports_it(tmp_path, tiny_checkpoint):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    result = opd("eval", "--model", tiny_checkpoint, "--prompts", prompts, "--max-new-tokens", 4, "--plan",
                 "kv=fp8_e5m2")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["eval/plan"] == "0: kv=fp8_e5m2 kv_scale=fixed w=none"
