"""bf16 against float32 on this CPU, for a real pair's OPD step: how much faster, and how far apart.

1. matmuls: GFLOP/s of torch.matmul in float32 and in bf16 at the Qwen2.5-Coder student's shapes (a decode step's
   M = 8 rows, a prefill's or a learner's M = 2048), alternated so the machine's drift hits both alike.
2. engine: the built-in engine's `forward=bf16 kv=bf16` plan decoding the real student, with its bf16 weights held as
   float32 shadows (float32 GEMMs of bf16 values: what opd ran on every CPU until 2026-12-06) and as bf16 layers
   (native bf16 GEMMs: what it runs where the CPU has AMX or AVX512-BF16); tokens/s, alternated, and the two engines'
   log-probs of the same tokens (teacher-forced) against each other and against the float32 forward.
3. step: whole OPD steps of the real pair (rollouts, teacher, learner) with everything in float32 against everything
   in bf16 (learner under autocast with float32 master weights and AdamW state, teacher's weights in bf16, the
   engine's bf16 plan on native matmuls), alternated run by run; medians of each configuration's steps after its
   first, per phase; and on one batch, the bf16 learner's and teacher's log-probs of the sampled tokens against
   float32's.

    python benchmarks/bf16.py --quick    # the smollm2 pair, small shapes (under a minute after its build)
    python benchmarks/bf16.py            # the Qwen2.5-Coder pair (docs/benchmarks.md's numbers)
    python benchmarks/bf16.py --steps 3 --rounds 1   # the same, shorter (fewer whole steps)
    python benchmarks/bf16.py --engine-only --plan "forward=bf16 kv=bf16 w=int4"   # 2. alone, for another plan
        # (a plan's quantized layers: float32 GEMMs of their dequantized weights against bf16 GEMMs of them rounded
        # to bf16, since 2026-12-07; add --quick for the smollm2 pair)

The last line is `RESULT key=value ...`.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def cpu() -> str:
    flags = next((set(line.split(":", 1)[1].split()) for line in open("/proc/cpuinfo") if line.startswith("flags")),
                 set())
    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    isa = "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else \
        "avx512" if "avx512f" in flags else "avx2"
    return f"{name} ({isa})"


# ---- 1. matmuls ------------------------------------------------------------------------------------------------

def matmul_rates(hidden: int, inner: int, rows: list[int], rounds: int) -> dict:
    out = {}
    for m in rows:
        seconds = {torch.float32: [], torch.bfloat16: []}
        tensors = {dtype: (torch.randn(m, hidden, dtype=dtype), torch.randn(hidden, inner, dtype=dtype))
                   for dtype in seconds}
        for _ in range(rounds):
            for dtype, (a, b) in tensors.items():
                a @ b  # warm
                start, reps = time.perf_counter(), 0
                while time.perf_counter() - start < 0.2:
                    a @ b
                    reps += 1
                seconds[dtype].append((time.perf_counter() - start) / reps)
        flops = 2 * m * hidden * inner
        f32, b16 = (flops / statistics.median(seconds[d]) / 1e9 for d in (torch.float32, torch.bfloat16))
        print(f"1. matmul [{m}, {hidden}] x [{hidden}, {inner}]: float32 {f32:.0f} GFLOP/s, bf16 {b16:.0f} GFLOP/s "
              f"-> {b16 / f32:.2f}x", flush=True)
        out[f"matmul_m{m}_ratio"] = b16 / f32
    return out


# ---- 2. the engine -----------------------------------------------------------------------------------------------

def engine_speed(folder: Path, prompts: list[list[int]], new_tokens: int, rounds: int,
                 plan: str = "forward=bf16 kv=bf16") -> dict:
    from opd.models.checkpoint import load_checkpoint
    from opd.engines.builtin import Engine
    from opd.engines.sampling import SamplingParams
    model, tok = load_checkpoint(folder)
    params = SamplingParams(new_tokens, temperature=1.0)
    engines = {"shadowed": Engine(model, tok.stop_ids, tok.pad_id, plan, bf16_gemm="float32"),
               "native": Engine(model, tok.stop_ids, tok.pad_id, plan, bf16_gemm="native")}
    rates = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            rollouts = engine.generate(prompts, params, 0)
            rates[name].append(sum(len(r.completion_ids) for r in rollouts) / (time.perf_counter() - start))
    shadowed, native = (statistics.median(rates[n]) for n in engines)
    print(f"2. engine {plan} on {len(prompts)} x {new_tokens} tokens: float32 shadows {shadowed:.1f} tokens/s, "
          f"native bf16 {native:.1f} tokens/s -> {native / shadowed:.2f}x", flush=True)
    rollouts = engines["shadowed"].generate(prompts, params, 1)
    completions = [r.completion_ids for r in rollouts]
    logp = {}
    for name, engine in (*engines.items(), ("fp32", Engine(model, tok.stop_ids, tok.pad_id, ""))):
        forced = engine.teacher_force(prompts, completions, params)
        logp[name] = torch.tensor([x for r in forced for x in r.raw_logprobs], dtype=torch.float64)
    native_vs_shadow = (logp["native"] - logp["shadowed"]).abs()
    shadow_vs_fp32 = (logp["shadowed"] - logp["fp32"]).abs()
    print(f"   same tokens: |native - shadowed| mean {native_vs_shadow.mean():.4f} max {native_vs_shadow.max():.3f}; "
          f"|shadowed - float32| mean {shadow_vs_fp32.mean():.4f} max {shadow_vs_fp32.max():.3f} "
          f"({len(native_vs_shadow)} tokens)", flush=True)
    return {"engine_ratio": native / shadowed, "engine_native_vs_shadow_mean": native_vs_shadow.mean().item(),
            "engine_bf16_vs_fp32_mean": shadow_vs_fp32.mean().item()}


# ---- 3. whole steps ----------------------------------------------------------------------------------------------

def configs(family: str, batch: int, new_tokens: int, steps: int) -> dict:
    import opd
    base = dict(family=family, steps=steps, batch_size=batch, threads=os.cpu_count() or 1, save_every=0,
                sampling={"max_new_tokens": new_tokens}, eval={"every": 0, "examples": 2},
                optim={"lr": 3e-5, "warmup_steps": 1, "schedule": "constant"}, plan="forward=bf16 kv=bf16")
    return {"float32": opd.make_config(**base, compute={"dtype": "float32", "teacher_dtype": "float32"},
                                       engine={"bf16_gemm": "float32"}),
            "bf16": opd.make_config(**base, compute={"dtype": "bf16", "teacher_dtype": "bf16"},
                                    engine={"bf16_gemm": "native"})}


def step_speed(family: str, batch: int, new_tokens: int, steps: int, rounds: int, root: Path) -> dict:
    import json
    import opd
    phases = ("time/generate", "time/teacher", "time/train", "time/step")
    seen = {name: {p: [] for p in phases} for name in ("float32", "bf16")}
    for r in range(rounds):
        for name, cfg in configs(family, batch, new_tokens, steps).items():
            run_dir = root / f"{name}{r}"
            opd.train(cfg, run_dir, overwrite=True, progress=False)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            rows = [row for row in rows if "time/step" in row][1:]  # the first step warms up
            for p in phases:
                seen[name][p] += [row[p] for row in rows if p in row]
    med = {name: {p: statistics.median(v) if v else float("nan") for p, v in d.items()} for name, d in seen.items()}
    for p in phases:
        print(f"3. {p:14} float32 {med['float32'][p]:7.2f} s   bf16 {med['bf16'][p]:7.2f} s   -> "
              f"{med['float32'][p] / med['bf16'][p]:.2f}x", flush=True)
    return {"step_ratio": med["float32"]["time/step"] / med["bf16"]["time/step"],
            "step_s_float32": med["float32"]["time/step"], "step_s_bf16": med["bf16"]["time/step"]}


def logprob_agreement(family: str, batch: int, new_tokens: int) -> dict:
    """On one batch of the student's rollouts: the learner's log-probs under bf16 autocast and the bf16 teacher's,
    each against float32's."""
    from opd.models.checkpoint import load_checkpoint
    from opd.engines.builtin import Engine
    from opd.training.learner import Scoring, collate, score_batch
    from opd.data.prompts import PromptFormat, read_prompts
    from opd.data.humaneval import prompt_file
    from opd.data.real_pairs import build_pair
    from opd.engines.sampling import SamplingParams
    from opd.training.teacher import LocalTeacher
    student_dir, teacher_dir = build_pair(family, progress=False)
    student, tok = load_checkpoint(student_dir)
    examples = read_prompts(prompt_file(), PromptFormat(chat=True), tok)[:batch]
    rollouts = Engine(student, tok.stop_ids, tok.pad_id, "forward=bf16 kv=bf16").generate(
        [tok.encode_prompt(ex.prompt) for ex in examples], SamplingParams(new_tokens), 0)
    batch_ = collate(rollouts, tok.pad_id)
    out = {}
    teachers = {dtype: LocalTeacher(load_checkpoint(teacher_dir, dtype)[0].eval()) for dtype in (torch.float32,
                                                                                                  torch.bfloat16)}
    scores = {}
    for name, autocast, teacher in (("float32", None, teachers[torch.float32]),
                                    ("bf16", torch.bfloat16, teachers[torch.bfloat16])):
        scores[name] = score_batch(student, batch_, teacher, Scoring(autocast=autocast))
    mask = batch_.mask
    for what in ("pi", "teacher"):
        gap = (getattr(scores["bf16"], what).double() - getattr(scores["float32"], what).double()).abs()[mask]
        print(f"   {what:8} bf16 vs float32: |d log p| mean {gap.mean():.4f} p99 {gap.quantile(0.99):.3f} max "
              f"{gap.max():.3f} ({mask.sum().item()} tokens)", flush=True)
        out[f"{what}_bf16_mean_dlogp"] = gap.mean().item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=4, help="steps of each whole-step run (the first is dropped)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the float32 and bf16 runs, alternated")
    parser.add_argument("--plan", default="forward=bf16 kv=bf16", help="the engine section's plan (a forward=bf16 one)")
    parser.add_argument("--engine-only", action="store_true", help="only the engine section (2.)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from opd.data.real_pairs import build_pair
    from opd.models.checkpoint import load_checkpoint
    family = "smollm2" if args.quick else "qwen2.5-coder"
    print(f"CPU: {cpu()}, {os.cpu_count()} threads; torch {torch.__version__}; pair {family}; plan {args.plan}",
          flush=True)
    start = time.perf_counter()
    student_dir, _ = build_pair(family, progress=False)
    model, tok = load_checkpoint(student_dir)
    cfg = model.cfg
    result = {} if args.engine_only else matmul_rates(cfg.hidden_size, cfg.intermediate_size, [8, 2048],
                                                      2 if args.quick else 5)
    from opd.data.humaneval import prompt_file
    from opd.data.prompts import PromptFormat, read_prompts
    prompts = [tok.encode_prompt(ex.prompt) for ex in read_prompts(prompt_file(), PromptFormat(chat=True), tok)[:8]]
    result |= engine_speed(student_dir, prompts[:4 if args.quick else 8], 16 if args.quick else 64,
                           1 if args.quick else 3, args.plan)
    batch, tokens, steps = (4, 16, 2) if args.quick else (8, 128, args.steps)
    if not args.engine_only:
        result |= logprob_agreement(family, batch, tokens)
    if not args.quick and not args.engine_only:
        import tempfile
        with tempfile.TemporaryDirectory() as root:
            result |= step_speed(family, batch, tokens, steps, args.rounds, Path(root))
    result["seconds"] = time.perf_counter() - start
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
