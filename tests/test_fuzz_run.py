"""Fuzzing the files of a training run: the YAML config `opd train --config` reads, and what `opd train --resume` reads
back from a run directory (config.yaml, metrics.jsonl, guard.jsonl, the checkpoint's trainer_state.json and
trainer_state.safetensors, with the manifest made to match, as a file someone edited or crafted would be). Each
example ends in success or in one line `opd: error: ...` (exit 2) with no traceback, and a refused resume leaves the
run directory as it was (fuzzlib.py; OPD_FUZZ=full runs 500 examples per kind)."""
import json
import shutil

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from fuzzlib import FUZZ, mutated_file, outcome
from opd import cli
from opd.models.checkpoint import MANIFEST
from opd.io.registry import sha256_of as _sha256
from opd.config.files import load_config
from opd.training.setup import parse_plan

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]

CONFIG = {
    "family": "qwen3", "task": "add", "steps": 40, "batch_size": 8, "optim": {"lr": 3.0e-4, "warmup_steps": 2},
    "plan": {"*": "forward=bf16 kv=fp8_e4m3", "0,3": "kv=bf16"}, "seed": 7, "sampling": {"temperature": 0.9},
    "loss": {"name": "sampled_rkl", "correction": "tis", "cap": 2.0},
    "schedule": "async", "async": {"max_staleness": 2, "recompute_fraction": 0.5}, "threads": 2,
    "guard": {"every": 5, "action": "fallback"}, "eval": {"every": 10}, "save_every": 10,
    "compute": {"micro_batch_size": 4},
}


@given(data=st.data())
@FUZZ
def test_fuzz_train_config(tmp_path_factory, data):
    """A config that loads is also usable: its plan parses for the model's layers."""
    folder = tmp_path_factory.mktemp("config")
    path = folder / "train.yaml"
    path.write_bytes(data.draw(mutated_file(yaml.safe_dump(CONFIG, sort_keys=False).encode(), "yaml")))

    def read():
        parse_plan(load_config(path), 4)
    outcome(read, folder)


@pytest.fixture(scope="module")
def finished_run(pair, tmp_path_factory):
    student, teacher = pair
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    args = ["train", "--run-dir", str(run_dir), "--quiet", "--set", f"student={student}", "--set",
            f"teacher={teacher}", "--set", "task=add", "--set", "steps=4", "--set", "batch_size=4", "--set",
            "eval.every=0", "--set", "eval.examples=4", "--set", "save_every=2", "--set", "threads=1"]
    assert cli.main(args) == 0
    (run_dir / "guard.jsonl").write_text(json.dumps({"step": 1, "action": "warn", "nsr": 0.3, "ess_frac": 0.9,
                                                     "limit": 0.1, "reject_at": 0.2, "plan": "", "reasons": []}) + "\n")
    return run_dir, args


def resume_with(finished_run, tmp_path_factory, name: str, mutate) -> None:
    """A copy of the finished run with `name` replaced by mutate(its bytes) (the manifest updated when the file is in
    the checkpoint), resumed with more steps."""
    source, args = finished_run
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    shutil.copytree(source, run_dir)
    path = run_dir / name
    path.write_bytes(mutate(path.read_bytes()))
    if path.parent.name == "checkpoint":
        manifest = json.loads((path.parent / MANIFEST).read_text())
        manifest["files"][path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        (path.parent / MANIFEST).write_text(json.dumps(manifest))
    argv = [a.replace(str(source), str(run_dir)) for a in args] + ["--resume", "--set", "steps=5"]
    outcome(lambda: cli.main(argv), run_dir)


KINDS = {"config.yaml": "yaml", "metrics.jsonl": "jsonl", "guard.jsonl": "jsonl",
         "checkpoint/trainer_state.json": "json", "checkpoint/trainer_state.safetensors": "bytes"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KINDS))
@given(data=st.data())
@FUZZ
def test_fuzz_resume(finished_run, tmp_path_factory, name, data):
    resume_with(finished_run, tmp_path_factory, name, lambda old: data.draw(mutated_file(old, KINDS[name])))

