"""The study's files, fuzzed (fuzzlib.py): sweep grids, sweep results, thresholds files and the run directory that
`opd report` reads. Each example mutates a valid file and must end in success or one `opd: error:` line, no
traceback; a file that loads must also work in the code that uses it (a grid expands to configs, a thresholds file
decides for every class, results are tabled and calibrated, a run is reported)."""
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzzlib import EXAMPLES, FUZZ, mutated_file, outcome
from opd import cli
from opd.health.rules import CLASSES, decide_numbers
from opd.models.checkpoint import save_checkpoint
from opd.config.files import build_config
from opd.models.model import ModelConfig, Transformer
from opd.study.report import load_run, markdown
from opd.study.sweep import expand, finished_keys, load_grid, read_results
from opd.health.thresholds import DEFAULT_THRESHOLDS, load_thresholds
from opd.models.tokenizer import TextTokenizer
from opd.study.tolerance import fp8_answer, knees, out_of_sample, pivot, table
from opd.training.trainer import train

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]
ROOT = Path(__file__).parents[1]
PLOTTED = settings(FUZZ, max_examples=max(3, EXAMPLES // 10))  # the examples that also draw the PNGs (~1 s each)

GRID = b"""families: [llama, qwen3]
base: {steps: 60, batch_size: 32, save_every: 0, threads: 1, optim: {warmup_steps: 5, schedule: constant},
       eval: {every: 0, examples: 100}}
estimators:
  full_rkl: {loss: {name: full_rkl}, optim: {lr: 3.0e-4}}
  sampled_tis: {loss: {name: sampled_rkl, student_term: learner, correction: tis, cap: 2.0}, optim: {lr: 1.0e-4}}
seeds: [0]
points:
  - {source: bf16, level: 0, set: {plan: "forward=bf16 kv=bf16"}, seeds: [0, 1, 2]}
  - {source: kv, level: fp8_e4m3, set: {plan: "forward=bf16 kv=fp8_e4m3"}}
  - {source: noise, level: 0.3, set: {plan: {"*": "forward=bf16 kv=bf16 noise=0.3"}}}
  - {source: staleness, level: 2, set: {schedule: async, async: {max_staleness: 2}, threads: 2}}
"""


def study_rows() -> bytes:
    """A slice of a stored study: one family, two estimators, every source (BF16 seeds included), as written."""
    lines = (ROOT / "studies" / "data" / "numerics_results.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["family"] == "llama"
            and json.loads(line)["estimator"] in ("full_rkl", "sampled_mu")]
    return ("\n".join(kept) + "\n").encode()


RESULTS = study_rows()


@FUZZ
@given(st.data())
def test_grids(tmp_path, data):
    path = tmp_path / "grid.yaml"
    path.write_bytes(data.draw(mutated_file(GRID, "yaml")))
    outcome(lambda: expand(load_grid(path)) and None, tmp_path)


@FUZZ
@given(st.data())
def test_results(tmp_path, data):
    """calibrate in-process; the tolerance tables, knees and admission decisions on what read_results keeps; the
    resume's finished keys."""
    path, out = tmp_path / "results.jsonl", tmp_path / "thresholds.json"
    out.unlink(missing_ok=True)
    path.write_bytes(data.draw(mutated_file(RESULTS, "jsonl")))
    outcome(lambda: cli.main(["calibrate", str(path), "-o", str(out)]), tmp_path)
    if out.is_file():  # what calibrate wrote, the admission check reads
        outcome(lambda: load_thresholds(out) and None)

    def analyse():
        rows = read_results(path)
        table(rows), pivot(rows), knees(rows), fp8_answer(rows), finished_keys(rows)
        out_of_sample(rows, load_thresholds(), ("kv", "noise"))
    outcome(analyse, tmp_path)


@PLOTTED
@given(st.data())
def test_results_plots(tmp_path, data):
    """`opd sweep --plot-only`: the knees, tables and PNGs from a damaged results file."""
    (tmp_path / "results.jsonl").write_bytes(data.draw(mutated_file(RESULTS, "jsonl")))
    outcome(lambda: cli.main(["sweep", "--plot-only", "--out", str(tmp_path)]), tmp_path)


@FUZZ
@given(st.data())
def test_thresholds(tmp_path, data):
    path = tmp_path / "thresholds.json"
    path.write_bytes(data.draw(mutated_file(DEFAULT_THRESHOLDS.read_bytes(), "json")))

    def use():
        thresholds = load_thresholds(path)
        for cls in CLASSES:
            for nsr in (1e-3, 0.1, 10.0, math.nan):
                decide_numbers({"nsr": nsr, "floor_nsr": 1e-3, "kl_k3": 0.01, "floor_kl_k3": 1e-4, "ess_frac": 0.9,
                        "adv_sign_flip": 0.01}, thresholds, cls, staleness=2, lr=1e-3).to_dict()
            decide_numbers({"nsr": 0.1}, thresholds, cls).to_dict()
    outcome(use, tmp_path)


# ---- a run directory, as `opd report` reads it --------------------------------------------------------------------

RUN_FILES = {"config.yaml": "yaml", "summary.json": "json", "metrics.jsonl": "jsonl", "guard.jsonl": "jsonl"}
GUARD = {"step": 2, "action": "warn", "nsr": 0.5, "ess_frac": 0.9, "limit": 0.1, "reject_at": 0.2, "plan": "kv=bf16",
         "reasons": ["noise-to-signal nsr 0.5 > limit 0.1"]}


@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> dict[str, bytes]:
    """The files `opd report` reads, from a finished 3-step run of a tiny random pair (plus one guard event)."""
    root = tmp_path_factory.mktemp("fuzz_run")
    tiny = ModelConfig(vocab_size=100, arch="llama", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=16, tie_word_embeddings=True, max_position_embeddings=64)
    for seed, role in enumerate(("student", "teacher")):
        model = Transformer(tiny).init_weights(torch.Generator().manual_seed(seed), std=0.2)
        save_checkpoint(root / role, model, TextTokenizer.builtin())
    cfg = build_config(dict(student=str(root / "student"), teacher=str(root / "teacher"), task="add", steps=3,
                            batch_size=4, eval=dict(every=2, examples=4), save_every=0, threads=1, plan="kv=fp8_e5m2"))
    train(cfg, root / "run", progress=False)
    files = {name: (root / "run" / name).read_bytes() for name in RUN_FILES if name != "guard.jsonl"}
    return files | {"guard.jsonl": (json.dumps(GUARD) + "\n" + json.dumps(GUARD | {"step": 3}) + "\n").encode()}


def damaged_run(folder: Path, run_files: dict, data) -> Path:
    """folder/run holding the run's files with one of them mutated."""
    run = folder / "run"
    run.mkdir(exist_ok=True)
    name = data.draw(st.sampled_from(sorted(RUN_FILES)))
    for key, content in run_files.items():
        (run / key).write_bytes(data.draw(mutated_file(content, RUN_FILES[key])) if key == name else content)
    return run


@FUZZ
@given(st.data())
def test_report_inputs(run_files, tmp_path, data):
    run = damaged_run(tmp_path, run_files, data)
    outcome(lambda: markdown([load_run(run)]) and None, tmp_path)


@PLOTTED
@given(st.data())
def test_report_cli(run_files, tmp_path, data):
    run = damaged_run(tmp_path, run_files, data)
    outcome(lambda: cli.main(["report", str(run), "--out", str(tmp_path / "report")]), tmp_path)
