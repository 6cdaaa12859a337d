"""How faithfully the built-in engine's emulated numerics reproduce a real engine's.

The real engine's records (prompt and completion ids and the log-prob of each sampled token, as `opd generate
--json` writes them) fix the sequences. The built-in engine is teacher-forced on those very tokens under a precision
plan: decoding one token a step, so its KV cache is written and read back as in generation (Engine.teacher_force).
The float32 trainer scores the same tokens. Per cell (a model, the real engine's records, a plan):
- `abs_dlogp_mean`, `abs_dlogp_p99`: |log p built-in - log p real| per token, the direct distance;
- `kl_k3` of each engine against the float32 trainer (metrics.kl_estimates, as the admission probe measures it),
  and their ratio, built-in / real: what the admission check and the study read from the numerics.
A ratio near 1 with a small per-token distance means the emulation reproduces the real engine; a ratio near 1 with
a large distance would be agreement by accident.
"""
import json
from pathlib import Path

import torch

from opd.engine import Engine
from opd.metrics import kl_estimates
from opd.model import Transformer
from opd.sampling import SamplingParams


def read_records(path: Path, limit: int = 0) -> list[dict]:
    """The records of a JSONL file (`opd generate --json` lines), the first `limit` if given."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip().startswith("{")]
    return rows[:limit] if limit else rows


def forced_logprobs(model: Transformer, stop_ids: list[int], pad_id: int, plan: str,
                    records: list[dict]) -> torch.Tensor:
    """The built-in engine's raw log-probs of every record's completion tokens, concatenated [n]."""
    engine = Engine(model, stop_ids, pad_id, plan)
    completions = [r["completion_ids"] for r in records]
    rollouts = engine.teacher_force([r["prompt_ids"] for r in records], completions,
                                    SamplingParams(max(map(len, completions))))
    return torch.tensor([x for r in rollouts for x in r.raw_logprobs])


def compare(model: Transformer, stop_ids: list[int], pad_id: int, records: list[dict],
            plans: dict[str, str]) -> dict:
    """{"real/kl_k3", and per named plan "<name>/kl_k3", "<name>/ratio", "<name>/abs_dlogp_mean",
    "<name>/abs_dlogp_p99"}: each plan's built-in engine against the records' engine, on the records' tokens."""
    real = torch.tensor([x for r in records for x in r["raw_logprobs"]])
    trainer = forced_logprobs(model, stop_ids, pad_id, "", records)  # float32, fp32 KV: the trainer's numbers
    mask = torch.ones_like(real, dtype=torch.bool)
    out = {"real/kl_k3": kl_estimates(trainer - real, mask)[1], "tokens": real.numel()}
    for name, plan in plans.items():
        ours = forced_logprobs(model, stop_ids, pad_id, plan, records)
        distance = (ours - real).abs().double()
        out[f"{name}/kl_k3"] = kl_estimates(trainer - ours, mask)[1]
        out[f"{name}/ratio"] = out[f"{name}/kl_k3"] / out["real/kl_k3"]
        out[f"{name}/abs_dlogp_mean"] = distance.mean().item()
        out[f"{name}/abs_dlogp_p99"] = torch.quantile(distance, 0.99).item()
    return out


def worst_ratio(ratios: list[float]) -> float:
    """The largest of max(r, 1/r): how far the worst cell is from agreement, either way."""
    return max(max(r, 1 / r) for r in ratios)
