"""`opd report`: a report from run directories that reads without any other tool, in Markdown and in HTML.

It reads each run directory's `config.yaml`, `metrics.jsonl` and `summary.json` (runlog.py) and writes, into the
output folder:

    report.md     the tables and links to the figures next to it
    report.html   the same, with the figures embedded (one self-contained file)
    curves.png    training curves: the sampled reverse KL on the rollouts per step, held-out reverse KL points
    mismatch.png  mismatch over time: mismatch/kl_k3 (numerics) and stale/total_kl_k3 (with staleness), log scale
    quality.png   final held-out reverse KL vs mean rollout-vs-learner KL, one point per run

Tables: each run's set-up (plan, schedule, loss, steps) and quality before and after (greedy accuracy, held-out
reverse KL); speed (mean seconds per step, tokens/s, the split between sampling, teacher, learner); mismatch averages
and guard events. A run that has not finished (no summary.json) is reported from its metrics so far.

Every file is checked as data (schema.py) before anything is written: the config keys, summary numbers and metric
values the report shows or plots (`RunConfig`, `Summary`, `ReportRow`), finite where plotted; guard.jsonl as the
trainer reads it (runlog.read_guard_events). A damaged run directory is one line naming the file, the line and the key.
"""
import base64
import html
import math
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, create_model

from opd.io.errors import require
from opd.io.figures import pyplot, save
from opd.config.runlog import MetricsRow, read_guard_events, write_atomic
from opd.io.schema import Schema, check, read_json, read_jsonl, read_yaml

FIGURES = ("curves.png", "mismatch.png", "quality.png")


Finite = Annotated[float, Field(allow_inf_nan=False)]
PLOTTED = ("loss/rkl_sampled", "eval/rkl", "eval/accuracy", "mismatch/kl_k3", "stale/total_kl_k3", "time/step",
           "throughput/tokens_per_s", "time/generate", "time/teacher", "time/train", "time/sync", "opd/nsr",
           "opd/adv_sign_flip", "is/ess_frac", "stale/version_gap_mean")  # the metrics the tables and figures read


class Loss(Schema):
    name: str


class RunConfig(Schema):
    plan: str | dict[str, Any]
    schedule: str
    loss: Loss


Evals = create_model("Evals", __base__=Schema, **{
    name.replace("/", "_"): (Finite | None, Field(None, alias=name)) for name in ("eval/accuracy", "eval/rkl")})


class Summary(Schema):
    before: Evals | None = None
    after: Evals | None = None


ReportRow = create_model("ReportRow", __base__=MetricsRow, **{  # runlog's row (step, time) + what the report reads
    name.replace("/", "_"): (Finite | None, Field(None, alias=name)) for name in PLOTTED})


