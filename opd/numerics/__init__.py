"""Low-precision numerics: quantizers, the KV cache, weight schemes, kernels' rounding, precision plans."""
