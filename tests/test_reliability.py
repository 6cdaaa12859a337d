"""Guarantees under failure: a run killed with SIGKILL at a random step resumes to the uninterrupted run's metrics;
the same seed gives the same run; a damaged metrics file is a clear error."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from opd.errors import OpdError
from opd.runlog import read_metrics
from opd.trainer import train

from test_trainer import comparable, config, pair  # noqa: F401 (fixture)

pytestmark = pytest.mark.reliability


def train_args(pair, run_dir, steps=8):
    student, teacher = pair
    sets = {"student": student, "teacher": teacher, "task": "add", "steps": steps, "batch_size": 4, "eval_every": 0,
            "eval_examples": 8, "save_every": 2, "threads": 1, "plan": "kv=fp8_e4m3"}
    return [sys.executable, "-m", "opd.cli", "train", "--run-dir", str(run_dir), "--quiet",
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]


@pytest.mark.slow
def test_kill_9_at_a_random_step_then_resume_gives_the_uninterrupted_metrics(pair, tmp_path):
    whole = subprocess.run(train_args(pair, tmp_path / "whole"), capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    kill_after = random.Random(time.time_ns()).randint(2, 6)
    run = subprocess.Popen(train_args(pair, tmp_path / "killed"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and run.poll() is None:
        if metrics.is_file() and metrics.read_text().count("\n") > kill_after:
            break
        time.sleep(0.01)
    assert run.poll() is None, "the run finished before it could be killed"
    os.kill(run.pid, signal.SIGKILL)
    run.wait(30)
    resumed = subprocess.run(train_args(pair, tmp_path / "killed") + ["--resume"], capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, (kill_after, resumed.stderr)
    assert comparable(read_metrics(tmp_path / "killed")) == comparable(read_metrics(tmp_path / "whole")), kill_after


def test_same_seed_same_run(pair, tmp_path):
    cfg = config(pair, steps=4, plan="kv=int4 kv_group=16 w=fp8")
    train(cfg, tmp_path / "a", progress=False)
    train(cfg, tmp_path / "b", progress=False)
    assert comparable(read_metrics(tmp_path / "a")) == comparable(read_metrics(tmp_path / "b"))
    other = config(pair, steps=4, plan="kv=int4 kv_group=16 w=fp8", seed=1)
    train(other, tmp_path / "c", progress=False)
    assert comparable(read_metrics(tmp_path / "c")) != comparable(read_metrics(tmp_path / "a"))


def test_a_torn_last_metrics_line_is_dropped_a_damaged_middle_is_an_error(tmp_path):
    rows = [{"step": 0, "loss/value": 1.0}, {"step": 1, "loss/value": 0.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "loss/va')
    assert read_metrics(tmp_path) == rows
    path.write_text(json.dumps(rows[0]) + "\n" + "garbage\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(OpdError, match="metrics.jsonl:2 is not a JSON line"):
        read_metrics(tmp_path)
