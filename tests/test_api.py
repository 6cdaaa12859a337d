"""The Python API (opd/__init__.py): the README's example run as written at test size, and the API's contracts:
the same config as the CLI's, the same run as `opd train`, errors as OpdError."""
import json
import re
from pathlib import Path

import pytest

import opd
from opd.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
SMALL = dict(steps=2, batch_size=4, eval=dict(examples=8, every=0), save_every=0, sampling=dict(max_new_tokens=16))


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    examples = [b for b in blocks if "import opd" in b]
    assert examples, "README.md has no ```python block that imports opd"
    return examples[0]


def test_the_readme_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The README's example, executed as written; only the sizes are made small (opd.make_config gets SMALL on top of
    what the example asks for) and the probe batch is 4."""
    code = readme_example()
    assert len(code.strip().splitlines()) <= 12, "the README promises a short example"
    make_config, admit = opd.make_config, opd.admit
    monkeypatch.setattr(opd, "make_config", lambda *a, **values: make_config(*a, **{**values, **SMALL}))
    monkeypatch.setattr(opd, "admit", lambda cfg, **kw: admit(cfg, **{"rollouts": 4, **kw}))
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert re.search(r"^(ADMIT|UNCERTAIN|REJECT)", out, re.M), out
    if "REJECT" not in out.splitlines()[0]:
        summary = json.loads((tmp_path / "runs/api/summary.json").read_text())
        assert summary["steps"] == 2 and f"held-out accuracy {summary['before']['eval/accuracy']}" in out


def test_config_is_the_cli_config_and_errors_are_opd_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("family: qwen3\nloss: {name: sampled_rkl}\n")
    cfg = opd.make_config(path, optim=dict(lr=3e-4), loss={"correction": "tis"})
    assert (cfg.family, cfg.optim.lr, cfg.loss.name, cfg.loss.correction) == ("qwen3", 3e-4, "sampled_rkl", "tis")
    with pytest.raises(opd.OpdError, match="unknown config key 'max_stalenes'.*max_staleness"):
        opd.make_config(max_stalenes=2)
    with pytest.raises(opd.OpdError, match="lr must be positive"):
        opd.make_config(optim=dict(lr=-1.0))
    with pytest.raises(opd.OpdError, match="expected a config"):
        opd.train("not a config", tmp_path / "run")


def test_train_is_opd_train_and_generate_samples_the_checkpoint(tmp_path):
    """The same config through the API and the CLI: the same per-step metrics (timings aside)."""
    values = {"family": "llama", **SMALL}
    summary = opd.train(opd.make_config(**values), tmp_path / "api", progress=False)
    assert main(["train", "--run-dir", str(tmp_path / "cli"), "--quiet",
                 *[arg for k, v in values.items() for arg in ("--set", f"{k}={v}")]]) == 0

    def rows(run):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time", "throughput"))}
                for line in (tmp_path / run / "metrics.jsonl").open()]
    assert rows("api") == rows("cli") and summary["steps"] == 2
    texts = opd.generate(tmp_path / "api" / "checkpoint", ["41+81+61+52=", "18+26="], max_new_tokens=8, seed=1)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert texts == opd.generate(tmp_path / "api" / "checkpoint", ["41+81+61+52=", "18+26="], max_new_tokens=8, seed=1)


def test_reading_a_config_imports_nothing_heavy(tmp_path):
    """A config is read (and checked) without torch, the models or the engines: 0.2 s instead of 2 s, and a bad config
    fails before any of them load."""
    import subprocess
    import sys
    path = tmp_path / "c.yaml"
    path.write_text("family: qwen3\nplan: kv=fp8_e4m3\nloss: {name: sampled_rkl, correction: tis}\n")
    code = ("import sys; from opd.config.files import load_config; load_config(sys.argv[1], ['async.max_staleness=2']); "
            "heavy = sorted(m for m in ('torch', 'opd.models.model', 'opd.engines.builtin', 'opd.training.pretrain') if m in sys.modules); "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_script_without_the_main_guard_gets_an_error_not_a_hang(tmp_path):
    """The async worker is a spawned process that imports the script's main module: unguarded, the script's top level
    runs again there. opd refuses to train inside that start-up, and the run stops with one error naming the guard
    (it used to hang: the parent blocked writing the worker's start-up data to a child that never read it)."""
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text("import opd\n"
                      "cfg = opd.make_config(family='llama', schedule='async', threads=2, steps=1, batch_size=2,\n"
                      "                      eval={'examples': 2, 'every': 0}, sampling={'max_new_tokens': 8},\n"
                      "                      async_={'max_worker_restarts': 0})\n"
                      "opd.train(cfg, 'run', progress=False)\n")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "if __name__ == \"__main__\":" in result.stderr.splitlines()[-1], result.stderr[-2000:]


