"""The `opd` subcommands of the study and the admission check: sweep, sensitivity, report, calibrate, admit (cli.py
runs them).
"""
import argparse
import json
import sys
from pathlib import Path

from opd.cli.args import batch_count, command, finite_float, int_in, positive_int
from opd.io.errors import require
from opd.numerics.plan import Plan
from opd.training.pretrain import FAMILIES
from opd.study.sensitivity import SETTINGS
from opd.data.task import TASKS


def sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", type=Path, help="YAML grid (default: the built-in tolerance study, see opd/study/sweep.py)")
    p.add_argument("--out", type=Path, default=Path("runs/sweep"), help="results.jsonl, run folders and plots go here")
    p.add_argument("--family", action="append", choices=FAMILIES, help="only these families of the grid (repeatable)")
    p.add_argument("--plot-only", action="store_true", help="no runs: plots and knees from the results file")
    p.add_argument("--quiet", action="store_true", help="no per-run progress lines")


@command(sweep_arguments)
def cmd_sweep(grid: Path | None, out: Path, family: list[str] | None, plot_only: bool, quiet: bool) -> int | None:
    """A grid of short OPD runs over mismatch sources and levels (resumable); then the plots and the knee per source."""
    from opd.study.sweep import load_grid, read_results, run_sweep
    from opd.study.tolerance import report
    results = out / "results.jsonl"
    if plot_only:
        require(results.is_file(), f"no results file {results}", "run `opd sweep` first, or point --out at one")
        rows = read_results(results)
    else:
        try:
            rows = run_sweep(load_grid(grid), out, family, progress=not quiet)
        except KeyboardInterrupt as e:  # the run in progress is not resumed: the same command runs it again
            print(f"opd: interrupted: finished runs are in {results}; the same command continues the sweep",
                  file=sys.stderr)
            return 128 + getattr(e, "signum", 2)
    print(report(rows, out))


def sensitivity_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", action="append", choices=FAMILIES, help="built-in pairs (default: all; repeatable)")
    p.add_argument("--student", type=Path, help="HF checkpoint folder instead of a built-in pair (with --teacher)")
    p.add_argument("--teacher", type=Path, help="HF checkpoint folder of the teacher (scores the probe)")
    p.add_argument("--task", choices=list(TASKS), default="chain", help="whose training prompts the probe samples")
    p.add_argument("--setting", action="append", help=f"plan settings to place on one layer at a time "
                   f"(repeatable; default: {' | '.join(SETTINGS)})")
    p.add_argument("--base", default="", help="the plan of every other layer (default: full precision; e.g. "
                   "\"forward=bf16 kv=bf16\", a bf16 engine)")
    p.add_argument("--rollouts", type=batch_count, default=32, help="probe batch size")
    p.add_argument("--out", type=Path, default=Path("runs/sensitivity"), help="sensitivity.json and .png go here")
    p.add_argument("--threads", type=positive_int, default=2)


@command(sensitivity_arguments)
def cmd_sensitivity(family: list[str] | None, student: Path | None, teacher: Path | None, task: str,
                    setting: list[str] | None, base: str, rollouts: int, out: Path, threads: int) -> None:
    """Per-layer sensitivity: the mismatch when only one layer's KV cache or weights run at lower precision."""
    from opd.config.run import TrainConfig
    from opd.config.sections import TeacherConfig
    from opd.config.runlog import check_writable
    from opd.study.sensitivity import SETTINGS, layer_map, write
    from opd.training.setup import probe_setup
    check_writable(out, "--out")
    require(bool(student) == bool(teacher), "give both --student and --teacher, or neither",
            "neither: the built-in pairs")
    common = dict(task=task, plan="", threads=threads)
    targets = {"model": TrainConfig(student=str(student), teacher=TeacherConfig(str(teacher)), **common)} if student \
        else {f: TrainConfig(family=f, **common) for f in family or FAMILIES}
    maps = {}
    for name, cfg in targets.items():
        setup, _ = probe_setup(cfg, rollouts)
        for s in setting or []:
            Plan.parse(f"{base}; 0: {s}", setup.student.cfg.num_layers)  # a bad setting fails before measuring
        maps[name] = layer_map(setup, tuple(setting or SETTINGS), base)
    print(write(maps, out, base))


