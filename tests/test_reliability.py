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

from opd.io.errors import OpdError
from opd.config.runlog import read_metrics
from opd.training.trainer import train

from helpers import comparable, config

pytestmark = pytest.mark.reliability


def train_args(pair, run_dir, steps=8, **overrides):
    student, teacher = pair
    sets = {"student": student, "teacher": teacher, "task": "add", "steps": steps, "batch_size": 4, "eval.every": 0,
            "eval.examples": 8, "save_every": 2, "threads": 1, "plan": "kv=fp8_e4m3"} | overrides
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
    args = train_args(pair, tmp_path / "whole", schedule="async", threads=2, **{"async.max_staleness": 1})
    assert subprocess.run(args, capture_output=True, timeout=300).returncode == 0
    args = train_args(pair, tmp_path / "killed", schedule="async", threads=2, **{"async.max_staleness": 1})
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
import opd.models.checkpoint as checkpoint
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
    with pytest.raises(OpdError, match="metrics.jsonl:2: not valid JSON"):
        read_metrics(tmp_path)


# ---- issue 23: interrupts, one writer, resume rules, no pickle ---------------------------------------------------

def interrupt_until_done(args, run_dir, rng, cycles) -> list[str]:
    """Start the run, send SIGINT or SIGTERM at a random point (during set-up, or after a random number of logged steps
    and a random delay), and again with --resume, `cycles` times; then let it finish. Returns what happened, for the
    failure message."""
    history = []
    for cycle in range(cycles + 1):
        resume = ["--resume"] if (run_dir / "config.yaml").is_file() else []
        run = subprocess.Popen(args + resume, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if cycle < cycles:
            logged = len(read_metrics(run_dir)) if (run_dir / "metrics.jsonl").is_file() else 0
            wait_for = rng.choice([-1, logged, logged + 1, logged + 2])  # -1: during set-up
            deadline = time.time() + 120
            while wait_for >= 0 and run.poll() is None and time.time() < deadline:
                metrics = run_dir / "metrics.jsonl"
                if metrics.is_file() and metrics.read_text().count("\n") > wait_for:
                    break
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 2.0 if wait_for < 0 else 0.3))
            sig = rng.choice([signal.SIGINT, signal.SIGTERM])
            if run.poll() is None:
                run.send_signal(sig)
            history.append(f"{sig.name} after {wait_for} lines")
        _, stderr = run.communicate(timeout=300)
        history[-1:] = [f"{history[-1] if history and cycle < cycles else 'to the end'}: exit {run.returncode}"]
        # 130 / 143: stopped by opd (saved, or before the run began); -SIGTERM / -SIGINT: during Python's start-up,
        # before opd's handlers exist (Python then ends with the signal, after its own KeyboardInterrupt report)
        assert run.returncode in (0, 130, 143, -signal.SIGTERM, -signal.SIGINT), (history, stderr)
        assert "Traceback" not in stderr or run.returncode == -signal.SIGINT, (history, stderr)
        if run.returncode == 0:
            break
    if run.returncode != 0:
        final = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
        assert final.returncode == 0, (history, final.stderr)
    return history


EARLY_SIGNAL = """
import builtins, os, signal, sys
real_import = builtins.__import__
def importing(name, *args, **kwargs):
    if name == "opd.cli.args":  # opd.cli is importing its subcommands: the signal lands mid-import
        os.kill(os.getpid(), signal.SIG{sig})
    return real_import(name, *args, **kwargs)
builtins.__import__ = importing
from opd.cli import main
sys.exit(main(["pairs"]))
"""


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_a_signal_while_the_command_imports_its_libraries_exits_as_interrupted(sig):
    """Ctrl-C or SIGTERM before the command has started (opd.cli importing torch and numpy) ends it as interrupted,
    one line, not as whatever error the import it broke turns it into (once a RecursionError from numpy's)."""
    run = subprocess.run([sys.executable, "-c", EARLY_SIGNAL.format(sig=sig)], capture_output=True, text=True,
                         timeout=120)
    assert (run.returncode, run.stderr) == (128 + getattr(signal, f"SIG{sig}"), "opd: interrupted\n")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_sigint_and_sigterm_at_random_points_then_resume_give_the_uninterrupted_metrics(pair, tmp_path, schedule):
    """Ctrl-C or SIGTERM anywhere (set-up, mid-step, between steps), repeatedly, each followed by --resume: the run's
    per-step metrics are the uninterrupted run's, every step there exactly once."""
    extra = {"schedule": "async", "async.max_staleness": 1, "threads": 2} if schedule == "async" else {}
    whole = subprocess.run(train_args(pair, tmp_path / "whole", **extra), capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    seed = time.time_ns()
    history = interrupt_until_done(train_args(pair, tmp_path / "cut", **extra), tmp_path / "cut", random.Random(seed),
                                   cycles=4)
    cut, straight = read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "whole")
    assert [r["step"] for r in cut] == [r["step"] for r in straight], (seed, history)
    assert comparable(cut) == comparable(straight), (seed, history)


