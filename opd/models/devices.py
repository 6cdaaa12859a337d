"""Devices and dtypes: the names a config may use, and their check against the machine the run is on.

`device` is `auto` (CUDA when this PyTorch sees a GPU, else the CPU), `cpu`, `cuda` or `cuda:N`. A config is
checked for names when it is read (config.py) and against the machine when a run is set up (`resolve`), before
anything is written: a run directory is never left behind by a device that is not there.

Dtypes (`compute.dtype`, `compute.teacher_dtype`): `float32`, or `bf16`. For the learner, bf16 means bf16 compute under
`torch.autocast` with float32 master weights, gradients and optimizer state (mixed precision as PyTorch defines
it); for the frozen teacher it means weights stored in bf16, half the memory of float32. CPUs run bf16 in any
PyTorch (slowly without native support); a GPU needs to support it (`torch.cuda.is_bf16_supported`).
"""
import re
import sys
from contextlib import contextmanager

import torch

from opd.io.errors import OpdError, require

DTYPE_NAMES = ("float32", "bf16")  # the learner's and teacher's dtypes (DTYPES: their torch dtypes)
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16)))


def check_name(name: str, what: str = "device") -> None:
    """A device name a config may use (whether this machine has it: resolve, when a run is set up)."""
    require(isinstance(name, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", name) is not None,
            f"config: unknown {what} {name!r}", f"use {DEVICE_FORMS}")


def check_dtype_name(name: str, what: str = "dtype") -> None:
    require(name in DTYPE_NAMES, f"config: unknown {what} {name!r}", f"use one of {', '.join(DTYPE_NAMES)}")


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether the device runs bf16 matmuls natively: a CUDA GPU that supports bf16, or a CPU with AMX or AVX512-BF16
    (/proc/cpuinfo's amx_bf16, avx512_bf16). Elsewhere PyTorch emulates bf16 arithmetic, slower than float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def cpu_description() -> str:
    """This CPU's model name and its widest bf16/vector ISA (amx, avx512_bf16, avx512, avx2): deterministic results
    differ across them, so a study records it with every run."""
    flags, name = cpu_flags(), "?"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    isa = next((isa for flag, isa in (("amx_bf16", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"),
                                      ("avx2", "avx2")) if flag in flags), "other")
    return f"{name} ({isa})"


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def autocast_dtype(name: str) -> torch.dtype | None:
    """The learner's `dtype` as an autocast dtype: None for float32 (no autocast)."""
    return None if name == "float32" else DTYPES[name]


def resolve(name: str, what: str = "device") -> torch.device:
    """A device name -> the torch.device it means here, or one line saying why it is not here."""
    check_name(name, what)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise OpdError(f"{what} {name} was asked for, but PyTorch sees no CUDA GPU here (torch "
                           f"{torch.__version__}, {build})", f"set {what} to cpu or auto")
        count = torch.cuda.device_count()
        require(device.index is None or device.index < count,
                f"{what} {name} does not exist: this machine has {count} CUDA device(s), cuda:0-{count - 1}",
                "use an index below the count, or auto")
    return device


def resolve_dtype(name: str, device: torch.device, what: str = "dtype") -> torch.dtype:
    """A dtype name -> its torch dtype on the device: bf16 on a GPU without it is refused; on a CPU without native bf16
    it runs, slower than float32, and a one-line note says so."""
    check_dtype_name(name, what)
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cuda":
        require(torch.cuda.is_bf16_supported(), f"{what} bf16 is not supported by {device} "
                f"({torch.cuda.get_device_name(device)})", f"set {what} to float32")
    elif dtype == torch.bfloat16 and not native_bf16(device):
        print(f"opd: note: {what} bf16 on a CPU without native bf16 (AMX or AVX512-BF16): PyTorch emulates it, slower "
              "than float32 here", file=sys.stderr)
    return dtype


def peak_memory(device: torch.device) -> int:
    """Bytes: the device's peak allocation since the last reset (CUDA), or this process's peak resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def current_memory(device: torch.device) -> int:
    """Bytes allocated on the device now (CUDA), or this process's resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator statistics, or the kernel's resident-set high-water mark (Linux: writing 5
    to /proc/self/clear_refs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@contextmanager
def restored_threads():
    """torch's intra-op thread count as it was on the way in, set back on the way out: a run sets its own
    (setup.setup, setup.probe_setup), and a Python caller's process keeps its own after opd.train or opd.admit."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def available_memory() -> int:
    """Bytes of memory this machine can still give (MemAvailable), or a large number when it cannot tell."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 50
