"""Process-wide settings that make torch fast on CPU: set once, when an engine starts on CPU.

glibc's malloc hands every allocation above 128 KiB to mmap and gives it back to the kernel on
free, so each large temporary of a forward pass (a prefill's activations are megabytes) is
page-faulted in afresh, every layer, every step. Raising the mmap and trim thresholds keeps freed
blocks in the heap for reuse, as tcmalloc or jemalloc would (vLLM's CPU build asks for tcmalloc
through LD_PRELOAD). Measured: an RMSNorm over a 1600-token prefill went from ~7-10 ms to ~1.2 ms.
The cost is that the process keeps its peak heap instead of returning it to the system; the engine
sets this after the model is loaded (and quantized), so the load's transient copies are returned.

OpenMP's waiting (set_openmp_defaults, before torch loads): a thread that finishes its share of a
parallel region either spins or sleeps until the next. Sleeping at once (OMP_WAIT_POLICY=PASSIVE)
makes every GEMM of a decode step pay a wake-up through the kernel, ~75 us on the virtual machines
measured, some 70 times a step; spinning forever (OpenMP's default) stalls when other work holds
the cores. The default here spins briefly (GOMP_SPINCOUNT) and lets cpu/threads.py take threads away
while other work holds the cores.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import MutableMapping
from functools import lru_cache
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # torch loads after set_openmp_defaults has run
    import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
KEEP_BYTES = 1 << 30
# Spin iterations before a waiting OpenMP thread sleeps: about 0.1-0.2 ms, longer than the gaps between a decode
# step's parallel regions. Measured on a 2-core Zen 5 EPYC, a 64-row decode step of the benchmark model: 26.0 ms
# with PASSIVE, 22.6 with 1000, 21.0 with 10000; at 1 row 10.2, 6.4, 6.1 ms (benchmarks/threads.py for a job).
SPIN_COUNT = "10000"


def _glibc(name: str):
    """A function of the C library (glibc's malloc_trim, mallopt), or None where it has none."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> bool:
    """Give the heap's free memory back to the system now (glibc malloc_trim): what loading and quantizing freed
    (a 0.5B model's int8 conversion left ~110 MB behind in the heap). False where not glibc."""
    trim = _glibc("malloc_trim")
    return bool(trim(0)) if trim is not None else False


MADV_PAGEOUT = 21  # Linux 5.4 and later: reclaim the pages now; a page written since it was mapped is kept


class CheckpointPages:
    """The process's mappings of regular files (from_pretrained maps a safetensors checkpoint copy-on-write and hands
    out views of it), read once from /proc/self/maps, and the pages of a dropped weight inside one reclaimed
    (`release`). Converting a model one layer at a time reads every weight once; each page read counts in the
    resident size until the whole file is unmapped at the end, so a 1 GB bf16 checkpoint quantized to 0.5 GB of int8
    peaked at both. MADV_PAGEOUT drops a clean page (read again from the file if anything touches it) and keeps one
    that was written, so no value can change whatever else views those bytes; on a kernel without it nothing is
    released."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split()
                    if (len(fields) == 6 and fields[5].startswith("/") and not fields[5].startswith("/dev/")
                            and fields[4] != "0"):
                        lo, hi = (int(v, 16) for v in fields[0].split("-"))
                        self.spans.append((lo, hi))
        except OSError:
            pass
        self.madvise = _glibc("madvise") if self.spans else None

    def release(self, tensor: Optional[torch.Tensor]) -> int:
        """Give back the whole pages of `tensor`'s bytes where they lie in one of the mappings; bytes released."""
        if self.madvise is None or tensor is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return 0
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(lo <= start and end <= hi for lo, hi in self.spans):
            return 0
        page = os.sysconf("SC_PAGE_SIZE")
        first, last = -(-start // page) * page, end // page * page
        if last <= first or self.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_PAGEOUT):
            return 0
        return last - first


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Raise glibc's mmap/trim thresholds so large freed blocks are reused (once a process); False where not glibc."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    log.debug("glibc malloc thresholds raised to %d bytes: %s", KEEP_BYTES, done)
    return done


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model, feature flags) of the first CPU in /proc/cpuinfo, read once; ("", {}) where unreadable. The model is
    its name with the family and model numbers where they are given: a virtual machine names a Zen 4 and a Zen 5
    EPYC alike ("AMD EPYC"), and what is cached per CPU model (kernels, the dtype calibration) must tell them apart."""
    fields: dict[str, str] = {}
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                elif key == "flags":
                    flags = value
                    break
    except OSError:
        pass
    model = fields.get("model name", "")
    if model and "cpu family" in fields and "model" in fields:
        model = f"{model} (family {fields['cpu family']}, model {fields['model']})"
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


def set_openmp_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """A short spin, then sleep, for OpenMP's waiting threads, unless the environment says otherwise (either
    variable set): read when torch loads OpenMP, so call it before. The CLI and the benchmarks call it."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def openmp_spins(environ: MutableMapping[str, str] = os.environ) -> bool:
    """True where OpenMP's waiting threads spin (a GOMP_SPINCOUNT above 0, ACTIVE, or OpenMP's default): then a
    thread's CPU time over a parallel step tells how much of its core it got (cpu/threads.py)."""
    count = environ.get("GOMP_SPINCOUNT", "").strip().lower()
    if count:  # libgomp reads a number, with an optional k/M/G/T suffix, or infinite
        digits = count.rstrip("kmgt")
        return count in ("infinite", "infinity") or (digits.isdigit() and int(digits) > 0)
    return environ.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE"
