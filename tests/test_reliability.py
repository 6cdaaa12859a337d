"""Guarantees under failure: a run killed with SIGKILL (at a random step, inside a checkpoint save, an async trainer)
or stopped by a full disk resumes to the uninterrupted run's metrics; a killed async trainer leaves no worker behind;
the same seed gives the same run; a torn metrics line is dropped and a damaged one is a clear error."""
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opd.errors import OpdError
from opd.runlog import read_metrics
from opd.trainer import train

from test_trainer import comparable, config, pair  # noqa: F401 (fixture)

pytestmark = pytest.mark.reliability


def train_args(pair, run_dir, steps=8, **overrides):
    student, teacher = pair
    sets = {"student": student, "teacher": teacher, "task": "add", "steps": steps, "batch_size": 4, "eval_every": 0,
            "eval_examples": 8, "save_every": 2, "threads": 1, "plan": "kv=fp8_e4m3"} | overrides
    return [sys.executable, "-m", "opd.cli", "train", "--run-dir", str(run_dir), "--quiet",
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]


def children(pid: int) -> set[int]:
    return {int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()}


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited orphan that nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_when_logged(args, run_dir, steps_logged) -> set[int]:
    """Start `opd train`, SIGKILL it once metrics.jsonl holds more than steps_logged lines; return the pids of the
    child processes it had then."""
    run = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and run.poll() is None:
        if metrics.is_file() and metrics.read_text().count("\n") > steps_logged:
            break
        time.sleep(0.01)
    assert run.poll() is None, "the run finished before it could be killed"
    alive = children(run.pid)
    os.kill(run.pid, signal.SIGKILL)
    run.wait(30)
    return alive


@pytest.fixture(scope="module")
def uninterrupted(pair, tmp_path_factory):
    """The metrics of the whole run that every interrupted-then-resumed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    whole = subprocess.run(train_args(pair, run_dir), capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    return comparable(read_metrics(run_dir))


@pytest.mark.slow
def test_kill_9_at_a_random_step_then_resume_gives_the_uninterrupted_metrics(pair, tmp_path, uninterrupted):
    kill_after = random.Random(time.time_ns()).randint(2, 6)
    kill_when_logged(train_args(pair, tmp_path / "killed"), tmp_path / "killed", kill_after)
    resumed = subprocess.run(train_args(pair, tmp_path / "killed") + ["--resume"], capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, (kill_after, resumed.stderr)
    assert comparable(read_metrics(tmp_path / "killed")) == uninterrupted, kill_after


@pytest.mark.slow
def test_kill_9_of_an_async_trainer_leaves_no_worker_and_a_resumable_run(pair, tmp_path):
    args = train_args(pair, tmp_path / "whole", schedule="async", max_staleness=1, threads=2)
    assert subprocess.run(args, capture_output=True, timeout=300).returncode == 0
    args = train_args(pair, tmp_path / "killed", schedule="async", max_staleness=1, threads=2)
    workers = kill_when_logged(args, tmp_path / "killed", 3)
    assert workers, "the async run has no rollout worker"
    deadline = time.time() + 10  # its watchdog notices within 0.2 s
    while time.time() < deadline and any(map(running, workers)):
        time.sleep(0.1)
    assert not any(map(running, workers)), "the rollout worker outlived its trainer"
    resumed = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(read_metrics(tmp_path / "killed")) == comparable(read_metrics(tmp_path / "whole"))


@pytest.mark.slow
def test_a_full_disk_stops_the_run_cleanly_and_resume_continues(pair, tmp_path, uninterrupted):
    """A file-size limit (RLIMIT_FSIZE, the per-process way to fill a disk) makes the first checkpoint fail: one line,
    no half-written checkpoint; with room again, --resume finishes the run as if nothing had happened."""
    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
    args = train_args(pair, tmp_path / "run")
    full = subprocess.run(args, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
    assert full.returncode == 2 and full.stderr.strip().splitlines()[-1].startswith(
        "opd: error: cannot write the checkpoint"), full.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml", "metrics.jsonl", "tb"]
    resumed = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(read_metrics(tmp_path / "run")) == uninterrupted


# `opd train` with a SIGKILL at an exact point of its second checkpoint save (step 4): while the weights are being
# written (the folder is incomplete, no manifest yet), or between moving the old checkpoint aside and renaming the
# new one into place (no `checkpoint` folder at all).
KILL_DURING_SAVE = """
import os, signal, sys
import opd.checkpoint as checkpoint
where = sys.argv.pop(1)
saves = []
write, replace = checkpoint.save_file, checkpoint._replace_dir

def save_file(tensors, path, **kwargs):
    saves.append(path)
    if where == "write" and len(saves) == 2:
        with open(path, "wb") as f:
            f.write(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)
    write(tensors, path, **kwargs)

def replace_dir(src, dst):
    if where == "rename" and len(saves) == 2:
        dst.rename(dst.with_name(f".{dst.name}.old-{os.getpid()}"))
        os.kill(os.getpid(), signal.SIGKILL)
    replace(src, dst)

checkpoint.save_file, checkpoint._replace_dir = save_file, replace_dir
from opd.cli import main
sys.exit(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["write", "rename"])
def test_kill_9_inside_a_checkpoint_save_then_resume_gives_the_uninterrupted_metrics(pair, tmp_path, uninterrupted,
                                                                                      where):
    args = train_args(pair, tmp_path / "run")
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, where, *args[3:]], capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    leftovers = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".checkpoint."))
    assert leftovers and (where == "write") == (tmp_path / "run" / "checkpoint").is_dir(), leftovers
    before = read_metrics(tmp_path / "run")
    resumed = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    after = read_metrics(tmp_path / "run")
    assert comparable(after) == uninterrupted
    kept = 2 if where == "write" else 4  # it continued from the last complete checkpoint (not from the start):
    assert after[:kept] == before[:kept]  # the lines before it are the killed process's, untouched
    assert all(a["time"] != b["time"] for a, b in zip(after[kept:], before[kept:]))  # the later ones were re-run
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".checkpoint.")]


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
