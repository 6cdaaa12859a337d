"""The built-in rollout engine: batched prefill + decode over the shared model, with a KV cache at any precision.

Token ids in, `Rollout` records out; no tokenizer, loss or optimizer here. One `generate` call is one batch:
left-pad the prompts, prefill them in one forward, then decode one token per step for every sequence until
each has stopped (one of the stop ids, kept in the completion) or hit `max_new_tokens`. Finished sequences keep
being decoded with their outputs discarded, so the randomness drawn per step does not depend on which rows
finished: that is what lets the naive loop in naive.py reproduce the engine token for token. The output layer
runs only where a token is drawn: at each prompt's last position in the prefill, and at the new position of each
decode step, so the engine's memory grows with batch x vocabulary, never with prompt or completion length x vocabulary.

The precision plan (plan.py) gives each layer a KV cache spec, a weight scheme and a noise level. The engine runs the
model it is given ("the published weights") through `weight_quant.rollout_copy`: the layers the plan changes are the
engine's own, stored at the plan's precision and re-made whenever new weights are published; everything else is the
given model's own tensors, so a plan that changes no weights costs no copy. The sync trainer hands the engine the
learner itself: sampling happens only between optimizer steps, so the engine always runs the version it was last
published. Calibrated scales (`scale_mode="calibrate"`) are measured on the first batch this engine ever prefills and
kept for its lifetime, as vLLM does; `"dynamic"` layers are recalibrated on every batch. `update_weights` publishes
new weights with their policy version; every record carries the version of the weights that sampled it.

With `return_hidden`, each record also keeps the final hidden state of every step ([n, hidden]); `logprobs` turns
them back into the distributions the tokens were drawn from. That is how the exact rollout-vs-trainer KL is computed
(chunked.py) without keeping [batch, tokens, vocab] distributions: at a vocabulary of 150k, hidden states are
~40-150x smaller.

`compile=True` runs the rollout copy's forward through `torch.compile` (inductor, dynamic shapes): one graph for the
prefill and one for every decode step, whatever the prompt lengths, kept across weight updates (the weights are
graph inputs, updated in place), compiled when the engine is built. It fuses the few hundred small ops of a decode step
into a few kernels, which is where a small model's time goes (docs/benchmarks.md has the speed-up). Building
it compiles (about a minute on a 2-core CPU; inductor's on-disk cache makes later processes faster). Inductor is told to round
to bfloat16 where eager PyTorch rounds (`emulate_precision_casts`), so a compiled bf16 plan keeps the eager plan's
numerics instead of computing its fused intermediates in float32; only the order of some float reductions differs
(tested).
"""
from dataclasses import replace

import torch

from opd.models.devices import native_bf16
from opd.io.errors import OpdError, first_line, require
from opd.numerics.kernels import apply_kernels
from opd.numerics.kv_cache import KVCache, vllm_format
from opd.models.model import Transformer
from opd.engines.naive import left_pad, prefill_mask
from opd.numerics.plan import Plan
from opd.engines.sampling import Rollout, SamplingParams, drawn_logprobs, process_logits, raw_logprobs, sample, seeded
from opd.numerics.weight_quant import LayerWeights, refresh, rollout_copy


