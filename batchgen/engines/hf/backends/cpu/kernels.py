"""batchgen's own CPU kernels (`kernels_*.c`), compiled on first use, for x86-64 CPUs with AVX2 and FMA
(AVX-512 ones included): the decode step between the GEMMs (attention over the slot KV cache, rotary
embedding and cache write, RMSNorm, SiLU-and-multiply; float32 arithmetic, inputs, outputs and cache in
float32 or bf16), and int8 and int4 weight-only GEMMs for few rows.

Decode attention: torch's batched matmuls read the cache of a grouped-query head through small GEMMs
(3 query rows each) and pad every row to a common width; the kernel reads each row's keys and values
once, over its own length only, with the softmax in between (step.py uses it for float32 models
on CPU). At batch 1 the torch operations between the GEMMs (norms, rotary embedding, cache writes,
activation) cost a few microseconds each, ~50 per layer; the decode-step kernels take four calls.

torch's `aten._weight_int8pack_mm` is vectorized for AVX-512 and ARM only; on an AVX2 CPU its generic
loop made an int8 decode step of one row no faster than bfloat16, although it reads half the bytes
(docs/engines.md "Quantization"). This kernel converts 8 int8 weights at a time to float and FMAs them with
float32 inputs, so a small batch runs at the rate the weights stream from memory. The int4 kernel does
the same from group-wise 4-bit weights laid out so that a shift and a mask unpack 8 of them.

Sources (SOURCES), one per family: `kernels_attention.c` (decode attention, rotary embedding and cache write),
`kernels_norms.c` (RMSNorm, SiLU-and-multiply), `kernels_int8.c`, `kernels_int4.c`, each written once against the
vector vocabulary of `kernels_simd.h` (8 and 16 float lanes). They are built together into one library per
instruction-set variant (ISAS): `avx2` (8-wide float vectors), `avx512` (AVX-512 F/BW/VL/DQ: 16-wide vectors in the
kernels where they paid), `avx512_bf16` (the same, built with AVX-512 BF16 allowed) and `avx512_amx` (the same, plus
the W8A8 GEMM on the AMX tile unit, `kernels_amx.c`; empty in the other variants). The variant is picked at
load time from the CPU's flags, the widest the CPU runs; `BATCHGEN_CPU_ISA=avx2` (or any narrower variant the CPU
supports) forces one, so that an AVX-512 machine also runs and tests the AVX2 kernels. Each variant is compiled
once per version of the sources, compiler flags and CPU model with the system C compiler (`$CC`, else `cc`) into a
cache directory (`$BATCHGEN_CACHE_DIR`, else `~/.cache/batchgen`), the ISA in its file name, written under a
temporary name and renamed, so concurrent jobs sharing the cache never load a half-written library. Where there is
no compiler, no AVX2/FMA (ARM, older x86), or `BATCHGEN_NATIVE_KERNELS=0`, `load()` returns None and the engine
uses torch's operations and int8 kernels, and torchao's int4 (logged once). The calls on tensors are ops.py's.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Optional

from batchgen.engines.hf.backends.cpu.runtime import cpu_flags, cpu_model
from batchgen.engines.hf.backends.cpu.signatures import declare  # noqa: F401 (the tests declare older builds through here)
from batchgen.fsutil import cache_home

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
# Compiled together into one library; the header is in the cache key as well (a change to either rebuilds).
SOURCES = tuple(HERE / f"kernels_{name}.c" for name in ("attention", "norms", "int8", "int4", "w8a8", "amx",
                                                             "vnni"))
HEADER = HERE / "kernels_simd.h"
# -ffp-contract=off: a * b + c stays two roundings unless a kernel asks for an FMA (rotary embedding matches torch)
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
# Variants, narrowest first: the /proc/cpuinfo flags each needs, and its compiler flags. The same sources for each:
# the 16-lane vocabulary and the code that uses it are under #ifdef BATCHGEN_AVX512 (kernels_simd.h).
ISAS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx2": (frozenset({"avx2", "fma"}), ("-mavx2", "-mfma")),
    "avx512": (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
               ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-DBATCHGEN_AVX512")),
    "avx512_bf16": (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
                    ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                     "-DBATCHGEN_AVX512", "-DBATCHGEN_AVX512_BF16")),
    # the W8A8 GEMM on the tile unit (kernels_amx.c); its intrinsics need GCC 11 or Clang 12 (else avx512_bf16 loads)
    "avx512_amx": (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile",
                              "amx_int8"}),
                   ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                    "-mamx-tile", "-mamx-int8", "-DBATCHGEN_AVX512", "-DBATCHGEN_AVX512_BF16", "-DBATCHGEN_AMX")),
}
ISA_ENV = "BATCHGEN_CPU_ISA"


def cache_dir() -> Path:
    return cache_home()


def supported_isas() -> list[str]:
    """The kernel variants this CPU runs, narrowest first; empty off x86-64 or without AVX2 and FMA."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    return [name for name, (needs, _) in ISAS.items() if needs <= flags]


