"""Process-wide settings that make torch fast on CPU: set once, when an engine starts on CPU.

glibc's malloc hands every allocation above 128 KiB to mmap and gives it back to the kernel on
free, so each large temporary of a forward pass (a prefill's activations are megabytes) is
page-faulted in afresh, every layer, every step. Raising the mmap and trim thresholds keeps freed
blocks in the heap for reuse, as tcmalloc or jemalloc would (vLLM's CPU build asks for tcmalloc
through LD_PRELOAD). Measured: an RMSNorm over a 1600-token prefill went from ~7-10 ms to ~1.2 ms.
The cost is that the process keeps its peak heap instead of returning it to the system; the engine
sets this after the model is loaded (and quantized), so the load's transient copies are returned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import lru_cache

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
KEEP_BYTES = 1 << 30
_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's mmap/trim thresholds so large freed blocks are reused; False where not glibc."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _done = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    log.debug("glibc malloc thresholds raised to %d bytes: %s", KEEP_BYTES, _done)
    return _done


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of the first CPU in /proc/cpuinfo, read once; ("", {}) where unreadable."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.partition(":")[2].strip()
                elif line.startswith("flags"):
                    flags = line.partition(":")[2]
                    break
    except OSError:
        pass
    return model, frozenset(flags.split())


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (avx2, avx512_bf16, amx_bf16, ...); empty where unreadable."""
    return _cpuinfo()[1]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is empty on Linux); "" where unreadable."""
    return _cpuinfo()[0]


def has_native_bf16() -> bool:
    """True where the CPU has native bf16 dot products (AVX-512 BF16 or AMX); elsewhere bf16 is emulated, slow.
    A flag, not a measurement: engine.dtype=auto asks cpu/calibration.py instead."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags
