"""PNG figures for the study, sensitivity and report modules: a headless pyplot, and atomic saves.

matplotlib is imported on first use (the training path never needs it) with the non-interactive Agg backend, so
plots work on machines without a display. A figure is written to a temporary sibling and renamed, like every other
output, so a killed process never leaves a half-written PNG.
"""
from pathlib import Path


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path) -> None:
    """Write fig to path atomically and release it."""
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        pyplot().close(fig)
