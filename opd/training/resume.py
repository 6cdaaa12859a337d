"""A run's state across a restart: what a checkpoint holds besides the weights (the loop's counters, the optimizer, the
engines' KV scales, the async schedule's batches in flight: tensors + JSON, wire.py, never pickle), saved and loaded
with every check a checkpoint someone hands over needs (its manifest, its counters, an optimizer state that fits the
model and its steps), and the rules a resume obeys (never fewer steps than done, a log that holds every step done).
"""
import math
from dataclasses import dataclass
from typing import Literal
from pathlib import Path

import torch
from pydantic import ConfigDict, StrictBool, StrictStr, conint

from opd.io import wire
from opd.health.rules import FLOOR_PLAN
from opd.models.checkpoint import MANIFEST, load_checkpoint, read_manifest, recover_checkpoint, save_checkpoint
from opd.config.run import TrainConfig
from opd.io.errors import OpdError, require
from opd.numerics.kv_cache import scales_fit
from opd.numerics.plan import Plan
from opd.config.runlog import read_guard_events, read_metrics
from opd.io.schema import Schema, check, read_json


@dataclass
class State:
    step: int = 0  # optimizer steps attempted so far (the next step's index)
    version: int = 0  # policy version of the engine's weights: optimizer steps actually taken
    bad_steps: int = 0  # non-finite steps in a row
    skipped: int = 0  # non-finite steps in total
    fallback: bool = False  # the runtime guard switched the rollouts to a safer plan (kept on resume)
    fallback_plan: str = ""  # the plan it switched to last ("" with fallback: BF16, as before this field existed)
    canary: str = ""  # canary training's phase (canary.PHASES); "": no canary


STATE_FILE = "trainer_state.safetensors"  # optimizer, engine scales, async batches: tensors + JSON (wire.py)
PICKLED_STATE = "trainer_state.pt"  # what releases before 2026-12 wrote: a pickle, never loaded


class StateFile(Schema):
    """trainer_state.json: the loop's counters (State): steps attempted, of them taken (version) and skipped."""
    model_config = ConfigDict(strict=True, extra="forbid")
    step: conint(strict=True, ge=0, lt=2 ** 31)
    version: conint(strict=True, ge=0, lt=2 ** 31)
    bad_steps: conint(strict=True, ge=0, lt=2 ** 31) = 0
    skipped: conint(strict=True, ge=0, lt=2 ** 31) = 0
    fallback: StrictBool = False
    fallback_plan: StrictStr = ""
    canary: Literal["", "shadow", "promoted", "rejected", "undecided", "fallen_back"] = ""


def save_state(run_dir: Path, run, wait: bool = True) -> None:
    """run: the train.setup.Run being saved. wait (async): collect the batches in flight first, so that a resume continues exactly. Everything is tensors +
    JSON: a checkpoint someone hands you cannot run code when it is resumed (wire.py)."""
    shard, student = run.shard, run.student
    rollouts = run.rollouts.state_dict(wait)
    if shard is not None:  # every rank gathers (a collective), rank 0 writes the one-rank run's checkpoint
        optimizer, student = shard.full_optimizer_state(run.opt), shard.full_model
        ranks = shard.gather(rollouts.pop("async", None))  # each rank's async batches in flight, in rank order
        if not shard.leader:
            return
        if ranks[0] is not None:
            rollouts["async_ranks"] = ranks
    else:
        optimizer = run.opt.state_dict()
    blob = {"optimizer": optimizer, **rollouts}
    blob |= run.teacher.state_dict()  # a teacher engine's calibrated KV scales, kept for its lifetime
    if run.canary is not None:
        blob |= run.canary.state_dict()
    save_checkpoint(run_dir / "checkpoint", student, run.tok, extra_json={"trainer_state.json": vars(run.state)},
                    extra_trees={STATE_FILE: blob})


