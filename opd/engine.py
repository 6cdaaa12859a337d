"""The built-in rollout engine: batched prefill + decode over the shared model, with a KV cache at any precision.

Token ids in, `Rollout` records out; no tokenizer, loss or optimizer here. One `generate` call is one batch:
left-pad the prompts, prefill them in one forward, then decode one token per step for every sequence until
each has stopped (eos or a stop token, kept in the completion) or hit `max_new_tokens`. Finished sequences keep
being decoded with their outputs discarded, so the randomness drawn per step does not depend on which rows
finished: that is what lets the naive loop in generate.py reproduce the engine token for token.

The precision plan (plan.py) gives each layer a KV cache spec, a weight scheme and a noise level; the engine runs a
copy of the model with those weights (weight_quant.py) and rebuilds it whenever new weights are published, so the
rollout copy is always "the learner's weights, as the cheap engine would run them". Calibrated scales (`scale_mode="calibrate"`) are measured on the first batch
this engine ever prefills and kept for its lifetime, as vLLM does; `"dynamic"` layers are recalibrated on every
batch. `update_weights` publishes new weights with their policy version; every record carries the version of the
weights that sampled it.

`compile=True` runs the rollout copy's forward through `torch.compile` (inductor, dynamic shapes): one graph for the
prefill and one for every decode step, whatever the prompt lengths, kept across weight updates (the weights are
graph inputs, not constants), compiled when the engine is built. It fuses the few hundred small ops of a decode step
into a few kernels, which is where a small model's time goes (README: ~1.5x the eager engine on this CPU). Building
it compiles (about a minute here; inductor's on-disk cache makes later processes faster). Inductor is told to round
to bfloat16 where eager PyTorch rounds (`emulate_precision_casts`), so a compiled bf16 plan keeps the eager plan's
numerics instead of computing its fused intermediates in float32; only the order of some float reductions differs
(tested).
"""
from dataclasses import dataclass

import torch

from opd.errors import OpdError, require
from opd.generate import left_pad, prefill_mask
from opd.kv_cache import KVCache
from opd.model import Transformer
from opd.plan import Plan
from opd.sampling import SamplingParams, process_logits, sample
from opd.weight_quant import apply_weight_precision


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # processed: log-prob under the distribution the token was drawn from (mu)
    raw_logprobs: list[float]  # log_softmax of the raw logits
    finish_reason: str  # "stop" | "length"
    policy_version: int
    dists: torch.Tensor | None = None  # [n, V] processed log-probs of every step, when generate(return_dists=True)
    q: list[float] | None = None  # full-precision log-probs under the sampling weights (async worker's recompute)
    kl_exact: list[float] | None = None  # per-token KL(p_rollout || p_q), from the same recompute


