"""Per-layer sensitivity: the mismatch when only one layer's KV cache (or only its weights) runs at lower precision.

For each setting (e.g. `kv=fp8_e4m3`) and each layer i, the engine runs the plan `<base>; i: <setting>` (every other
layer as the base plan says: full precision by default, or e.g. `forward=bf16 kv=bf16`, a bf16 engine whose
forward stays bf16 around the layer) on one fixed probe batch of the student's own rollouts, and the trainer's full-precision forward
recomputes them: the cell is `kl_exact`, the exact per-position KL(rollout || train) averaged over the batch
(`kl_k3` for engines that return only the sampled tokens' log-probs). Every cell uses the same prompts and sampling
seed, so cells differ only in where the mismatch enters. The spread of a setting is its most sensitive layer's KL
over its least sensitive layer's. `opd admit` uses the same per-layer measurement to choose which layers to keep in
BF16 when it proposes a plan. `sensitivity.json` also holds, for each setting vLLM can run, the plans that keep its
1-3 most sensitive layers out, as `vllm serve` flags (`--kv-cache-dtype-skip-layers`).
"""
import json
import math
from pathlib import Path

from opd.admission.probe import measure
from opd.engines.vllm import vllm_settings
from opd.io.errors import OpdError
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


def in_vllm_terms(cells: list[float], setting: str, base: str = "", most: int = 3) -> list[dict]:
    """The setting on every layer but its k most sensitive (k = 1..most), the kept layers at the base's KV dtype, as
    `vllm serve` flags: [{"keep": [layers], "plan": ..., "flags": ...}]; [{"refused": why}] if vLLM cannot run it."""
    n = len(cells)
    model_kv = "kv=bf16" if "forward=bf16" in base.split() else "kv=fp32"
    order = sorted(range(n), key=lambda i: -cells[i])
    out = []
    for k in range(1, min(most, n - 1) + 1):
        kept = sorted(order[:k])
        plan = Plan.parse(f"{base}; {setting}; {','.join(map(str, kept))}: {model_kv}", n)
        try:
            out.append({"keep": kept, "plan": str(plan), "flags": vllm_settings(plan).flags()})
        except OpdError as e:
            return [{"refused": str(e)}]
    return out


def write(maps: dict, out: Path, base: str = "") -> str:
    from opd.config.runlog import write_atomic
    out.mkdir(parents=True, exist_ok=True)
    result = {family: {s: {"kl": cells, **spread(cells), "vllm": in_vllm_terms(cells, s, base)}
                       for s, cells in m.items()} for family, m in maps.items()}
    write_atomic(out / "sensitivity.json", json.dumps(result, indent=2) + "\n")
    heatmap(maps, out / "sensitivity.png")
    flags = [f"{family} `{s}` keeping layers {','.join(map(str, x['keep']))}: {x['flags']}"
             for family, m in result.items() for s, entry in m.items() for x in entry["vllm"] if "flags" in x]
    vllm = "\n\non a vLLM server (the setting on every layer but the most sensitive):\n" + "\n".join(flags) \
        if flags else ""
    return table(maps) + vllm + f"\n\nwrote {out / 'sensitivity.json'} and {out / 'sensitivity.png'}"