def load_state(run_dir: Path, run) -> tuple[State, dict]:
    """run: the train.setup.Run to restore into -> (trainer state, the saved blob: the optimizer's state and what `Rollouts.state_dict` saved, for
    `Rollouts.start`). The student's weights and the optimizer are loaded; a guard fallback recorded in the state is
    applied to the rollouts."""
    folder = run_dir / "checkpoint"
    recover_checkpoint(folder)
    fix = "the checkpoint is damaged or was not written by opd: start the run again with --overwrite"
    if (folder / PICKLED_STATE).is_file():
        raise OpdError(f"{folder / PICKLED_STATE} is a pickle (an earlier opd's trainer state); opd does not unpickle "
                       "files, which can run code", "start the run again with --overwrite")
    require(not folder.exists() or folder.is_dir(), f"{folder} is not a checkpoint folder", fix)
    if not (folder / STATE_FILE).is_file():
        return State(), {}  # interrupted before the first checkpoint: start over
    saved, _ = load_checkpoint(folder)  # checks every file its manifest lists
    listed = read_manifest(folder)
    unlisted = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST and p.name not in listed)
    if not listed or unlisted:
        what = f"{unlisted[0]} is not in its {MANIFEST}" if listed else f"it has no {MANIFEST}"
        raise OpdError(f"checkpoint {folder}: {what} (every file of a run's checkpoint is listed and checked)", fix)
    require(saved.cfg == run.student.cfg, f"checkpoint {folder} holds another model than the run's student "
            f"({saved.cfg.arch}, {saved.cfg.num_layers} layers x {saved.cfg.hidden_size})", fix)
    state = State(**check(StateFile, read_json(folder / "trainer_state.json", "trainer state", fix),
                          str(folder / "trainer_state.json"), fix).model_dump())
    require(state.version + state.skipped == state.step and state.bad_steps <= state.skipped,
            f"{folder / 'trainer_state.json'}: its counters disagree (step {state.step} = version {state.version} + "
            f"skipped {state.skipped}, bad_steps <= skipped)", fix)
    blob = wire.decode_file(folder / STATE_FILE, run.student.embed_tokens.weight.device, str(folder / STATE_FILE))
    scales = blob.get("engine_scales", {}) if isinstance(blob, dict) else None
    require(isinstance(blob, dict) and isinstance(blob.get("optimizer"), dict) and
            scales_fit(scales, run.student.cfg.num_layers, run.student.cfg.num_kv_heads),
        f"{folder / STATE_FILE}: not a trainer state of this model (its optimizer or KV scales)", fix)
    run.teacher.load_state_dict(blob, str(folder / STATE_FILE))
    check_optimizer_state(run.opt, blob["optimizer"], state.version, str(folder / STATE_FILE), fix)
    run.student.load_state_dict(saved.state_dict())
    run.opt.load_state_dict(blob["optimizer"])
    run.state = state
    if run.canary is not None:
        run.canary.load_state_dict(blob, str(folder / STATE_FILE), fix)
    if state.fallback:
        run.use_plan(Plan.parse(state.fallback_plan or FLOOR_PLAN, run.student.cfg.num_layers))
    return state, blob


def check_optimizer_state(opt: torch.optim.Optimizer, saved: dict, version: int, where: str, fix: str) -> None:
    """A saved AdamW state fits `opt` after `version` optimizer steps: the same groups and parameters, the config's
    settings, and per parameter a step count equal to version and finite moments of the parameter's shape (torch
    would accept a misfit one and fail, or compute garbage, at the first step)."""
    fresh = opt.state_dict()
    groups, state = saved.get("param_groups"), saved.get("state")
    ok = isinstance(groups, list) and isinstance(state, dict) and len(groups) == len(fresh["param_groups"])
    require(ok, f"{where}: the optimizer state does not fit this model (its parameter groups)", fix)
    for group, mine in zip(groups, fresh["param_groups"]):
        require(isinstance(group, dict) and group.keys() == mine.keys() and group["params"] == mine["params"],
                f"{where}: the optimizer state does not fit this model (its parameter groups)", fix)
        # the settings come from the config, which a resume keeps: equal, except the learning rate of the schedule
        require(all(group[k] == mine[k] for k in mine if k not in ("lr", "params")) and
                isinstance(group["lr"], float) and math.isfinite(group["lr"]) and group["lr"] >= 0,
                f"{where}: the optimizer's settings (betas, eps, weight decay, lr) are not this config's", fix)
    params = [p for group in opt.param_groups for p in group["params"]]
    for index, entry in state.items():
        shape = params[index].shape if isinstance(index, int) and 0 <= index < len(params) else None
        good = shape is not None and isinstance(entry, dict) and set(entry) == {"step", "exp_avg", "exp_avg_sq"} and \
            all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and bool(torch.isfinite(t).all())
                for t in entry.values()) and \
            entry["step"].shape == () and entry["exp_avg"].shape == shape == entry["exp_avg_sq"].shape and \
            float(entry["step"]) == version and bool((entry["exp_avg_sq"] >= 0).all())  # a second moment is >= 0
        require(good, f"{where}: the optimizer state of parameter {index!r:.20} does not fit this model or its "
                f"{version} steps, or is not finite", fix)


def check_resume(run_dir: Path, cfg: TrainConfig, state: State) -> None:
    """The resume rules, checked before anything is written: a run is not resumed to fewer steps than it has done
    (that would rewrite its history), and its log must hold every step its checkpoint has done (a log behind its
    checkpoint cannot be repaired without re-running those steps: refused)."""
    require(cfg.steps >= state.step, f"{run_dir} has done {state.step} steps; steps={cfg.steps} is fewer",
            f"resume with steps >= {state.step}, or start again with --overwrite")
    read_guard_events(run_dir)  # checked now: read again (and cut back) once the run goes on
    if not state.step:
        return
    steps = [row["step"] for row in read_metrics(run_dir)] if (run_dir / "metrics.jsonl").is_file() else []
    require(all(a < b for a, b in zip(steps, steps[1:])), f"{run_dir}/metrics.jsonl does not hold each step once, "
            "in order", "the log is damaged: start again with --overwrite")
    logged = set(steps)
    missing = [s for s in range(state.step) if s not in logged]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise OpdError(f"{run_dir}/metrics.jsonl lacks step {missing[0]}{more} of the {state.step} its checkpoint has "
                       "done", "the log is behind its checkpoint and cannot be rebuilt without re-running those steps: "
                       "start again with --overwrite")
