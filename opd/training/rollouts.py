"""Where a training step's rollouts come from: one interface, two schedules.

The trainer holds one `Rollouts` and never asks which schedule it is:

    start(weights, version, saved)   begin sampling from these weights; saved: what `state_dict` returned (a resume)
    next_batch(step, version)        the batch to train step `step` on, the learner being at `version`
    publish(weights, version)        the learner's new weights after an optimizer step
    set_plan(plan)                   sample under another precision plan from now on (the guard's fallback)
    state_dict(wait)                 what a checkpoint needs to continue exactly (tensors and plain values)
    close()

`SyncRollouts` (here) samples in the trainer's process between optimizer steps, so its rollouts are never stale;
`AsyncRollouts` (async_rollouts.py) samples ahead in a worker process, within `max_staleness`. Batch i is sampled with
seed `sampler_seed(seed, i)` by both, so the async schedule at staleness 0 reproduces the synchronous run exactly.
`too_stale` is the one rule for how old a batch may be (engines.make_engine is the one place an engine is built).
"""
import functools
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from opd.io.errors import require
from opd.numerics.plan import Plan
from opd.engines.sampling import Rollout, SamplingParams, drawn_logprobs


def sampler_seed(seed: int, index: int, attempt: int = 0) -> int:
    """The sampling seed of prompt batch `index` (attempt > 0: a re-sample): both schedules draw batch i alike."""
    return (seed * 1_000_003 + index) * 64 + attempt


def shards(prompts: list, seed: int, n: int) -> list[tuple[list, int]]:
    """A batch's prompts and sampling seed -> its n sub-batches (contiguous, sizes differing by at most one) and their
    seeds. Every schedule and backend samples a batch this way, so the rollouts do not depend on where each sub-batch
    is sampled; one shard is the batch itself with its seed."""
    if n == 1:
        return [(list(prompts), seed)]
    size, extra = divmod(len(prompts), n)
    bounds = [j * size + min(j, extra) for j in range(n + 1)]
    return [(list(prompts[bounds[j]:bounds[j + 1]]), (seed * 1_000_003 + j + 1) % 2 ** 63) for j in range(n)]


def by_sizes(items: list, sizes: list[int]) -> list[list]:
    """items cut into consecutive pieces of the given sizes (which add up to len(items))."""
    require(sum(sizes) == len(items) and all(size > 0 for size in sizes), "sub-batches that do not cover their batch")
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    return [list(items[a:b]) for a, b in zip(starts, starts[1:])]


def generate_shards(engine, parts: list[tuple[list, int]], params: SamplingParams, return_hidden: bool) -> list:
    """The rollouts of sub-batches (shards()), sampled one after another by one engine, in order."""
    return [r for prompts, seed in parts for r in engine.generate(prompts, params, seed, return_hidden=return_hidden)]


def too_stale(sampled_version: int, learner_version: int, max_staleness: int) -> str | None:
    """Why a batch sampled by policy version `sampled_version` may not train the learner at `learner_version`, or None
    when it may: the learner is at most `max_staleness` optimizer steps ahead of the weights that sampled it."""
    gap = learner_version - sampled_version
    if gap <= max_staleness:
        return None
    return f"sampled by version {sampled_version}, {gap} steps behind the learner's {learner_version} " \
           f"(max_staleness {max_staleness})"


@dataclass
class StepRollouts:
    """One step's rollouts, the sampling side's metrics, and (for the exact KL) a function from the sampling engine's
    hidden rows to its log-probs, or None."""
    rollouts: list[Rollout]
    metrics: dict
    engine_logprobs: Callable | None = None
    key: tuple[int, int] | None = None  # (prompt batch, sampling attempt): sampler_seed's arguments


class Rollouts(Protocol):
    scales: dict  # the engine's calibrated KV scales (layer -> [k_scale, v_scale]), saved with a checkpoint
    counts: dict  # the schedule's event counts, reported in the summary as async/<name> ({} for sync)

    def start(self, weights: dict, version: int, saved: dict) -> None: ...
    def next_batch(self, step: int, version: int) -> StepRollouts: ...
    def publish(self, weights: dict, version: int) -> None: ...
    def set_plan(self, plan: Plan) -> None: ...
    def state_dict(self, wait: bool) -> dict: ...
    def close(self) -> None: ...


