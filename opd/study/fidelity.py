"""How faithfully the built-in engine's emulated numerics reproduce a real engine's.

The real engine's records (prompt and completion ids and the log-prob of each sampled token, as `opd generate
--json` writes them) are compared with the built-in engine under a precision plan in two ways, per cell (a model,
the real engine's records, a plan):

- **on the real engine's tokens** (teacher-forced: decoding one token a step, so the KV cache is written and read back
  as in generation, Engine.teacher_force): `abs_dlogp_mean`, `abs_dlogp_p99`, |log p built-in - log p real| per
  token, the direct distance; and `forced_ratio`, the two engines' kl_k3 against the float32 trainer on those tokens;
- **on each engine's own rollouts** (the built-in engine samples the same prompts itself): `ratio`, its exact
  KL(engine || float32 trainer) per token (the whole distributions: it has the hidden states) over the real engine's
  kl_k3 (metrics.kl_estimates, as the admission probe measures it; vLLM returns sampled tokens only). This is what the
  admission check and the study read, and it is unbiased: both estimate KL(engine || trainer) on the engine's own
  samples (k3 only on those; the exact KL has the lower variance). `ratio_k3` uses k3 on both sides. `forced_ratio` agrees with it while the two engines agree token by token (the built-in
  pairs); on a real model whose bf16 rounding is chaotic (two engines that compute every op alike still part by
  ~0.15 nats a token: docs/real-pairs.md) it is biased upward, by the two engines' distance.

Which to read: `forced_ratio` is paired (the same tokens) and so has the smaller variance; its bias is about
E[(log p ours - log p real)^2] / 2 over the real engine's kl_k3 (`bias_scale`). `headline` is forced_ratio where
that scale is below 5%, else the own-rollout ratio (unbiased, noisier).

kl_k3 is a mean of a heavy-tailed per-token quantity, so a ratio on a few thousand tokens moves: `ratio_lo` and
`ratio_hi` are a 90% bootstrap interval, the prompts resampled with replacement (both engines' rollouts of a drawn
prompt drawn together).
"""
import gzip
import json
from pathlib import Path

import torch

from opd.engines.builtin import Engine
from opd.health.metrics import kl_estimates
from opd.models.model import Transformer
from opd.engines.sampling import SamplingParams


def read_records(path: Path, limit: int = 0) -> list[dict]:
    """The records of a JSONL file (`opd generate --json` lines; gzipped if it ends in .gz), the first `limit` if
    given."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    return rows[:limit] if limit else rows


def forced_logprobs(model: Transformer, stop_ids: list[int], pad_id: int, plan: str,
                    records: list[dict], chunk: int = 16) -> torch.Tensor:
    """The built-in engine's raw log-probs of every record's completion tokens, concatenated [n]; `chunk` records
    per teacher-forced batch (a batch pads to its longest prompt)."""
    engine = Engine(model, stop_ids, pad_id, plan)
    out = []
    for i in range(0, len(records), chunk):
        part = records[i:i + chunk]
        completions = [r["completion_ids"] for r in part]
        rollouts = engine.teacher_force([r["prompt_ids"] for r in part], completions,
                                        SamplingParams(max(map(len, completions))))
        out += [x for r in rollouts for x in r.raw_logprobs]
    return torch.tensor(out)


@torch.no_grad()
def trainer_logprobs(model: Transformer, stop_ids: list[int], pad_id: int, records: list[dict],
                     chunk: int = 8) -> torch.Tensor:
    """The float32 trainer's log-probs of every record's completion tokens, concatenated [n]: one prefill a chunk
    of records (Engine.prefill_hidden at full precision: the teacher-forced decode's numbers up to the order of
    float sums, several times faster)."""
    engine = Engine(model, stop_ids, pad_id, "")
    out = []
    for i in range(0, len(records), chunk):
        part = records[i:i + chunk]
        hidden = engine.prefill_hidden([r["prompt_ids"] for r in part], [r["completion_ids"] for r in part])
        for h, r in zip(hidden, part):
            out.append(model.lm_head(h).float().log_softmax(-1).gather(1, torch.tensor(r["completion_ids"])[:, None])[:, 0])
    return torch.cat(out)


def own_rollouts(model: Transformer, stop_ids: list[int], pad_id: int, plan: str, records: list[dict],
                 seed: int = 0, chunk: int = 16) -> list[dict]:
    """The built-in engine's own rollouts of the records' prompts (temperature 1, as many new tokens as the longest
    record) as records: raw log-probs, the float32 trainer's (`q`) and the exact per-token KL(engine || trainer)."""
    from functools import partial
    from opd.training.worker import recompute
    engine = Engine(model, stop_ids, pad_id, plan)
    params = SamplingParams(max(len(r["completion_ids"]) for r in records))
    out = []
    for i in range(0, len(records), chunk):
        rollouts = engine.generate([r["prompt_ids"] for r in records[i:i + chunk]], params, seed + i,
                                   return_hidden=True)
        recompute(engine.base, rollouts, pad_id, params, 0, partial(engine.logprobs, params=params))
        out += [{"prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids, "raw_logprobs": r.raw_logprobs,
                 "q": r.q, "kl_exact": r.kl_exact} for r in rollouts]
    return out


