"""Per-layer FP8 sensitivity of the real models, and what their keys and values look like against the FP8 formats.

Models: SmolLM2-135M-Instruct (the smollm2 teacher, 30 layers), its 15-layer pruned student, Qwen2.5-Coder-0.5B-Instruct
(24 layers); the built-in students (4 layers) for comparison. Sequences: 8 HumanEval chat prompts (the task prompts
for the toys) with 64 tokens the model samples itself at full precision, fixed for every cell.

- **Sensitivity map**: for each layer i and each setting (FP8 e4m3 / e5m2 KV cache, scale 1.0, rounded to nearest as
  vLLM on GPUs), the plan `forward=bf16 kv=bf16; i: kv=<fp8>` scores the sequences by one prefill through its KV cache
  (Engine.prefill_hidden: attention reads the stored FP8 keys and values) and the cell is the exact
  KL(engine || float32 trainer) per completion token, minus the BF16 floor's (the same plan without the FP8 layer).
  Spread: the most sensitive layer's cell over the median layer's. Not `opd sensitivity` (opd.study.sensitivity.layer_map):
  that samples new rollouts under each cell's plan through a student/teacher set-up; here every cell scores the same
  fixed tokens by one prefill, which any model (a teacher too) allows and which a 30-layer map on 2 cores needs.
- **Keys and values**: per layer, max |K| (after RoPE, what the cache stores) against e4m3's largest finite value
  (448: beyond it the cache saturates), and the share of |K| and |V| below 2^-6 (e4m3's smallest normal: AMX reads
  those as zero, kernels.py).

    python studies/real_layers.py            # all models (~30 min on 2 cores)
    python studies/real_layers.py --quick    # the built-in students and the pruned SmolLM2 (~1 min)

Rows are appended to studies/data/real_layers.jsonl (a model's finished cells are not re-run). The last line is
`RESULT key=value ...`.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data" / "real_layers.jsonl"
MODELS = ("llama-student", "qwen3-student", "smollm2:student", "smollm2:teacher", "qwen2.5-coder:student")
SETTINGS = ("fp8_e4m3", "fp8_e5m2")
SEQUENCES, NEW_TOKENS = 8, 64
E4M3_MAX, E4M3_TINY = 448.0, 2.0 ** -6


def load(name: str):
    """(model, tokenizer, prompts as ids) of a real model `PAIR:role` or a built-in student `FAMILY-student`."""
    from opd.models.checkpoint import load_checkpoint
    if ":" in name:
        from opd.data.humaneval import prompt_file
        from opd.data.prompts import PromptFormat, read_prompts
        from opd.data.real_pairs import resolve_model
        model, tok = load_checkpoint(resolve_model(name))
        examples = read_prompts(prompt_file(), PromptFormat(chat=True), tok)[:SEQUENCES]
    else:
        from opd import make_config
        from opd.training.setup import pair_folders
        from opd.data.task import get_task, held_out_examples
        model, tok = load_checkpoint(pair_folders(make_config(family=name.split("-")[0]))[0])
        examples = held_out_examples(get_task("chain"), SEQUENCES)
    return model.eval(), tok, [tok.encode_prompt(ex.prompt) for ex in examples]


@torch.no_grad()
def kl_per_token(model, tok, plan: str, prompts, completions, trainer) -> float:
    """Mean exact KL(engine under plan || float32 trainer) over the completion tokens, by one prefill each."""
    from opd.engines.builtin import Engine
    engine = Engine(model, tok.stop_ids, tok.pad_id, plan)
    total, count = 0.0, 0
    for i in range(len(prompts)):
        h = engine.prefill_hidden([prompts[i]], [completions[i]])[0]
        mine = engine.model.lm_head(h).float().log_softmax(-1)
        total += (mine.exp() * (mine - trainer[i])).sum().item()
        count += len(completions[i])
    return total / count


@torch.no_grad()
def key_value_stats(model, prompts, completions) -> list[dict]:
    """Per layer: max |K| after RoPE, and the shares of |K| and |V| below e4m3's smallest normal (float32 forward)."""
    seen = [dict(k_max=0.0, k_tiny=0, v_tiny=0, n=0) for _ in model.layers]

    class Keep:  # a cache that records what it is asked to store and stores nothing
        length = 0

        def update(self, i, k, v):
            s = seen[i]
            s["k_max"] = max(s["k_max"], k.abs().max().item())
            s["k_tiny"] += (k.abs() < E4M3_TINY).sum().item()
            s["v_tiny"] += (v.abs() < E4M3_TINY).sum().item()
            s["n"] += k.numel()
            return k, v

        def advance(self, T):
            pass
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        T = ids.shape[1]
        model.hidden(ids, None, torch.ones(T, T, dtype=torch.bool).tril()[None, None], Keep())
    return [{"k_max": s["k_max"], "k_tiny": s["k_tiny"] / s["n"], "v_tiny": s["v_tiny"] / s["n"]} for s in seen]