def report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="folders written by opd train")
    p.add_argument("--out", type=Path, default=Path("runs/report"), help="report.md, report.html and the PNGs")


@command(report_arguments)
def cmd_report(run_dirs: list[Path], out: Path) -> None:
    """A Markdown + HTML report (training curves, mismatch over time, quality vs mismatch, speed) from run folders."""
    from opd.study.report import write_report
    from opd.config.runlog import check_writable
    check_writable(out, "--out")
    print(f"wrote {write_report(run_dirs, out)} and {out / 'report.html'}")


def calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", type=Path, help="a sweep's results.jsonl")
    p.add_argument("-o", "--out", type=Path, default=Path("thresholds.json"), help="the thresholds file to write")


@command(calibrate_arguments)
def cmd_calibrate(results: Path, out: Path) -> None:
    """Admission thresholds from sweep results: per estimator class, the mismatch that separates fine from degraded."""
    from opd.health.thresholds import calibrate
    from opd.config.runlog import write_atomic
    from opd.study.sweep import read_results
    from opd.study.tolerance import label
    require(results.is_file(), f"no results file {results}", "run `opd sweep` first")
    require(not out.is_dir(), f"-o {out} is a folder", "name the thresholds file to write")
    rows = [r for r in label(read_results(results)) if r["degraded"] is not None]
    thresholds = calibrate(rows) | {"calibrated_from": str(results), "runs": len(rows)}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(thresholds, indent=2) + "\n")
    for cls, entry in thresholds["classes"].items():
        drift = "not calibrated" if entry["max_drift"] is None else f"{entry['max_drift']:.3g}"
        if len(entry.get("max_drift_by_model") or {}) > 1:
            drift += " (" + ", ".join(f"{m} {'-' if d is None else f'{d:.3g}'}"
                                      for m, d in entry["max_drift_by_model"].items()) + ")"
        print(f"{cls:10} ADMIT {thresholds['metric']} <= {entry['max']:.3g}, REJECT > {entry['reject']:.3g} "
              f"({'knee' if entry['knee'] else 'no degradation seen'}; {entry['errors']} of {entry['runs']} runs "
              f"misclassified)  staleness x lr <= {drift}")
    print(f"wrote {out}")


def admit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="the training config (YAML) whose rollout set-up is checked")
    p.add_argument("--set", dest="overrides", action="append", metavar="KEY=VALUE", help="as in `opd train`")
    p.add_argument("--thresholds", default="", help="from `opd calibrate` (default: the shipped opd/thresholds.json)")
    p.add_argument("--limit", type=finite_float, default=0.0,
                   help="override the limit on the noise-to-signal ratio nsr (0: the calibrated one)")
    p.add_argument("--rollouts", type=batch_count, default=16, help="probe batch size")
    p.add_argument("--json", dest="as_json", action="store_true", help="print the full result as JSON")
    p.add_argument("--no-propose", dest="propose", action="store_false", help="on REJECT, do not search for a plan")
    p.add_argument("--self", dest="self_calibrated", action="store_true",
                   help="decide from this model and recipe alone: the candidate's gradient bias against the BF16 "
                        "noise of the same recipe (no calibration of ours on the model; docs/admission.md)")
    p.add_argument("--trial", type=int_in(0, 10_001), default=0, metavar="K",
                   help="decide from a paired trial instead: K steps of this recipe for the candidate, its BF16 twin "
                        "and --trial-seeds more BF16 seeds, on fixed held-out contexts (cost: K x (2 + seeds) "
                        "steps; docs/admission.md)")
    p.add_argument("--trial-seeds", type=int_in(1, 17), default=2, help="with --trial: BF16 seeds beside the twin")
    p.add_argument("--batches", type=int_in(2, 4097), default=8,
                   help="with --self: batches of the run's prompts measured (cost: 2 x batches gradients)")
    p.add_argument("--spill", default="", metavar="DIR",
                   help="with --self: keep the statistic's sums (20 bytes a parameter) in files in this folder "
                        "instead of memory, for a student whose sums do not fit")
    p.add_argument("--warmup", type=warmup_steps, default="auto",
                   help="probe the student after this many steps of the run's recipe with BF16 rollouts (a student "
                        "whose first steps move it far, as a pruned one); 0: the initial student; auto (default): the "
                        "initial student, then, if that probe is not admitted, its student is far from the teacher "
                        "and its loss is a full-distribution one, the student after 4 BF16 steps with the thresholds "
                        "calibrated so")