def cli_outcome(argv, capsys) -> tuple[int, str]:
    """(exit code, stderr) of `opd` run in this process."""
    from opd.cli import main
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(pair, tmp_path,
                                                                                           uninterrupted):
    """While `opd train` writes a run directory, a second `opd train` on it (here --overwrite, which would delete it) is
    refused with one line naming the first one's pid, and changes nothing; once the holder is killed with SIGKILL, its
    lock is gone with it, and --resume takes the folder over and finishes the run exactly."""
    run_dir = tmp_path / "run"
    args = train_args(pair, run_dir, steps=8)
    first = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and first.poll() is None and not (
            (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().count("\n") > 2):
        time.sleep(0.01)
    os.kill(first.pid, signal.SIGSTOP)  # hold it still while the second one tries
    try:
        before = snapshot(run_dir)
        second = subprocess.run(args + ["--overwrite"], capture_output=True, text=True, timeout=300)
        after = snapshot(run_dir)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
    assert second.returncode == 2, second.stderr
    assert second.stderr.strip().splitlines()[-1] == (
        f"opd: error: {run_dir} is in use by another opd process (pid {first.pid}) (wait for it to finish or stop it; "
        "two writers would mix their runs in one folder)")
    assert after == before
    resumed = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(read_metrics(run_dir)) == uninterrupted


@pytest.mark.slow
def test_resume_rules_refuse_with_one_line_and_change_nothing(pair, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, err = cli_outcome(train_args(pair, run_dir, steps=6)[3:], capsys)
    assert code == 0, err
    before = snapshot(run_dir)
    code, err = cli_outcome(train_args(pair, run_dir, steps=4)[3:] + ["--resume"], capsys)
    assert code == 2 and err.strip() == (f"opd: error: {run_dir} has done 6 steps; steps=4 is fewer (resume with steps "
                                         ">= 6, or start again with --overwrite)"), err
    assert snapshot(run_dir) == before
    # a log behind its checkpoint: step 2's line lost (the final checkpoint counts steps 0-7)
    code, err = cli_outcome(train_args(pair, tmp_path / "behind", steps=8, save_every=4)[3:], capsys)
    assert code == 0, err
    lines = (tmp_path / "behind" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "behind" / "metrics.jsonl").write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    before = snapshot(tmp_path / "behind")
    code, err = cli_outcome(train_args(pair, tmp_path / "behind", steps=10, save_every=4)[3:] + ["--resume"], capsys)
    assert code == 2 and "metrics.jsonl lacks step 2 of the 8 its checkpoint has done" in err, err
    assert len(err.strip().splitlines()) == 1 and snapshot(tmp_path / "behind") == before


class Payload:
    """Unpickling this creates the marker file: what a crafted state file would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trainer_state.safetensors", "trainer_state.pt"])
def test_a_state_file_carrying_a_pickle_is_refused_and_never_run(pair, tmp_path, capsys, name):
    """A run directory handed over by someone else: its state file is a pickle payload and its manifest was rewritten
    to match (the manifest guards against damage, not against an author). --resume refuses it, and nothing runs."""
    import pickle
    from opd.models.checkpoint import MANIFEST
    from opd.io.registry import sha256_of as _sha256
    run_dir, marker = tmp_path / "run", tmp_path / "pwned"
    code, err = cli_outcome(train_args(pair, run_dir, steps=4)[3:], capsys)
    assert code == 0, err
    folder = run_dir / "checkpoint"
    (folder / "trainer_state.safetensors").unlink()
    (folder / name).write_bytes(pickle.dumps({"optimizer": Payload(str(marker))}))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"].pop("trainer_state.safetensors")
    manifest["files"][name] = {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    before = snapshot(run_dir)
    code, err = cli_outcome(train_args(pair, run_dir, steps=6)[3:] + ["--resume"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("is a pickle" if name.endswith(".pt") else "not an opd tensors + JSON file") in err, err
    assert not marker.exists(), "the payload ran"
    assert snapshot(run_dir) == before
