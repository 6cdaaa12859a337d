"""The engine interface (engines.py): the table of kinds is the only place a kind is named, every kind has the
interface's methods, and the smallest engine (transformers' generate, hf_engine.py) agrees with the built-in one."""
import importlib
import re
from pathlib import Path

import pytest
import torch

from helpers import assert_one_line_error, config, opd
from opd.engines import kinds as engines
from opd.models.checkpoint import load_checkpoint
from opd.engines.kinds import KINDS, RolloutEngine, make_engine
from opd.io.errors import OpdError
from opd.config.runlog import read_metrics
from opd.engines.sampling import SamplingParams
from opd.training.trainer import train

SOURCE = Path(engines.__file__).parent
PROMPTS = [[1, 5, 9, 12], [1, 7, 8], [1, 30, 31, 32, 33, 34], [1, 4]]


def test_no_module_but_the_interfaces_compares_engine_kinds():
    """A new engine is one file and one row: nobody else may ask for an engine kind by its name, or test an engine's
    or a teacher's type (the config's sections check the names they accept: sections.py may name "trainer")."""
    kinds = "|".join(map(re.escape, [*KINDS, "trainer"]))
    pattern = re.compile(rf"""(==|!=)\s*["']({kinds})["']|["']({kinds})["']\s*(==|!=)|in \(["']({kinds})["']|"""
                         r"isinstance\([^)]*(Teacher|Engine)\b")
    found = [f"{path.name}:{i}: {line.strip()}" for path in sorted(SOURCE.glob("*.py"))
             if path.name not in ("engines.py", "teacher.py")
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line) and not (path.name == "sections.py" and "trainer" in line)]
    assert found == []


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_has_the_interface(name):
    kind = KINDS[name]
    module, _, cls = kind.cls.partition(":")
    if kind.check:
        try:
            engines.require_installed(name)
        except OpdError:
            pytest.skip(f"engine {name} is not installed here")
    engine_cls = getattr(importlib.import_module(module), cls)
    for method in ("for_model", "generate", "update_weights", "logprobs", "close"):
        assert callable(getattr(engine_cls, method, None)), (name, method)
    assert engine_cls.hidden_states == kind.hidden_states
    assert set(RolloutEngine.__annotations__) == {"plan", "version", "scales", "hidden_states"}


def test_unknown_kind_is_named():
    with pytest.raises(OpdError, match="unknown engine 'sglang'.*builtin, vllm, hf"):
        engines.kind("sglang")


@pytest.fixture(scope="module")
def student(pair):
    net, tok = load_checkpoint(pair[0])
    return net, tok, str(pair[0])


@pytest.mark.parametrize("params", [SamplingParams(24, temperature=1.0), SamplingParams(24, temperature=0.8, top_k=9),
                                    SamplingParams(24, temperature=1.2, top_p=0.7)])
def test_hf_engine_logprobs_equal_the_builtin_engines_on_its_own_tokens(student, params):
    """Oracle: transformers samples; the built-in engine, teacher-forced on the same tokens, gives the same processed
    and raw log-probs (float32: within float rounding)."""
    net, tok, folder = student
    hf = make_engine("hf", net, tok.stop_ids, tok.pad_id, "", model_dir=folder, version=2)
    builtin = make_engine("builtin", net, tok.stop_ids, tok.pad_id, "")
    rollouts = hf.generate(PROMPTS * 2, params, 5)
    forced = builtin.teacher_force([r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], params)
    for r, f in zip(rollouts, forced):
        assert r.policy_version == 2 and len(r.logprobs) == len(r.raw_logprobs) == len(r.completion_ids) > 0
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(f.logprobs), atol=1e-4)
        assert torch.allclose(torch.tensor(r.raw_logprobs), torch.tensor(f.raw_logprobs), atol=1e-4)
        stopped = r.completion_ids[-1] in tok.stop_ids
        assert r.finish_reason == ("stop" if stopped else "length")
        assert stopped or len(r.completion_ids) == params.max_new_tokens
        assert not any(t in tok.stop_ids for t in r.completion_ids[:-1])
    assert [r.completion_ids for r in hf.generate(PROMPTS * 2, params, 5)] == [r.completion_ids for r in rollouts]


def test_hf_engine_greedy_equals_builtin_and_follows_published_weights(student):
    net, tok, folder = student
    greedy = SamplingParams(16, temperature=0.0)
    hf = make_engine("hf", net, tok.stop_ids, tok.pad_id, "", model_dir=folder)
    builtin = make_engine("builtin", net, tok.stop_ids, tok.pad_id, "")
    assert [r.completion_ids for r in hf.generate(PROMPTS, greedy, 0)] == \
        [r.completion_ids for r in builtin.generate(PROMPTS, greedy, 0)]
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
             for k, v in net.state_dict().items()}
    hf.update_weights(moved, 7)
    other = type(net)(net.cfg)
    other.load_state_dict(moved)
    want = make_engine("builtin", other, tok.stop_ids, tok.pad_id, "").generate(PROMPTS, greedy, 0)
    got = hf.generate(PROMPTS, greedy, 0)
    assert [r.completion_ids for r in got] == [r.completion_ids for r in want] and got[0].policy_version == 7


def test_hf_engine_refuses_plans_it_has_no_switch_for(student):
    net, tok, folder = student
    for plan in ("kv=fp8_e4m3", "w=int8", "0: kv=bf16", "kv=bf16"):
        with pytest.raises(OpdError, match="the hf engine"):
            make_engine("hf", net, tok.stop_ids, tok.pad_id, plan, model_dir=folder)
    make_engine("hf", net, tok.stop_ids, tok.pad_id, "forward=bf16 kv=bf16", model_dir=folder)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_run_on_the_hf_engine(pair, tmp_path, schedule):
    """Through the interface alone: the sync engine, the async worker (its own copy, sent the weights)."""
    extra = {"schedule": "async", "threads": 2, "async_": {"max_staleness": 1}} if schedule == "async" else {}
    summary = train(config(pair, steps=3, engine={"name": "hf"}, save_every=0, **extra), tmp_path / "run",
                    progress=False)
    steps = [row for row in read_metrics(tmp_path / "run") if "loss/value" in row]
    assert summary["steps"] == 3 and len(steps) == 3
    # float32 transformers against the float32 learner on the weights that sampled: the numerics agree
    assert all(row["mismatch/kl_k3"] < 1e-6 for row in steps), [row["mismatch/kl_k3"] for row in steps]


def test_cli_generate_with_the_hf_engine(pair):
    result = opd("generate", "--model", pair[0], "--engine", "hf", "--prompt", "3 + 4 =", "--max-new-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert "engine: hf" in result.stdout
    bad = opd("generate", "--model", pair[0], "--engine", "hf", "--plan", "kv=fp8_e4m3", "--prompt", "1")
    assert_one_line_error(bad, "the hf engine")