class Engine:
    def __init__(self, model: Transformer, eos_id: int, pad_id: int, plan: Plan | str | None = None,
                 version: int = 0, noise_seed: int = 0, compile: bool = False):
        n = model.cfg.num_layers
        plan = Plan.parse(plan, n) if isinstance(plan, str) else plan or Plan.full(n)
        require(len(plan.layers) == n, f"precision plan has {len(plan.layers)} layers, the model has {n}")
        self.base, self.plan, self.eos_id, self.pad_id, self.version = model.eval(), plan, eos_id, pad_id, version
        self.kv_plan, self.noise_seed, self.compile = plan.kv_specs, noise_seed, compile
        self.count_clipped = False  # set: each generate leaves (keys, values) saturated fractions in kv_clipped
        self.kv_clipped: tuple[float, float] | None = None
        self.scales: dict = {}  # layer -> [k_scale, v_scale], shared by every batch
        self.model = None
        self._use(self._rollout_copy())
        self.new_cache(1, 1)  # fail now, not mid-run, if the plan does not fit the model's shapes
        if compile:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile now on dummy batches, so that the first real batch is not the one that waits, and a compiler
        failure shows at start. Sizes of 2 or more stay symbolic: other batch, prompt and completion sizes reuse the
        graphs. Twice: a calibrated KV cache's prefill has one graph that calibrates and one that reuses scales."""
        from torch._inductor.async_compile import shutdown_compile_workers
        saved, eos = {i: list(pair) for i, pair in self.scales.items()}, self.eos_id
        self.eos_id = -1  # every step is decoded, whatever the dummy batch samples
        try:
            for _ in range(2):
                self.generate([[1] * 7] * 3, SamplingParams(5, temperature=0.0), torch.Generator())
        finally:
            self.eos_id = eos
            self.scales.clear()  # the dummy batch must not calibrate anything
            self.scales.update(saved)
            # inductor's compiler processes are done: stop them now rather than leave them idle (and, in a rollout
            # worker that gets terminated, leave their semaphores to the resource tracker's leak warning)
            shutdown_compile_workers()

    def _rollout_copy(self) -> Transformer:
        if not self.plan.changes_weights:
            return self.base
        layers = self.plan.layers
        return apply_weight_precision(self.base, [p.weights for p in layers], [p.noise for p in layers],
                                      self.noise_seed, [p.key_outlier for p in layers])

    def update_weights(self, state_dict: dict, version: int) -> None:
        self.base.load_state_dict(state_dict)
        self._use(self._rollout_copy())
        self.version = version

    def _use(self, model: Transformer) -> None:
        if model is not self.model:  # the same module updated in place keeps its forward
            self.model, self.forward = model, compiled_forward(model) if self.compile else model

    def _scales_for_batch(self) -> dict:
        for i, spec in enumerate(self.kv_plan):
            if spec.scale_mode == "dynamic":
                self.scales.pop(i, None)
        return self.scales

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        dtype = next(self.model.parameters()).dtype
        return KVCache(self.model.cfg, batch_size, max_len, dtype, specs=self.kv_plan, scales=self._scales_for_batch(),
                       count_clipped=self.count_clipped)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator,
                 return_dists: bool = False) -> list[Rollout]:
        """return_dists also keeps each step's whole processed distribution (for the exact rollout-vs-trainer KL)."""
        require(all(len(p) > 0 for p in prompts), "every prompt needs at least one token")
        ids, valid = left_pad(prompts, self.pad_id)  # [B, P]
        B, P = ids.shape
        N = params.max_new_tokens
        require(P + N <= self.model.cfg.max_position_embeddings,
                f"prompt ({P}) + max_new_tokens ({N}) exceeds the model's context "
                f"({self.model.cfg.max_position_embeddings})", "shorten the prompts or lower max_new_tokens")
        cache = self.new_cache(B, P + N)
        logits = self.forward(ids, (valid.cumsum(1) - 1).clamp(min=0), prefill_mask(valid), cache)[:, -1]  # [B, V]
        next_pos = valid.sum(1, keepdim=True)  # [B, 1]
        key_valid = torch.cat([valid, torch.ones(B, N, dtype=torch.bool)], 1)
        stops = torch.tensor([self.eos_id, *params.stop_token_ids])
        tokens, mu, raw = (torch.zeros(B, N, dtype=torch.long), torch.zeros(B, N), torch.zeros(B, N))
        lengths = torch.full((B,), N)
        done = torch.zeros(B, dtype=torch.bool)
        dists = []
        for t in range(N):
            check_finite(logits, t)
            tok, mu[:, t], raw[:, t], processed = self._step(logits, params, generator)
            if return_dists:
                dists.append(processed)
            tokens[:, t] = tok
            stopped = torch.isin(tok, stops) & ~done
            lengths[stopped] = t + 1
            done |= stopped
            if done.all() or t == N - 1:
                break
            logits = self.forward(tok[:, None], next_pos + t, key_valid[:, None, None, :P + t + 1], cache)[:, -1]
        self.kv_clipped = cache.clipped_fractions() if self.count_clipped else None
        dists = torch.stack(dists, 1) if return_dists else None  # [B, steps, V]
        return [Rollout(prompts[b], tokens[b, :lengths[b]].tolist(), mu[b, :lengths[b]].tolist(),
                        raw[b, :lengths[b]].tolist(), "stop" if done[b] else "length", self.version,
                        None if dists is None else dists[b, :lengths[b]])
                for b in range(B)]

    @staticmethod
    def _step(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
        """logits [B, V] -> sampled token [B], its processed and raw log-probs [B], processed log-probs [B, V]."""
        raw = logits.float().log_softmax(-1)
        processed = process_logits(logits, params) if params.reshapes_distribution else raw
        tok = sample(processed, params, generator)
        return tok, processed.gather(1, tok[:, None])[:, 0], raw.gather(1, tok[:, None])[:, 0], processed


def compiled_forward(model: Transformer):
    """model.forward through torch.compile; a new copy of the same shape reuses the graphs already compiled."""
    import torch._inductor.config
    import torch.fx.experimental._config
    from torch._inductor.cpp_builder import get_cpp_compiler
    try:  # inductor finds out only after tracing the model (~25 s here); asking it first takes milliseconds
        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 (InvalidCxxCompiler, or anything else that means "no compiler")
        _compile_failed(e)
    torch._inductor.config.emulate_precision_casts = True  # round to bf16 where eager does (see the docstring)
    torch.fx.experimental._config.use_duck_shape = False  # a batch of 64 must not be tied to a dimension of 64
    compiled = torch.compile(model.forward, dynamic=True)

    def forward(*args):
        try:
            return compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as e:  # e.g. inductor could not build a kernel
            _compile_failed(e)
    return forward


def _compile_failed(e: Exception):
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise OpdError(f"torch.compile of the rollout engine failed: {reason}", "set engine_compile=false, or install a "
                   "working C++ compiler (inductor builds its CPU kernels with it)") from None


def check_finite(logits: torch.Tensor, step: int) -> None:
    """NaN/Inf logits would sample garbage with NaN log-probs and poison every metric: stop with one line instead."""
    bad = ~torch.isfinite(logits).all(-1)
    if bad.any():
        raise OpdError(f"the rollout engine produced NaN/Inf logits at decode step {step} for {int(bad.sum())} of "
                       f"{len(bad)} sequences", "check the student checkpoint for NaN/Inf weights, or use a "
                       "plan without weight noise or quantization")