def compare(model: Transformer, stop_ids: list[int], pad_id: int, records: list[dict],
            plans: dict[str, str], resamples: int = 1000, own=None) -> dict:
    """{"real/kl_k3", "tokens", and per named plan "<name>/ratio" (with "_lo", "_hi": its 90% bootstrap interval)
    and "<name>/kl" (own rollouts, exact KL), "<name>/ratio_k3" (own rollouts, k3), "<name>/forced_ratio",
    "<name>/abs_dlogp_mean", "<name>/abs_dlogp_p99"} (module docstring). `own`: the plans measured on their own
    rollouts too (default: all). Records may hold several rollouts of a prompt (several seeds): the real engine's
    kl_k3 is over all of them, the built-in engine samples each prompt once, and the teacher-forced numbers use the
    first rollout of each prompt."""
    prompts = {}
    for r in records:
        prompts.setdefault(tuple(r["prompt_ids"]), []).append(r)
    first = [group[0] for group in prompts.values()]
    owner = {key: i for i, key in enumerate(prompts)}
    draws = torch.randint(0, len(first), (resamples, len(first)), generator=torch.Generator().manual_seed(0))
    every = torch.tensor([x for r in records for x in r["raw_logprobs"]])
    trainer = trainer_logprobs(model, stop_ids, pad_id, records)  # float32, fp32 KV: the trainer's numbers
    real_k3 = by_prompt(per_record(trainer - every, records, k3=True), records, owner)
    out = {"real/kl_k3": ratio_of(real_k3), "tokens": every.numel()}
    real = torch.tensor([x for r in first for x in r["raw_logprobs"]])
    chosen = {id(r) for r in first}
    trainer_first = trainer[torch.tensor([id(r) in chosen for r in records for _ in r["raw_logprobs"]])]
    mask = torch.ones_like(real, dtype=torch.bool)
    first_k3 = kl_estimates(trainer_first - real, mask)[1]
    for name, plan in plans.items():
        ours = forced_logprobs(model, stop_ids, pad_id, plan, first)
        distance = (ours - real).abs().double()
        out[f"{name}/forced_ratio"] = kl_estimates(trainer_first - ours, mask)[1] / first_k3
        out[f"{name}/abs_dlogp_mean"] = distance.mean().item()
        out[f"{name}/abs_dlogp_p99"] = torch.quantile(distance, 0.99).item()
        out[f"{name}/bias_scale"] = distance.pow(2).mean().item() / 2 / first_k3
        if own is None or name in own:
            mine = own_rollouts(model, stop_ids, pad_id, plan, first)
            exact = per_record(torch.tensor([x for r in mine for x in r["kl_exact"]]), mine, k3=False)
            k3 = per_record(torch.tensor([x for r in mine for x in r["q"]]) -
                            torch.tensor([x for r in mine for x in r["raw_logprobs"]]), mine, k3=True)
            out[f"{name}/kl"] = ratio_of(exact)
            out[f"{name}/ratio"] = out[f"{name}/kl"] / out["real/kl_k3"]
            out[f"{name}/ratio_lo"], out[f"{name}/ratio_hi"] = bootstrap_ratio(exact, real_k3, draws)
            out[f"{name}/ratio_k3"] = ratio_of(k3) / out["real/kl_k3"]
    return out


def per_record(values: torch.Tensor, records: list[dict], k3: bool) -> torch.Tensor:
    """[n, 2]: per record, the sum over its tokens of `values` (k3: of the k3 terms of these log-ratios) and its
    token count, float64."""
    owner = torch.repeat_interleave(torch.arange(len(records)),
                                    torch.tensor([len(r["completion_ids"]) for r in records]))
    v = values.double()
    terms = torch.expm1(v) - v if k3 else v
    sums = torch.zeros(len(records), dtype=torch.float64).index_add_(0, owner, terms)
    return torch.stack([sums, torch.bincount(owner, minlength=len(records)).double()], 1)


BIAS_LIMIT = 0.05  # forced_ratio is read while its bias scale is below this


def headline(cell: dict, name: str) -> tuple[float, str]:
    """(the ratio to read for plan `name`, which one: "forced" or "own"), module docstring."""
    if cell[f"{name}/bias_scale"] < BIAS_LIMIT or f"{name}/ratio" not in cell:
        return cell[f"{name}/forced_ratio"], "forced"
    return cell[f"{name}/ratio"], "own"


def by_prompt(parts: torch.Tensor, records: list[dict], owner: dict) -> torch.Tensor:
    """per_record's [n, 2] summed over the records of each prompt -> [prompts, 2] (owner: prompt ids -> row)."""
    index = torch.tensor([owner[tuple(r["prompt_ids"])] for r in records])
    return torch.zeros(len(owner), 2, dtype=torch.float64).index_add_(0, index, parts)


def ratio_of(parts: torch.Tensor) -> float:
    return (parts[:, 0].sum() / parts[:, 1].sum()).item()


def bootstrap_ratio(ours: torch.Tensor, real: torch.Tensor, draws: torch.Tensor) -> tuple[float, float]:
    """The 5th and 95th percentiles of mean(ours) / mean(real) over resamples of the prompts (draws [R, n]; ours and
    real: [n, 2] per-prompt sums and token counts)."""
    def mean(parts):
        picked = parts[draws]  # [R, n, 2]
        return picked[..., 0].sum(1) / picked[..., 1].sum(1)
    ratios = mean(ours) / mean(real)
    return torch.quantile(ratios, 0.05).item(), torch.quantile(ratios, 0.95).item()


def worst_ratio(ratios: list[float]) -> float:
    """The largest of max(r, 1/r): how far the worst cell is from agreement, either way."""
    return max(max(r, 1 / r) for r in ratios)
