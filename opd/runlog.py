"""A run directory and its logs: the resolved config, one JSON line per step, TensorBoard events.

    <run_dir>/config.yaml      the resolved config (what `--resume` checks against)
    <run_dir>/metrics.jsonl    one line per optimizer step: {"step": s, "time": unix seconds, "<ns>/<name>": value}
    <run_dir>/tb/              TensorBoard event files with the same scalars
    <run_dir>/checkpoint/      the latest checkpoint: HF folder + trainer_state.pt (trainer.py)
    <run_dir>/summary.json     before/after evaluation and timings, written when the run finishes

A directory that already holds a run is never silently reused: `resume` continues it (the config must match,
except `steps` and the async worker's fault limits), `overwrite` deletes it first, anything else is an error.
Non-finite values are logged as null.
"""
import json
import math
import os
import shutil
import time
from pathlib import Path

import yaml
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.summary import scalar

from opd.config import TrainConfig, build_config, dump_config
from opd.errors import OpdError, require

RESUMABLE_CHANGES = ("steps", "worker_timeout", "max_worker_restarts")  # change no result


def prepare_run_dir(run_dir: Path, cfg: TrainConfig, resume: bool, overwrite: bool) -> None:
    require(not (resume and overwrite), "--resume and --overwrite contradict each other", "choose one")
    saved = run_dir / "config.yaml"
    if run_dir.exists() and any(run_dir.iterdir()):
        if overwrite:
            require(saved.is_file(), f"{run_dir} is not empty and holds no opd run",
                    "refusing to delete it: choose an empty or new --run-dir")
            shutil.rmtree(run_dir)
        elif not saved.is_file():
            raise OpdError(f"{run_dir} is not empty and holds no opd run", "choose an empty or new --run-dir")
        elif not resume:
            raise OpdError(f"{run_dir} already holds a run", "pass --resume to continue it or --overwrite to replace it")
        else:
            _check_same_run(run_dir, cfg)
    elif resume:
        raise OpdError(f"nothing to resume in {run_dir}", "drop --resume to start a new run")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:  # a resumed run saves its config once its checkpoint has loaded (save_config)
        save_config(run_dir, cfg)


def save_config(run_dir: Path, cfg: TrainConfig) -> None:
    write_atomic(run_dir / "config.yaml", dump_config(cfg))


def _check_same_run(run_dir: Path, cfg: TrainConfig) -> None:
    old = build_config(yaml.safe_load((run_dir / "config.yaml").read_text())).to_dict()
    new = cfg.to_dict()
    changed = [k for k in new if new[k] != old.get(k) and k not in RESUMABLE_CHANGES]
    require(not changed, f"{run_dir} holds a run with a different config ({', '.join(changed)})",
            "resume with the same config (only steps and the worker's fault limits may change), or use --overwrite "
            "or another --run-dir")


def write_atomic(path: Path, text: str) -> None:
    """Write text to a temporary sibling, fsync it and rename it over path: readers see the old file or the new one,
    never part of one. On failure (a full disk) the temporary file is removed and the old file is left as it was."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _finite(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def cannot_write(path: Path, e: OSError) -> OpdError:
    return OpdError(f"cannot write {path}: {e.strerror or e}",
                    "free some disk space, then --resume continues from the last checkpoint")


class TensorBoard:
    """Scalars to a TensorBoard event file, written and flushed in the caller's thread. (tensorboardX's SummaryWriter
    writes from a background thread: a write error there, such as a full disk, is a traceback on stderr, the thread
    dies, and its bounded queue can then block the trainer.) A resumed run marks its first step, so TensorBoard
    hides the earlier file's events from that step on, as SummaryWriter's purge_step does."""

    def __init__(self, folder: Path, start_step: int = 0):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.writer = EventsWriter(str(folder / "events"), f".{os.getpid()}")
        if start_step:
            self.writer.write_event(Event(step=start_step, file_version="brain.Event:2"))
            self.writer.write_event(Event(step=start_step, session_log=SessionLog(status=SessionLog.START)))

    def write(self, step: int, values: dict) -> None:
        for key, value in values.items():
            self.writer.write_event(Event(wall_time=time.time(), step=step, summary=scalar(key, value)))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class RunLog:
    """metrics.jsonl + TensorBoard. `start_step` drops lines of steps >= it (a resumed run rewrites them)."""

    def __init__(self, run_dir: Path, start_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        kept = [json.dumps(row) for row in read_metrics(run_dir) if row["step"] < start_step] \
            if self.path.is_file() else []
        write_atomic(self.path, "".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        self.tb = TensorBoard(run_dir / "tb", start_step)

    def write(self, step: int, metrics: dict) -> None:
        row = {"step": step, "time": time.time(), **{k: _finite(v) for k, v in metrics.items()}}
        scalars = {k: v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: at worst a torn last line, which resume drops
            raise cannot_write(self.path, e) from None
        try:
            self.tb.write(step, scalars)
        except OSError as e:
            raise cannot_write(self.tb.folder, e) from None

    def close(self) -> None:
        """Close both logs; a failure to flush them (the disk that just filled up) is not raised again."""
        for close in (self.file.close, self.tb.close):
            try:
                close()
            except OSError:
                pass


def read_jsonl(path: Path) -> list[dict]:
    """An append-only log's lines (metrics.jsonl, guard.jsonl). A torn last line (the process was killed mid-write)
    is left out; on resume its step is re-run. A malformed line anywhere else is corruption, and an error."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):
                raise OpdError(f"{path}:{n} is not a JSON line", "the run directory is damaged: start the run "
                               "again with --overwrite") from None
    return rows


def read_metrics(run_dir: Path) -> list[dict]:
    """The logged steps (see read_jsonl)."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")