def warmup_steps(text: str) -> int | str:
    """An argparse type: "auto" or an integer in [0, 10000]."""
    if text == "auto":
        return text
    try:
        return int_in(0, 10_001)(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (use auto or a step count in [0, 10000])") from None


@command(admit_arguments)
def cmd_admit(config: Path | None, overrides: list[str], thresholds: str, limit: float, rollouts: int,
              as_json: bool, propose: bool, warmup: int | str, self_calibrated: bool, batches: int, trial: int,
              trial_seeds: int, spill: str) -> int:
    """Before training: is this rollout configuration safe for OPD? ADMIT (exit 0), REJECT (exit 1) or UNCERTAIN (exit
    3: run it only under the runtime guard), with reasons."""
    from opd import admit
    from opd.config.files import load_config
    cfg = load_config(config, overrides or [])
    require(limit >= 0, f"--limit must be >= 0, got {limit}", "0 uses the calibrated limit")
    require(not (trial and self_calibrated), "--trial and --self are two checks", "choose one")
    require(not spill or self_calibrated, "--spill is for --self's sums", "add --self, or leave --spill out")
    result = admit(cfg, rollouts, thresholds, limit, propose, warmup, self_calibrated, batches, trial, trial_seeds,
                   spill)
    if as_json:
        print(json.dumps(result, indent=2))
    elif self_calibrated or trial:
        if trial:
            print(f"{result['decision']}  plan: {result['plan']}  (paired trial: z {result['z']:.2f} +- "
                  f"{result['z_se']:.2f}, cut {result['cut']:g}; {result['steps']} steps x "
                  f"{len(result['run_seconds'])} runs = {result['cost_steps']} steps, "
                  f"{100 * result['cost_share']:.0f}% of this run's; {result['seconds']:.0f} s)")
        else:
            print(f"{result['decision']}  plan: {result['plan']}  (self-calibrated: z {result['z']:.2f} +- "
                  f"{result['z_se']:.2f}, cut {result['cut']:g}; estimator class '{result['estimator_class']}', "
                  f"staleness {result['staleness']}, {result['batches']} batches, {result['seconds']:.1f} s)")
        for reason in result["reasons"]:
            print(f"  - {reason}")
        proposal = result.get("proposal")
        if proposal:
            what = (f"plan {proposal['plan']}" if proposal.get("plan") else
                    f"async.max_staleness {proposal['max_staleness']}" if "max_staleness" in proposal else None)
            print(f"  proposed: {what} (z {proposal['z']:.2f}; {proposal['note']})" if what
                  else f"  nothing proposed: {proposal['note']}")
            if proposal.get("vllm_flags"):
                print(f"  on a vLLM server: {proposal['vllm_flags']}")
    else:
        print(f"{result['decision']}  plan: {result['plan']}  (estimator class '{result['estimator_class']}', "
              f"staleness {result['staleness']}, {result['probe_rollouts']} probe rollouts, {result['seconds']:.1f} s"
              + (f", after {result['warmup_steps']} BF16 steps ({result['warmup_seconds']:.0f} s)"
                 if result["warmup_steps"] else "") + ")")
        for reason in result["reasons"]:
            print(f"  - {reason}")
        proposal = result.get("proposal")
        if proposal:
            note = f" ({proposal['note']})" if proposal.get("note") else ""
            print(f"  proposed plan: {proposal['plan']}{note}" if proposal["plan"]
                  else f"  no plan proposed: {proposal['note']}")
            if proposal.get("vllm_flags"):
                print(f"  on a vLLM server: {proposal['vllm_flags']}")
            elif proposal.get("vllm_refused"):
                print(f"  not runnable on vLLM: {proposal['vllm_refused']}")
        if proposal and proposal["layer_kl"]:
            print("  KL of the candidate setting on one layer alone (BF16 elsewhere): "
                  + ", ".join(f"layer {i} {v:.2g}" for i, v in enumerate(proposal["layer_kl"])))
    return {"ADMIT": 0, "REJECT": 1, "UNCERTAIN": 3}[result["decision"]]