def load_run(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    require((run_dir / "metrics.jsonl").is_file() and (run_dir / "config.yaml").is_file(),
            f"{run_dir} is not an opd run directory (no metrics.jsonl / config.yaml)", "pass folders made by opd train")
    fix = "re-run it, or leave it out of the report"
    config = read_yaml(run_dir / "config.yaml", "config.yaml", fix)
    check(RunConfig, config, str(run_dir / "config.yaml"), fix)
    summary = {}
    if (run_dir / "summary.json").is_file():
        summary = read_json(run_dir / "summary.json", "summary.json", fix)
        check(Summary, summary, str(run_dir / "summary.json"), fix)
    rows = [row.model_dump(by_alias=True, exclude_unset=True)  # a torn last line is dropped, as runlog reads it
            for row in read_jsonl(run_dir / "metrics.jsonl", "metrics.jsonl", ReportRow, fix=fix)]
    require(bool(rows), f"{run_dir} has no logged steps yet", "report on a run that has taken at least one step")
    evals = [r for r in rows if r.get("eval/rkl") is not None]
    return {"name": run_dir.name, "dir": run_dir, "config": config, "summary": summary, "rows": rows,
            "before": summary.get("before") or (evals[0] if evals else {}),
            "after": summary.get("after") or (evals[-1] if len(evals) > 1 else {}),
            "guard_events": len(read_guard_events(run_dir))}


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(values) / len(values) if values else math.nan


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _schedule(cfg: dict) -> str:
    """sync, or async with its staleness bound and where it samples (async.backend: process, ray, inline)."""
    if cfg["schedule"] != "async":
        return cfg["schedule"]
    settings = cfg.get("async", {})
    return f"async k={settings.get('max_staleness', '?')} ({settings.get('backend', 'process')})"


def tables(runs: list[dict]) -> str:
    setup = ["| run | plan | schedule | loss | steps | accuracy before -> after "
             "| held-out reverse KL before -> after |", "|---|---|---|---|---|---|---|"]
    speed = ["| run | s/step | tokens/s | generate s | teacher s | train s | sync s |", "|---|---|---|---|---|---|---|"]
    mismatch = ["| run | kl_k3 | total_kl_k3 | nsr | adv_sign_flip | ess_frac | staleness (mean gap) | guard events |",
                "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        cfg, rows, b, a = run["config"], [r for r in run["rows"] if "time/step" in r], run["before"], run["after"]
        name = _cell(run["name"])
        setup.append(f"| {name} | `{_cell(cfg['plan'] or 'float32')}` | {_cell(_schedule(cfg))} | "
                     f"{_cell(cfg['loss']['name'])} | "
                     f"{len(rows)} | {_fmt(b.get('eval/accuracy'))} -> {_fmt(a.get('eval/accuracy'))} | "
                     f"{_fmt(b.get('eval/rkl'), '.4f')} -> {_fmt(a.get('eval/rkl'), '.4f')} |")
        speed.append(f"| {name} | {_fmt(mean(rows, 'time/step'))} | "
                     f"{_fmt(mean(rows, 'throughput/tokens_per_s'), '.0f')} | "
                     f"{_fmt(mean(rows, 'time/generate'))} | {_fmt(mean(rows, 'time/teacher'))} | "
                     f"{_fmt(mean(rows, 'time/train'))} | {_fmt(mean(rows, 'time/sync'))} |")
        mismatch.append(f"| {name} | {_fmt(mean(rows, 'mismatch/kl_k3'), '.2e')} | "
                        f"{_fmt(mean(rows, 'stale/total_kl_k3'), '.2e')} | {_fmt(mean(rows, 'opd/nsr'), '.3g')} | "
                        f"{_fmt(mean(rows, 'opd/adv_sign_flip'), '.4f')} | {_fmt(mean(rows, 'is/ess_frac'))} | "
                        f"{_fmt(mean(rows, 'stale/version_gap_mean'), '.2f')} | {run['guard_events']} |")
    return "\n".join(["## Runs", "", *setup, "", "## Speed (means over steps)", "", *speed, "",
                      "## Mismatch (means over steps)", "", *mismatch])


def _cell(value) -> str:
    """A value as one Markdown table cell: on one line, its pipes escaped (to_html splits on the others)."""
    return " ".join(str(value).split()).replace("|", "\\|")


def _label(text: str) -> str:
    """Text for a figure: a `$` would start matplotlib's math mode."""
    return text.replace("$", "\\$")


def figures(runs: list[dict], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run in enumerate(runs):
        steps = [(r["step"], r["loss/rkl_sampled"]) for r in run["rows"] if r.get("loss/rkl_sampled") is not None]
        evals = [(r["step"], r["eval/rkl"]) for r in run["rows"] if r.get("eval/rkl") is not None]
        name = _label(run["name"])
        if steps:
            ax.plot(*zip(*steps), color=f"C{i}", lw=0.8, alpha=0.7, label=f"{name} (rollouts)")
        if evals:
            ax.plot(*zip(*evals), "o--", color=f"C{i}", label=f"{name} (held-out)")
    ax.set_yscale("symlog", linthresh=0.01)  # log-like, but a sampled estimate can dip below 0
    ax.set(xlabel="step", ylabel="reverse KL to the teacher")
    _save(fig, ax, out / "curves.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, run in enumerate(runs):
        for key, style in (("mismatch/kl_k3", "-"), ("stale/total_kl_k3", ":")):
            points = [(r["step"], max(r[key], 1e-12)) for r in run["rows"] if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), style, color=f"C{i}", lw=0.9,
                        label=f"{_label(run['name'])} {key.split('/')[1]}")
    ax.set(xlabel="step", ylabel="KL(rollout || train), k3 estimate", yscale="log")
    _save(fig, ax, out / "mismatch.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, run in enumerate(runs):
        x, y = mean(run["rows"], "stale/total_kl_k3"), run["after"].get("eval/rkl")
        x = mean(run["rows"], "mismatch/kl_k3") if math.isnan(x) else x  # runs logged before total_kl_k3 existed
        if y is not None and math.isfinite(x):
            ax.scatter([max(x, 1e-12)], [y], color=f"C{i}", label=_label(run["name"]))
    ax.set(xlabel="rollout vs learner KL (mean over training)", ylabel="held-out reverse KL after", xscale="log")
    _save(fig, ax, out / "quality.png")


def _save(fig, ax, path: Path) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def markdown(runs: list[dict]) -> str:
    return "\n".join([f"# OPD report: {', '.join(r['name'] for r in runs)}", "",
                      "Run directories: " + ", ".join(f"`{r['dir']}`" for r in runs), "", tables(runs), "",
                      "## Figures", "", "Training curves:", "", "![training curves](curves.png)", "",
                      "Mismatch over time:", "", "![mismatch over time](mismatch.png)", "",
                      "Quality vs mismatch:", "", "![quality vs mismatch](quality.png)", ""])


def to_html(text: str, out: Path) -> str:
    """The Markdown above as HTML (its subset: headings, tables, images, paragraphs), images inlined as base64."""
    body, table = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            if not set(line) <= set("|-"):
                table.append(line)
            continue
        if table:
            cells = [[html.escape(c.strip().replace("\\|", "|")) for c in re.split(r"(?<!\\)\|", row.strip()[1:-1])]
                     for row in table]
            body.append("<table><tr>" + "".join(f"<th>{c}</th>" for c in cells[0]) + "</tr>" + "".join(
                "<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in cells[1:]) + "</table>")
            table = []
        if match := re.fullmatch(r"!\[(.*)\]\((.*)\)", line):
            data = base64.b64encode((out / match[2]).read_bytes()).decode()
            body.append(f'<img alt="{html.escape(match[1])}" src="data:image/png;base64,{data}">')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('#').strip())}</h{level}>")
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    style = "body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}" \
            "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}img{max-width:100%}"
    return f"<!doctype html><html><head><meta charset='utf-8'><title>OPD report</title><style>{style}</style>" \
           f"</head><body>{''.join(body)}</body></html>\n"


def write_report(run_dirs: list[Path], out: Path) -> Path:
    runs = [load_run(d) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    figures(runs, out)
    text = markdown(runs)
    write_atomic(out / "report.md", text)
    write_atomic(out / "report.html", to_html(text, out))
    return out / "report.md"
