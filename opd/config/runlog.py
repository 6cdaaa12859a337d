"""A run directory and its logs: the resolved config, one JSON line per step, TensorBoard events.

    <run_dir>/config.yaml      the resolved config (what `--resume` checks against)
    <run_dir>/metrics.jsonl    one line per optimizer step: {"step": s, "time": unix seconds, "<ns>/<name>": value}
    <run_dir>/tb/              TensorBoard event files with the same scalars
    <run_dir>/checkpoint/      the latest checkpoint: HF folder + trainer_state.json and .safetensors (trainer.py)
    <run_dir>/summary.json     before/after evaluation and timings, written when the run finishes

A directory that already holds a run is never silently reused: `resume` continues it (the config must match,
except `steps` and the async worker's fault limits), `overwrite` deletes it first, anything else is an error.
Non-finite values are logged as null.
"""
import fcntl
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from pydantic import StrictFloat, StrictInt, StrictStr, conint
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.summary import scalar

from opd.config.run import TrainConfig
from opd.config.files import build_config, dump_config, flatten, migrate
from opd.io.errors import OpdError, require
from opd.io.schema import Schema, read_jsonl as read_checked_jsonl, read_yaml

# change no result (a sharded run's checkpoint is whole: N ranks write it, any M resume it, wherever they were placed)
RESUMABLE_CHANGES = ("steps", "async.worker_timeout", "async.max_worker_restarts", "compute.learner_ranks",
                     "ray.learner", "ray.learner_cpus", "ray.learner_gpus")


class RunDirLocked(OpdError):
    """Another live process writes this run directory."""

    def __init__(self, run_dir: Path, pid: int | None):
        self.pid = pid
        super().__init__(f"{run_dir} is in use by another opd process (pid {pid if pid else 'unknown'})",
                         "wait for it to finish or stop it; two writers would mix their runs in one folder")


class RunLock:
    """One writer per run directory: `opd train` (and each run of `opd sweep`) holds an exclusive `flock` on the run
    directory itself while it works. A second writer is refused with the holder's pid (from /proc/locks). The kernel
    drops a flock when its process dies, however it dies (kill -9, a crash), so a dead writer's lock is never left
    behind to be taken over, and no lock file is written: a refused command leaves the folder exactly as it was. The
    folder is created if needed, and removed again on release if it is still empty (nothing was written)."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.fd, self.created = Path(run_dir), None, False

    def __enter__(self) -> "RunLock":
        self.created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        require(self.run_dir.is_dir(), f"{self.run_dir} is not a folder", "choose a folder for --run-dir")
        fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = lock_holder(fd)
            os.close(fd)
            self._remove_created()
            raise RunDirLocked(self.run_dir, pid) from None
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor releases the lock
            self.fd = None
            self._remove_created()

    def _remove_created(self) -> None:
        if self.created:
            try:
                self.run_dir.rmdir()  # only if empty: nothing was written
            except OSError:
                pass


def lock_holder(fd: int) -> int | None:
    """The pid holding a flock on the file or folder open as fd, from /proc/locks (Linux); None if unknown."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == device and fields[4].isdigit():
            return int(fields[4])
    return None


def held_files(run_dir: Path) -> list[Path]:
    return list(run_dir.iterdir()) if run_dir.is_dir() else []


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """The rules of a run directory, checked before anything is loaded or written: a folder holding something that is
    not a run is never touched; a run is continued only with `resume` and replaced only with `overwrite`."""
    require(not (resume and overwrite), "--resume and --overwrite contradict each other", "choose one")
    saved = run_dir / "config.yaml"
    if held_files(run_dir):
        if not saved.is_file():
            raise OpdError(f"{run_dir} is not empty and holds no opd run",
                           f"refusing to {'delete' if overwrite else 'touch'} it: choose an empty or new --run-dir")
        if not resume and not overwrite:
            raise OpdError(f"{run_dir} already holds a run", "pass --resume to continue it or --overwrite to replace it")
    elif resume:
        raise OpdError(f"nothing to resume in {run_dir}", "drop --resume to start a new run")
    check_writable(run_dir, "--run-dir")


def check_writable(path: Path, flag: str) -> None:
    """An output folder (`flag` names it in the message) can be created and written, checked before the work that
    fills it, without changing anything on disk: an unnamed temporary file in the folder, or in its nearest existing
    parent when the folder is still to be made (permission bits do not tell for root or a read-only mount)."""
    path = Path(path)
    probe = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    require(probe.is_dir(), f"{flag} {path}: {probe} is not a folder", f"choose a folder for {flag}")
    try:
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as e:
        raise OpdError(f"cannot write {flag} {path}: {e.strerror or e}", f"choose a writable {flag}") from None


def clear_run_dir(run_dir: Path) -> None:
    """--overwrite: delete the old run's files, keeping the folder (this process holds its lock)."""
    for path in held_files(run_dir):
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def save_config(run_dir: Path, cfg: TrainConfig) -> None:
    write_atomic(run_dir / "config.yaml", dump_config(cfg))


def read_run_config(run_dir: Path) -> TrainConfig:
    """The run's saved config.yaml, checked as any config is (one line naming the file and key)."""
    path = run_dir / "config.yaml"
    values = read_yaml(path, "run config")
    return build_config(migrate(values) if isinstance(values, dict) else values, str(path))


def check_same_run(run_dir: Path, cfg: TrainConfig) -> None:
    old = flatten(read_run_config(run_dir).to_dict())
    new = flatten(cfg.to_dict())
    changed = [k for k in new if new[k] != old.get(k) and k not in RESUMABLE_CHANGES]
    require(not changed, f"{run_dir} holds a run with a different config ({', '.join(changed)})",
            "resume with the same config (only steps, the worker's fault limits, the learner ranks and their placement "
            "may change), or use --overwrite or another --run-dir")


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

    def sync(self) -> None:
        """metrics.jsonl to the disk (before a checkpoint that counts its steps is written)."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as e:
            raise cannot_write(self.path, e) from None

    def close(self) -> None:
        """Close both logs; a failure to flush them (the disk that just filled up) is not raised again."""
        for close in (self.file.close, self.tb.close):
            try:
                close()
            except OSError:
                pass


class MetricsRow(Schema):
    """A metrics.jsonl line: the step, the wall time, and values (numbers; null where not finite)."""
    __pydantic_extra__: dict[str, StrictFloat | StrictInt | None]
    step: conint(strict=True, ge=0)
    time: StrictFloat | StrictInt | None = None


class GuardEvent(Schema):
    """A guard.jsonl line (guard.py)."""
    step: conint(strict=True, ge=0)
    action: StrictStr


def read_jsonl(path: Path, schema=None) -> list[dict]:
    """An append-only log's lines (metrics.jsonl, guard.jsonl). A torn last line (the process was killed mid-write)
    is left out; on resume its step is re-run. A malformed line anywhere else is corruption, and an error."""
    fix = "the run directory is damaged: start the run again with --overwrite"
    return [row.model_dump(exclude_unset=True) if schema else row
            for row in read_checked_jsonl(path, Path(path).name, schema, torn="drop", fix=fix)]


def read_metrics(run_dir: Path) -> list[dict]:
    """The logged steps (see read_jsonl), checked as metrics rows."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl", MetricsRow)


def read_guard_events(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "guard.jsonl"
    return read_jsonl(path, GuardEvent) if path.is_file() else []
