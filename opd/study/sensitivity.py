"""Per-layer sensitivity: the mismatch when only one layer's KV cache (or only its weights) runs at lower precision.

For each setting (e.g. `kv=fp8_e4m3`) and each layer i, the engine runs the plan `<base>; i: <setting>` (every other
layer as the base plan says: full precision by default, or e.g. `forward=bf16 kv=bf16`, a bf16 engine whose
forward stays bf16 around the layer) on one fixed probe batch of the student's own rollouts, and the trainer's full-precision forward
recomputes them: the cell is `kl_exact`, the exact per-position KL(rollout || train) averaged over the batch
(`kl_k3` for engines that return only the sampled tokens' log-probs). Every cell uses the same prompts and sampling
seed, so cells differ only in where the mismatch enters. The spread of a setting is its most sensitive layer's KL
over its least sensitive layer's. `opd admit` uses the same per-layer measurement to choose which layers to keep in
BF16 when it proposes a plan.
"""
import json
import math
from pathlib import Path

from opd.admission.probe import measure
from opd.io.figures import pyplot, save
from opd.numerics.plan import Plan

SETTINGS = ("kv=fp8_e4m3", "kv=fp8_e5m2", "kv=int4", "w=fp8", "w=int4", "noise=0.1")


def layer_map(setup, settings: tuple[str, ...] = SETTINGS, base: str = "") -> dict[str, list[float]]:
    """-> {setting: [KL of the plan with only layer i at that setting (the base plan elsewhere), for each layer]}."""
    n = setup.student.cfg.num_layers
    out = {}
    for setting in settings:
        cells = []
        for i in range(n):
            numbers = measure(setup, Plan.parse(f"{base}; {i}: {setting}", n))
            cells.append(numbers.get("kl_exact", numbers["kl_k3"]))
        out[setting] = cells
    return out


def spread(cells: list[float]) -> dict:
    top, low = max(range(len(cells)), key=cells.__getitem__), min(range(len(cells)), key=cells.__getitem__)
    ratio = cells[top] / cells[low] if cells[low] > 0 else math.inf
    return {"most": top, "least": low, "ratio": ratio}


def table(maps: dict[str, dict[str, list[float]]]) -> str:
    """Markdown: one row per family and setting, one column per layer, and the spread."""
    n = max(len(c) for m in maps.values() for c in m.values())
    lines = ["| family | setting | " + " | ".join(f"layer {i}" for i in range(n)) + " | most / least |",
             "|---|---|" + "---|" * n + "---|"]
    for family, m in maps.items():
        for setting, cells in m.items():
            s = spread(cells)
            lines.append(f"| {family} | `{setting}` | " + " | ".join(f"{c:.2e}" for c in cells)
                         + f" | layer {s['most']} / layer {s['least']}: {s['ratio']:.1f}x |")
    return "\n".join(lines)


def heatmap(maps: dict[str, dict[str, list[float]]], path: Path) -> None:
    fig, axes = pyplot().subplots(1, len(maps), figsize=(5.5 * len(maps), 3.8), squeeze=False, layout="constrained")
    values = [math.log10(max(c, 1e-9)) for m in maps.values() for cells in m.values() for c in cells]
    for ax, (family, m) in zip(axes[0], maps.items()):
        grid = [[math.log10(max(c, 1e-9)) for c in cells] for cells in m.values()]
        image = ax.imshow(grid, cmap="viridis", vmin=min(values), vmax=max(values), aspect="auto")
        ax.set(title=f"{family}: log10 KL(rollout || train)", xlabel="layer quantized alone",
               xticks=range(len(grid[0])), yticks=range(len(m)))
        ax.set_yticklabels(list(m), fontsize=8)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", color="w", fontsize=7)
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    save(fig, path)


def write(maps: dict, out: Path) -> str:
    from opd.config.runlog import write_atomic
    out.mkdir(parents=True, exist_ok=True)
    result = {family: {s: {"kl": cells, **spread(cells)} for s, cells in m.items()} for family, m in maps.items()}
    write_atomic(out / "sensitivity.json", json.dumps(result, indent=2) + "\n")
    heatmap(maps, out / "sensitivity.png")
    return table(maps) + f"\n\nwrote {out / 'sensitivity.json'} and {out / 'sensitivity.png'}"