def run_model(name: str, done: set, out) -> None:
    from opd.engines.builtin import Engine
    from opd.engines.sampling import SamplingParams
    if all((name, s) in done for s in (*SETTINGS, "kv")):
        return
    start = time.perf_counter()
    model, tok, prompts = load(name)
    torch.manual_seed(0)
    sampled = Engine(model, tok.stop_ids, tok.pad_id, "").generate(prompts, SamplingParams(NEW_TOKENS), 0)
    keep = [i for i, r in enumerate(sampled) if r.completion_ids]
    prompts, completions = [prompts[i] for i in keep], [sampled[i].completion_ids for i in keep]
    trainer_engine = Engine(model, tok.stop_ids, tok.pad_id, "")
    trainer = [model.lm_head(h).float().log_softmax(-1)
               for h in (trainer_engine.prefill_hidden([p], [c])[0] for p, c in zip(prompts, completions))]
    n = model.cfg.num_layers
    floor = kl_per_token(model, tok, "forward=bf16 kv=bf16", prompts, completions, trainer)
    for setting in SETTINGS:
        if (name, setting) in done:
            continue
        cells = [kl_per_token(model, tok, f"forward=bf16 kv=bf16; {i}: kv={setting}", prompts, completions, trainer)
                 - floor for i in range(n)]
        row = {"model": name, "setting": setting, "layers": n, "floor": floor, "cells": cells,
               "seconds": time.perf_counter() - start}
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(summary(row), flush=True)
    if (name, "kv") not in done:
        row = {"model": name, "setting": "kv", "layers": n, "stats": key_value_stats(model, prompts, completions)}
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(summary(row), flush=True)


def summary(row: dict) -> str:
    if row["setting"] == "kv":
        k = [s["k_max"] for s in row["stats"]]
        worst = max(range(len(k)), key=k.__getitem__)
        return (f"{row['model']:22} max |K| {max(k):.4g} (layer {worst}; layers over 448: "
                f"{sum(x > E4M3_MAX for x in k)}); |K| < 2^-6: {statistics.mean(s['k_tiny'] for s in row['stats']):.1%}"
                f", |V| < 2^-6: {statistics.mean(s['v_tiny'] for s in row['stats']):.1%}")
    cells = row["cells"]
    top = sorted(range(len(cells)), key=lambda i: -cells[i])[:3]
    return (f"{row['model']:22} {row['setting']:9} floor {row['floor']:.3g}  median layer "
            f"{statistics.median(cells):.3g}  top layers " + ", ".join(f"{i}: {cells[i]:.3g}" for i in top)
            + f"  spread (top / median) {spread(cells):.3g}")


def spread(cells: list[float]) -> float:
    """The most sensitive layer's cell over the median layer's (not over the least one's, as opd.study.sensitivity.spread:
    a cell here is net of the BF16 floor and can be ~0 or below it)."""
    median = statistics.median(cells)
    return max(cells) / median if median > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    models = ("llama-student", "qwen3-student", "smollm2:student") if args.quick else MODELS
    path = DATA.with_name("real_layers_quick.jsonl") if args.quick else DATA
    if args.quick:
        path.unlink(missing_ok=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    done = {(r["model"], r["setting"]) for r in rows}
    with open(path, "a") as out:
        for name in models:
            run_model(name, done, out)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    print("\nall rows:")
    for row in rows:
        print(summary(row))
    spreads = {row["model"]: spread(row["cells"]) for row in rows if row["setting"] == "fp8_e4m3"}
    print("RESULT " + " ".join(f"spread_e4m3_{m.replace(':', '_')}={v:.3g}" for m, v in spreads.items()))


if __name__ == "__main__":
    main()
