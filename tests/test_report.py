"""`opd report`: built from a short run, its PNGs exist and are non-empty, its Markdown links resolve, the HTML
embeds every figure. (A folder that is not a run: test_bad_input.py.)"""
import re

from opd.study.report import FIGURES
from opd.training.trainer import train

from helpers import config, opd


def test_report_from_short_runs(pair, tmp_path):
    train(config(pair, steps=4, eval=dict(every=2)), tmp_path / "fp32", progress=False)
    train(config(pair, steps=3, plan="kv=fp8_e5m2", schedule="async", async_=dict(max_staleness=1, backend="inline")),
          tmp_path / "fp8", progress=False)
    result = opd("report", tmp_path / "fp32", tmp_path / "fp8", "--out", tmp_path / "report")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "report"
    for name in FIGURES:
        assert (out / name).stat().st_size > 5_000
    text = (out / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(links) == sorted(FIGURES) and all((out / link).is_file() for link in links)
    assert "| fp32 | `float32` | sync | full_rkl | 4 |" in text
    assert "| fp8 | `kv=fp8_e5m2` | async k=1 (inline) |" in text
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "<table>" in page
