"""Outlier keys: why an FP8 KV cache breaks some models, and whether the admission check sees it.

Each built-in student gets a function-preserving outlier (opd/numerics/stress.py: one RoPE channel pair of every key scaled
by alpha, the matching queries by 1/alpha, in every layer): its full-precision logits stay the same, but the keys
in its cache grow alpha times in that pair. For each alpha and KV plan the admission probe runs as `opd admit`
does (the run's own 16 training prompts, the BF16 floor, the shipped thresholds, the default full_rkl estimator),
and the table gives the keys' largest magnitude, the share of keys the cache saturated, the exact KL(rollout ||
train), nsr and the decision.

    python studies/outlier_keys.py          # both families, alpha 1 / 30 / 100 / 300 (~1 minute here)
    python studies/outlier_keys.py --quick  # llama, alpha 1 / 300, two plans (seconds)

The last line is `RESULT key=value ...`: per family, the smallest alpha at which each plan was rejected (0: never).
"""
import argparse
import copy

import torch

from opd.config.files import build_config
from opd.numerics.kv_cache import KVCache
from opd.numerics.plan import Plan
from opd.admission.check import decide_plan as admit
from opd.training.setup import probe_setup
from opd.numerics.stress import add_outlier_keys
from opd.study.sweep import PROBE_ROLLOUTS
from opd.health.thresholds import load_thresholds

PLANS = {"fp8 fixed": "kv=fp8_e4m3", "fp8 calibrated": "kv=fp8_e4m3 kv_scale=calibrate",
         "int8 calibrated": "kv=int8 kv_scale=calibrate",
         "int8 per head": "kv=int8 kv_scale=calibrate kv_per_head=true"}


@torch.no_grad()
def key_amax(model, prompts: list[list[int]]) -> float:
    """The largest |key| any layer stores for the probe prompts (float32 cache, one prompt at a time)."""
    top = 0.0
    for ids in prompts:
        cache = KVCache(model.cfg, 1, len(ids))
        mask = torch.ones(1, 1, len(ids), len(ids), dtype=torch.bool).tril()
        model(torch.tensor([ids]), mask=mask, cache=cache)
        top = max(top, max(layer.deq[0].abs().amax().item() for layer in cache.layers))
    return top


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    families, alphas, plans = (["llama"], [1, 300], ["fp8 fixed", "fp8 calibrated"]) if args.quick else \
        (["llama", "qwen3"], [1, 30, 100, 300], list(PLANS))
    thresholds = load_thresholds("")
    print(f"{'family':7} {'alpha':>6} {'key amax':>9} {'fp32 logit diff':>16}  {'plan':16} {'keys clipped':>12} "
          f"{'kl_exact':>9} {'nsr':>6}  decision")
    rejected_from = {}
    for family in families:
        setup, _ = probe_setup(build_config({"family": family, "threads": args.threads}), PROBE_ROLLOUTS)
        plain = copy.deepcopy(setup.student)
        ids = torch.tensor([setup.prompts[0]])
        with torch.no_grad():
            reference = plain(ids)
        scale = 1.0
        for alpha in alphas:
            add_outlier_keys(setup.student, alpha / scale)  # the student the probe's engines copy
            scale = alpha
            with torch.no_grad():
                diff = (setup.student(ids) - reference).abs().max().item()
            amax = key_amax(setup.student, setup.prompts)
            for name in plans:
                plan = Plan.parse(PLANS[name], setup.student.cfg.num_layers)
                out = admit(setup, plan, thresholds, propose=False)
                if out["decision"] == "REJECT":
                    rejected_from.setdefault(f"{family}_{name.replace(' ', '_')}", alpha)
                numbers = out["probe"]
                print(f"{family:7} {alpha:>6} {amax:>9.1f} {diff:>16.1e}  {name:16} {numbers['kv_clipped_k']:>12.3%} "
                      f"{numbers['kl_exact']:>9.2e} {numbers['nsr']:>6.3f}  {out['decision']}", flush=True)
    keys = [f"{family}_{name.replace(' ', '_')}" for family in families for name in plans]
    print("RESULT " + " ".join(f"{key}_rejected_from_alpha={rejected_from.get(key, 0)}" for key in keys))


if __name__ == "__main__":
    main()