class SyncRollouts:
    """The synchronous schedule: an engine in this process samples batch `step` with the weights of the step just
    taken (the built-in engine shares the learner's tensors where the plan keeps full precision, so a publish re-makes
    only the layers the plan changes)."""
    counts: dict = {}

    def __init__(self, build: Callable[[Plan], object], plan: Plan, prompts, params: SamplingParams, seed: int,
                 exact_kl: bool, n_shards: int = 1, rank: int | None = None):
        """build(plan) -> an engine (engines.make_engine with the run's settings); exact_kl: keep the hidden states;
        n_shards: sub-batches per batch (shards()); rank: sample only sub-batch `rank` (a sharded learner's rank,
        sharded.py); None: all of them."""
        self.build, self.prompts, self.params, self.seed, self.exact_kl = build, prompts, params, seed, exact_kl
        self.n_shards, self.rank = n_shards, rank
        self.engine = build(plan)
        self.published: tuple[dict, int] | None = None

    @property
    def scales(self) -> dict:
        return self.engine.scales

    def start(self, weights: dict, version: int, saved: dict) -> None:
        """A fresh run samples from the weights the engine was built on; a resumed one gets the checkpoint's weights
        and KV scales."""
        self.published = (weights, version)
        if saved:
            self.engine.update_weights(weights, version)
            self.engine.scales.update(saved.get("engine_scales", {}))

    def next_batch(self, step: int, version: int) -> StepRollouts:
        start = time.perf_counter()
        parts = shards(self.prompts.batch(step), sampler_seed(self.seed, step), self.n_shards)
        if self.rank is not None:
            parts = parts[self.rank:self.rank + 1]
        rollouts = generate_shards(self.engine, parts, self.params, self.exact_kl)
        return StepRollouts(rollouts, {"time/generate": time.perf_counter() - start}, self.engine_logprobs(), (step, 0))

    def engine_logprobs(self) -> Callable | None:
        """The engine's hidden rows -> its log-probs (for the exact KL), or None without exact_kl."""
        return functools.partial(self.engine.logprobs, params=self.params) if self.exact_kl else None

    def publish(self, weights: dict, version: int) -> None:
        self.published = (weights, version)
        self.engine.update_weights(weights, version)

    def set_plan(self, plan: Plan) -> None:
        """A new engine under plan (its KV scales start afresh), sent the newest weights if sampling has started."""
        self.engine.close()
        self.engine = self.build(plan)
        if self.published is not None:
            self.engine.update_weights(*self.published)

    def state_dict(self, wait: bool) -> dict:
        return {"engine_scales": dict(self.engine.scales)}

    def close(self) -> None:
        self.engine.close()


def learner_logprobs(lm_head, params: SamplingParams, forward: str = "fp32") -> Callable:
    """Hidden rows -> log-probs as the sampling engine's output layer computes them, from the learner's: the exact KL
    of rollouts the learner's current weights sampled (async at staleness 0, where the worker sends its hidden states
    back). The engine's head is the learner's in a float32 forward; in a bf16 forward (plan `forward=bf16`) it is the
    learner's weights rounded to bf16, applied to bf16 hidden states (weight_quant.rollout_copy), so that is what is
    computed here (the weights are converted again after each optimizer step)."""
    if forward != "bf16":
        return functools.partial(drawn_logprobs, lm_head, params=params)
    cached: dict = {}

    def head(hidden):
        weight = lm_head.weight
        key = (weight.data_ptr(), weight._version)  # changes with every in-place optimizer update
        if cached.get("key") != key:
            cached.update(key=key, weight=weight.detach().to(torch.bfloat16))
        return torch.nn.functional.linear(hidden, cached["weight"])
    return functools.partial(drawn_logprobs, head, params=params)