def next_token_logits(model: Transformer, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                      cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill or decode forward: the last position's final hidden state [B, d] and logits [B, V]. Left padding
    puts every prompt's last token at the last position, so the output layer runs on one position per row."""
    h = model.hidden(ids, positions, mask, cache)[:, -1]
    return h, model.lm_head(h)


class Engine:
    """The built-in rollout engine: the student under a precision plan, decoding with its own KV cache."""
    hidden_states = True  # can return each step's hidden state (the exact KL) and count KV saturation (`stats`)

    def __init__(self, model: Transformer, stop_ids: int | list[int], pad_id: int, plan: Plan | str | None = None,
                 version: int = 0, noise_seed: int = 0, compile: bool = False, shadows: bool | None = None,
                 bf16_gemm: str = "float32"):
        """shadows: keep dequantized copies of quantized weights and KV caches (weight_quant.QuantLinear, kv_cache);
        default: on the CPU, where they make the emulation fast; the results are the same without them.
        bf16_gemm (a forward=bf16 plan on a CPU with shadows): "float32" GEMMs of the bf16 weights (their float32
        shadows), "native" bf16 GEMMs, or "auto" (native where devices.native_bf16 says the CPU runs them)."""
        n = model.cfg.num_layers
        plan = Plan.parse(plan, n) if isinstance(plan, str) else plan or Plan.full(n)
        require(len(plan.layers) == n, f"precision plan has {len(plan.layers)} layers, the model has {n}")
        native_kv = next((layer.kv.dtype for layer in plan.layers if vllm_format(layer.kv.dtype)), None)
        require(native_kv is None, f"kv={native_kv} is vLLM's own KV format, which opd does not emulate",
                "run it on the vllm engine (engine.name=vllm), or name an emulated format (kv=fp8_e4m3, int8, ...)")
        self.stop_ids = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids)  # [-1]: never stop
        self.base, self.plan, self.pad_id, self.version = model.eval(), plan, pad_id, version
        self.kv_plan, self.noise_seed, self.compile = plan.kv_specs, noise_seed, compile
        self.device = model.embed_tokens.weight.device
        self.shadows = self.device.type == "cpu" if shadows is None else shadows
        # a bf16 forward's w=none layers hold bf16 weights; with shadows (the CPU) as QuantLinear's bf16 scheme,
        # whose float32 shadow computes what a bf16 kernel does (float32 accumulation), 2x faster than bf16 matmuls
        # on a CPU without native bf16; else as plain bf16 layers (a GPU's bf16 GEMM, AMX, AVX512-BF16)
        native = bf16_gemm == "native" or (bf16_gemm == "auto" and native_bf16(self.device))
        bf16 = plan.forward == "bf16" and self.shadows and not native
        self.weights = [LayerWeights("bf16" if bf16 and p.weights == "none" else p.weights, p.noise, p.key_outlier)
                        for p in plan.layers]
        self.scales: dict = {}  # layer -> [k_scale, v_scale], shared by every batch
        self.model = rollout_copy(model, self.weights, noise_seed, self.shadows, plan.forward, native=native)
        apply_kernels(self.model, plan.kernels, [spec.dtype for spec in plan.kv_specs])
        self.forward = compiled_forward(self.model) if compile else \
            lambda *args: next_token_logits(self.model, *args)
        self.new_cache(1, 1)  # fail now, not mid-run, if the plan does not fit the model's shapes
        if compile:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile now on dummy batches, so that the first real batch is not the one that waits, and a compiler
        failure shows at start. Sizes of 2 or more stay symbolic: other batch, prompt and completion sizes reuse the
        graphs. Twice: a calibrated KV cache's prefill has one graph that calibrates and one that reuses scales."""
        from torch._inductor.async_compile import shutdown_compile_workers
        saved, stops = {i: list(pair) for i, pair in self.scales.items()}, self.stop_ids
        self.stop_ids = [-1]  # every step is decoded, whatever the dummy batch samples
        try:
            for _ in range(2):
                self.generate([[1] * 7] * 3, SamplingParams(5, temperature=0.0), 0)
        finally:
            self.stop_ids = stops
            self.scales.clear()  # the dummy batch must not calibrate anything
            self.scales.update(saved)
            # inductor's compiler processes are done: stop them now rather than leave them idle (and, in a rollout
            # worker that gets terminated, leave their semaphores to the resource tracker's leak warning)
            shutdown_compile_workers()

    @classmethod
    def for_model(cls, model: Transformer, model_dir: str, stop_ids: int | list[int], pad_id: int, plan: Plan, *,
                  version: int = 0, noise_seed: int = 0, compile: bool = False, bf16_gemm: str = "float32",
                  **unused) -> "Engine":
        """engines.make_engine's constructor: the engine runs `model` itself (no folder, no sizes)."""
        return cls(model, stop_ids, pad_id, plan, version, noise_seed, compile, bf16_gemm=bf16_gemm)

    @torch.no_grad()
    def update_weights(self, state_dict: dict, version: int) -> None:
        """Publish new weights: loaded into the base model (tensors that already are the base's are skipped: the sync
        trainer's engine runs the learner itself), then the plan's changed layers are re-made from them."""
        for name, tensor in self.base.state_dict().items():
            new = state_dict[name]
            if new.data_ptr() != tensor.data_ptr():
                tensor.copy_(new)
        if self.model is not self.base:
            refresh(self.model, self.base, self.weights, self.noise_seed)
        self.version = version

    def _scales_for_batch(self) -> dict:
        for i, spec in enumerate(self.kv_plan):
            if spec.scale_mode == "dynamic":
                self.scales.pop(i, None)
        return self.scales

    def new_cache(self, batch_size: int, max_len: int, count_clipped: bool = False) -> KVCache:
        dtype = self.model.embed_tokens.weight.dtype
        return KVCache(self.model.cfg, batch_size, max_len, dtype, self.device, specs=self.kv_plan,
                       scales=self._scales_for_batch(), count_clipped=count_clipped, shadow=self.shadows)

    def close(self) -> None:
        """Nothing to release: the engine is tensors in this process (VllmEngine has an engine process to stop)."""

    def logprobs(self, hidden: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        return drawn_logprobs(self.model.lm_head, hidden.to(self.device), params)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | int,
                 return_hidden: bool = False, stats: dict | None = None) -> list[Rollout]:
        """generator: one on this engine's device, or a seed. return_hidden also keeps each step's final hidden
        state (for the exact rollout-vs-trainer KL, through `logprobs`). stats, if given, receives the share of the
        keys and values the KV cache's fp8/int8 layers saturated (`kv_clipped_k`, `kv_clipped_v`): the admission
        probe's sign of outlier keys."""
        return self._decode(prompts, params, seeded(generator, self.device), return_hidden, stats=stats)

    @torch.no_grad()
    def teacher_force(self, prompts: list[list[int]], completions: list[list[int]],
                      params: SamplingParams, return_hidden: bool = False) -> list[Rollout]:
        """The given completions decoded as if sampled: step by step, each token fed back through the KV cache as
        in generation, with the log-probs this engine gives them (to compare engines on identical sequences)."""
        require(len(prompts) == len(completions) and all(completions), "one non-empty completion per prompt")
        N = max(map(len, completions))
        forced = torch.tensor([c + [self.pad_id] * (N - len(c)) for c in completions], device=self.device)
        return self._decode(prompts, replace(params, max_new_tokens=N), None, return_hidden,
                            forced=(forced, list(map(len, completions))))

    @torch.no_grad()
    def prefill_hidden(self, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor]:
        """Prompt + completion scored in one forward, as an inference server scores a prompt (vLLM's prompt
        log-probs): the sequences left-padded and prefilled through a KV cache at the plan's precision (attention
        reads the stored, quantized keys and values, the current position's included). Returns, per sequence, the
        final hidden states [n, d] that predict its n completion tokens; `self.model.lm_head` turns them into
        log-probs. Against `teacher_force` (decode), the same numbers up to the order of float sums (test)."""
        require(len(prompts) == len(completions) and all(prompts), "one prompt (of at least one token) per completion")
        sequences = [p + c for p, c in zip(prompts, completions)]
        ids, valid = (t.to(self.device) for t in left_pad(sequences, self.pad_id))
        B, L = ids.shape
        require(L <= self.model.cfg.context, f"prompt + completion ({L} tokens) exceeds the model's context "
                f"({self.model.cfg.context})", "shorten the prompts or lower max_new_tokens")
        cache = self.new_cache(B, L)
        h = self.model.hidden(ids, (valid.cumsum(1) - 1).clamp(min=0), prefill_mask(valid), cache)  # [B, L, d]
        starts = [L - len(s) + len(p) - 1 for s, p in zip(sequences, prompts)]  # predicts the first completion token
        return [h[b, start:start + len(c)] for b, (start, c) in enumerate(zip(starts, completions))]

    def _decode(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None,
                return_hidden: bool = False, forced: tuple[torch.Tensor, list[int]] | None = None,
                stats: dict | None = None) -> list[Rollout]:
        """Prefill, then one token a step: sampled, or (forced: tokens [B, N], lengths) the given one."""
        require(all(len(p) > 0 for p in prompts), "every prompt needs at least one token")
        device = self.device
        ids, valid = (t.to(device) for t in left_pad(prompts, self.pad_id))  # [B, P]
        B, P = ids.shape
        N = params.max_new_tokens
        require(P + N <= self.model.cfg.context, f"prompt ({P}) + max_new_tokens ({N}) exceeds the model's context "
                f"({self.model.cfg.context})", "shorten the prompts or lower max_new_tokens")
        cache = self.new_cache(B, P + N, count_clipped=stats is not None)
        h, logits = self.forward(ids, (valid.cumsum(1) - 1).clamp(min=0), prefill_mask(valid), cache)  # [B, V]
        next_pos = valid.sum(1, keepdim=True)  # [B, 1]
        key_valid = torch.cat([valid, torch.ones(B, N, dtype=torch.bool, device=device)], 1)
        stops = torch.tensor([*self.stop_ids, *params.stop_token_ids], device=device)
        tokens = torch.zeros(B, N, dtype=torch.long, device=device)
        mu, raw = torch.zeros(B, N, device=device), torch.zeros(B, N, device=device)
        lengths = torch.full((B,), N, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        hidden = []
        ends = None if forced is None else torch.tensor(forced[1], device=device)  # forced rows end at their length
        for t in range(N):
            check_finite(logits, t)
            given = None if forced is None else forced[0][:, t]
            tok, mu[:, t], raw[:, t] = self._step(logits, params, generator, given)
            if return_hidden:
                hidden.append(h)
            tokens[:, t] = tok
            ended = torch.isin(tok, stops) if forced is None else t + 1 == ends
            stopped = ended & ~done
            lengths[stopped] = t + 1
            done |= stopped
            if done.all() or t == N - 1:
                break
            h, logits = self.forward(tok[:, None], next_pos + t, key_valid[:, None, None, :P + t + 1], cache)
        if stats is not None:
            stats["kv_clipped_k"], stats["kv_clipped_v"] = cache.clipped_fractions()
        hidden = torch.stack(hidden, 1) if return_hidden else None  # [B, steps, d]
        tokens, mu, raw, lengths, done = (x.cpu() for x in (tokens, mu, raw, lengths, done))
        return [Rollout(prompts[b], tokens[b, :lengths[b]].tolist(), mu[b, :lengths[b]].tolist(),
                        raw[b, :lengths[b]].tolist(), "stop" if done[b] else "length", self.version,
                        None if hidden is None else hidden[b, :lengths[b]].clone())
                for b in range(B)]

    @staticmethod
    def _step(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
              given: torch.Tensor | None = None):
        """logits [B, V] -> the sampled token [B] (or the given one, teacher forcing), its processed and raw
        log-probs [B]."""
        raw = raw_logprobs(logits, params)
        processed = process_logits(logits, params) if params.truncates else raw
        tok = sample(processed, params, generator) if given is None else given
        return tok, processed.gather(1, tok[:, None])[:, 0], raw.gather(1, tok[:, None])[:, 0]


def compiled_forward(model: Transformer):
    """next_token_logits on `model` through torch.compile (the weights are graph inputs, updated in place)."""
    import torch._inductor.config
    import torch.fx.experimental._config
    from torch._inductor.cpp_builder import get_cpp_compiler
    try:  # inductor finds out only after tracing the model (~25 s here); asking it first takes milliseconds
        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 (InvalidCxxCompiler, or anything else that means "no compiler")
        _compile_failed(e)
    compiled = torch.compile(next_token_logits, dynamic=True)

    def forward(*args):
        # compiler settings for these calls only (a call may compile a graph), not for the rest of the process:
        # round to bf16 where eager does (see the docstring); a batch of 64 must not be tied to a dimension of 64
        try:
            with torch._inductor.config.patch(emulate_precision_casts=True), \
                    torch.fx.experimental._config.patch(use_duck_shape=False):
                return compiled(model, *args)
        except torch._dynamo.exc.TorchDynamoException as e:  # e.g. inductor could not build a kernel
            _compile_failed(e)
    return forward


def _compile_failed(e: Exception):
    reason = first_line(e)
    raise OpdError(f"torch.compile of the rollout engine failed: {reason}", "set engine.compile=false, or install a "
                   "working C++ compiler (inductor builds its CPU kernels with it)") from None


def check_finite(logits: torch.Tensor, step: int) -> None:
    """NaN/Inf logits would sample garbage with NaN log-probs and poison every metric: stop with one line instead."""
    bad = ~torch.isfinite(logits).all(-1)
    if bad.any():
        raise OpdError(f"the rollout engine produced NaN/Inf logits at decode step {step} for {int(bad.sum())} of "
                       f"{len(bad)} sequences", "check the student checkpoint for NaN/Inf weights, or use a "
                       "plan without weight noise or quantization")
