"""From logits to a sampled token: temperature, top-k, top-p, and the two log-probs a rollout records.

`processed` log-probs are log_softmax of the logits after temperature scaling and top-k/top-p masking, i.e. the
distribution the token was actually drawn from: OPD's `mu` (vLLM: `logprobs_mode="processed_logprobs"`). `raw` ones
are the same before the truncation: log_softmax(logits / temperature), the distribution the trainer's `q` is computed
under (the learner differentiates the tempered, untruncated policy). At temperature 1 they are vLLM's raw log-probs.
Truncation moves `mu` away from `q` by -log(kept mass) at every token, whatever the numerics: the mismatch metrics
use `raw` when it is on, and report the truncation apart (metrics.truncation_metrics).

Sampling inverts the cumulative distribution: one uniform draw per row, the first token whose cumulative mass (in
float64) exceeds it. It draws a fixed amount of randomness per step whatever the probabilities are, so two loops that
make the same calls on the same generator draw the same tokens. (Until 2026-12 it was the exponential race, argmax
of p / E with E ~ Exp(1), as vLLM's sampler does: one exponential per vocabulary entry cost 26 ms a step at batch 16
and V = 49,152 on 2 cores, ~20% of a real student's decode step; this costs ~2 ms. dev/LOG.md.) Temperature 0 is
greedy.
"""
import math
from dataclasses import dataclass

import torch

from opd.io.errors import require


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens besides the engine's eos

    def __post_init__(self):
        require(self.max_new_tokens > 0, f"max_new_tokens must be positive, got {self.max_new_tokens}",
                "give a positive number of tokens")
        require(0 <= self.temperature < math.inf, f"temperature must be finite and >= 0, got {self.temperature}",
                "1 samples the model's distribution, 0 is greedy")
        require(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}", "0 turns it off")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}", "1 turns it off")

    @property
    def truncates(self) -> bool:
        """True when top-k or top-p cut the distribution: processed log-probs differ from the raw ones."""
        return self.top_k > 0 or self.top_p < 1

    @property
    def reshapes_distribution(self) -> bool:
        """False when processed log-probs equal log_softmax of the logits (temperature 0 or 1, no truncation)."""
        return self.temperature not in (0.0, 1.0) or self.truncates


def raw_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [B, V] -> log_softmax(logits / temperature) [B, V] (temperature 0: of the logits themselves); the same
    operations as process_logits up to the truncation, so without one the two are equal to the bit."""
    logits = logits.float()
    if params.temperature not in (0.0, 1.0):
        logits = logits / params.temperature
    return logits.log_softmax(-1)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [B, V] -> processed log-probs [B, V] (-inf outside the top-k / top-p support)."""
    logits = logits.float()
    if params.temperature > 0:
        logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # mass strictly before this token already exceeds top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.log_softmax(-1)


def seeded(generator: torch.Generator | int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator to sample with on `device`: a seed makes a new one there; a generator is used as it is (a CUDA
    generator draws other numbers than a CPU one from the same seed)."""
    if isinstance(generator, torch.Generator):
        require(generator.device.type == torch.device(device).type,
                f"a {generator.device.type} random generator cannot sample on {device}", "pass a seed instead")
        return generator
    return torch.Generator(device=device).manual_seed(int(generator))


def sample(logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """processed log-probs [B, V] -> token ids [B]."""
    if params.temperature == 0:
        return logprobs.argmax(-1)
    cdf = logprobs.double().exp().cumsum(-1)  # [B, V]; float64: a 150k-term sum's rounding stays ~1e-12
    total = cdf[:, -1:]
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=cdf.dtype, device=cdf.device) * total
    u = torch.minimum(u, total.nextafter(total.new_zeros(())))  # rounded up to the total: the last token with mass
    return torch.searchsorted(cdf, u, right=True)[:, 0]  # a token of zero mass has an empty interval: never drawn


def drawn_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Final hidden states [c, d] of generated steps -> the engine's log-probs [c, V] at the sampling temperature,
    before top-k/top-p (the raw ones: the numerics, without the truncation; sampling.py): a decode step's computation
    (its rows may round differently in the last bit). lm_head: the sampling weights'."""
    return raw_logprobs(lm_head(hidden), params)


@dataclass
class Rollout:
    """One sampled completion as every engine reports it (engines.RolloutEngine.generate)."""
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # processed: log-prob under the distribution the token was drawn from (mu)
    raw_logprobs: list[float]  # before top-k/top-p: log_softmax(logits / temperature) (sampling.py)
    finish_reason: str  # "stop" | "length"
    policy_version: int
    hidden: torch.Tensor | None = None  # [n, d] final hidden state of every step, when generate(return_hidden=True)
    q: list[float] | None = None  # full-precision log-probs under the sampling weights (async worker's recompute)
    kl_exact: list[float] | None = None  # per-token KL(p_rollout || p_q), from the same recompute