def selected_isa() -> Optional[str]:
    """The variant to load: `$BATCHGEN_CPU_ISA` where this CPU supports it, else the widest it supports; None
    where none runs or the kernels are switched off (`BATCHGEN_NATIVE_KERNELS=0`)."""
    if os.environ.get("BATCHGEN_NATIVE_KERNELS", "1") == "0":
        return None
    return _select(os.environ.get(ISA_ENV, ""), tuple(supported_isas()))


@cache
def _select(forced: str, supported: tuple[str, ...]) -> Optional[str]:  # cached: a bad setting is logged once
    if forced and forced not in supported:
        known = ", ".join(ISAS)
        log.warning("%s=%s: %s; using %s", ISA_ENV, forced,
                    f"not supported by this CPU (it runs: {', '.join(supported) or 'none'})" if forced in ISAS
                    else f"unknown variant (known: {known})", supported[-1] if supported else "torch's kernels")
        forced = ""
    return forced or (supported[-1] if supported else None)


def wanted() -> bool:
    """An x86-64 CPU with AVX2 and FMA (AVX-512 ones included), and the kernels not switched off."""
    return selected_isa() is not None


def load(isa: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The compiled kernels of `isa` (default: selected_isa()), building them on first use; None where they cannot
    run here (logged)."""
    isa = isa or selected_isa()
    if isa is None or isa not in supported_isas():
        return None
    lib = _load(isa)
    if lib is None and isa == "avx512_amx":  # a compiler without the tile intrinsics: the variant below it
        return _load("avx512_bf16")
    return lib


def reset() -> None:
    """Forget the loaded libraries (tests: the cache directory or the environment changed)."""
    _load.cache_clear()
    _select.cache_clear()


def describe_cpu() -> str:
    """The CPU model, the flags that steer batchgen's kernels and dtypes, and the kernel variant loaded (benchmarks
    print it beside every figure)."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    flags = " ".join(f for f in wanted if f in cpu_flags()) or "none of avx2/avx512/amx"
    lib = load()
    isa = lib.batchgen_isa().decode() if lib is not None else "none (torch's kernels)"
    return f"cpu: {cpu_model() or 'unknown'}, {os.cpu_count()} CPUs; flags: {flags}; batchgen kernels: {isa}"


@cache
def _load(isa: str) -> Optional[ctypes.CDLL]:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler (cc or $CC) found: torch's decode attention and int8 kernels run (slower here)")
        return None
    try:
        target = cache_dir() / f"cpu_kernels-{isa}-{source_digest(ISAS[isa][1])}.so"
        if not target.exists():
            _compile(compiler, target, ISAS[isa][1])
        lib = declare(ctypes.CDLL(str(target)))
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("building batchgen's CPU kernels failed (%s): torch's decode attention and int8 kernels run "
                    "(slower here)", detail)
        return None
    log.info("batchgen's CPU kernels loaded (%s, %s variant): float32 decode steps (attention, rotary embedding, "
             "RMSNorm, SiLU), int8 and int4 GEMMs for small batches", target.name, lib.batchgen_isa().decode())
    return lib


def source_digest(isa_flags: tuple[str, ...]) -> str:
    """The cache key of a build: every source and the header (names and bytes), the compiler flags, the CPU model."""
    sha = hashlib.sha256()
    for path in (*SOURCES, HEADER):
        sha.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    sha.update(" ".join(CFLAGS + isa_flags + LIBS).encode() + cpu_model().encode() + platform.machine().encode())
    return sha.hexdigest()[:16]


def _compile(compiler: str, target: Path, isa_flags: tuple[str, ...], sources: tuple[Path, ...] = SOURCES) -> None:
    """Build `sources` (default: SOURCES) with `isa_flags` into the library `target`, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, *isa_flags, *map(str, sources), *LIBS, "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: another process sees the old state or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
