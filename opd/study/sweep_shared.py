"""What the runs of a sweep share, and the results file's locked append.

A sweep's runs of one seed start from the same student, so its held-out evaluation before training and the admission
probe's BF16 floor are the same for all of them: `Shared` keeps each, measured once, in out/shared.jsonl (a real
pair's evaluation and floor cost ~85 s and ~40 s a run on 2 cores). The key is the config's hash with the settings
that cannot change them reset to their defaults; tests/test_study.py holds that a run reusing them gets what measuring
them itself gives.
"""
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

from opd.health.rules import FLOOR_PLAN, METRIC
from opd.config.run import TrainConfig
from opd.numerics.plan import Plan
from opd.admission.probe import measure, probe

# What a run's "before" evaluation (the initial student at full precision) and its probe's BF16 floor do not depend on:
# the config keys reset to their defaults in the key under which a sweep measures each once and shares it (Shared).
BEFORE_IGNORES = ("steps", "batch_size", "plan", "noise_seed", "loss", "optim", "save_every", "exact_kl",
                  "max_bad_steps", "engine", "schedule", "async", "guard", "threads")
FLOOR_IGNORES = ("steps", "batch_size", "plan", "noise_seed", "optim", "save_every", "exact_kl", "max_bad_steps",
                 "schedule", "async", "guard", "threads", "eval")


def shared_key(cfg: TrainConfig, ignores: tuple[str, ...]) -> str:
    defaults = TrainConfig().to_dict()
    values = cfg.to_dict() | {k: defaults[k] for k in ignores}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


class Shared:
    """Measurements several runs of a sweep share (the initial student's evaluation, the probe's BF16 floor), one JSON
    line each in out/shared.jsonl (the module docstring says why). Locked appends as the results file; a line that does
    not read is ignored (it is measured again)."""

    def __init__(self, path: Path):
        self.path, self.values = path, {}
        if path.is_file():
            for raw in path.read_bytes().split(b"\n"):
                try:
                    line = json.loads(raw)
                    self.values[(line["kind"], line["key"])] = line["value"]
                except (ValueError, KeyError, TypeError):
                    continue

    def get(self, kind: str, key: str) -> dict | None:
        return self.values.get((kind, key))

    def put(self, kind: str, key: str, value: dict) -> None:
        if (kind, key) not in self.values:
            self.values[(kind, key)] = value
            append_result(self.path, {"kind": kind, "key": key, "value": value})


def shared_floor_probe(setup, plan: Plan, shared: Shared) -> dict:
    """probe(setup, plan) with the BF16 floor measured once per floor key; `floor_seconds` is what the floor cost
    when it was measured (an `opd admit` pays it each time; nothing when the candidate is the floor's plan)."""
    key, floor_plan = shared_key(setup.cfg, FLOOR_IGNORES), Plan.parse(FLOOR_PLAN, len(plan.layers))
    is_floor = str(floor_plan) == str(plan)
    floor = shared.get("floor", key)
    if floor is None and is_floor:  # the candidate is the floor: measured once
        numbers = probe(setup, plan)
        shared.put("floor", key, {"kl_k3": numbers["kl_k3"], METRIC: numbers[METRIC], "seconds": numbers["seconds"]})
        return numbers | {"floor_seconds": 0.0}
    if floor is None:
        start = time.perf_counter()
        floor = measure(setup, floor_plan) | {"seconds": time.perf_counter() - start}
        shared.put("floor", key, floor)
    return probe(setup, plan, floor) | {"floor_seconds": 0.0 if is_floor else floor["seconds"]}


def append_result(path: Path, row: dict) -> None:
    data = (json.dumps(row) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
