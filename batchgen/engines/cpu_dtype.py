"""`engine.dtype=auto` on CPU, decided by measurement: the GEMM dtype that runs the decode step's weights faster.

A CPU flag says whether bf16 dot products exist (AVX-512 BF16, AMX), not whether torch's build uses them, nor
how they compare with float32 on this chip: emulated bf16 ran ~200x slower than float32 on an AVX2-only EPYC,
native bf16 ~2.7x faster on a Zen 4 EPYC. So the first engine on a CPU times one oneDNN-prepacked linear of
the working batch's shape in both dtypes, interleaved, and keeps the medians in the kernel cache directory
(`$BATCHGEN_CACHE_DIR`, else `~/.cache/batchgen`), keyed by CPU model, flags and torch version: later jobs
on the same kind of machine read the file (a few milliseconds) instead of measuring again. bfloat16 is taken
only where it is clearly faster (BF16_MIN_SPEEDUP): it costs precision. The choice and its figures are logged.
An explicit `engine.dtype` never comes here. Knows tensors and timing, not models.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engines import cpu_kernels, cpu_linear
from batchgen.engines.cpu_runtime import cpu_flags

log = logging.getLogger(__name__)
SHAPE = (64, 1024, 1024)  # rows (the CPU working batch), input and output features of the timed linear
PROBE = (16, 256, 256)  # timed first: an emulated bf16 shows itself here in milliseconds, not seconds
BF16_MIN_SPEEDUP = 1.25  # bf16 must run the linear at least this much faster than float32 to be chosen
REPEATS = 7  # samples per dtype, alternating
CALLS = 5  # calls per sample (one call of SHAPE takes ~0.3-1 ms where bf16 or float32 is native)


def fastest_dtype() -> torch.dtype:
    """torch.bfloat16 or torch.float32 for a CPU engine with engine.dtype=auto (measured once per CPU kind)."""
    figures = calibration()
    choice = torch.bfloat16 if figures["speedup"] >= BF16_MIN_SPEEDUP else torch.float32
    log.info("engine.dtype=auto on %s: %s (a %dx%dx%d linear took %.3f ms in float32, %.3f ms in bfloat16: "
             "bf16 %.2fx; chosen at >= %.2fx; %s)", figures["cpu"] or "this CPU", str(choice).removeprefix("torch."),
             *SHAPE, 1e3 * figures["float32_s"], 1e3 * figures["bfloat16_s"], figures["speedup"], BF16_MIN_SPEEDUP,
             figures["source"])
    return choice


def calibration() -> dict:
    """The cached figures for this CPU kind, measuring them first where there are none."""
    path = cache_path()
    try:
        figures = json.loads(path.read_text())
        figures["source"] = f"cached in {path.name}"
        return figures
    except (OSError, ValueError):
        pass
    figures = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(figures))
        os.replace(tmp, path)  # atomic: a concurrent job reads the old state or the whole file
    except OSError as exc:
        log.debug("dtype calibration not cached (%s)", exc)
    figures["source"] = "measured now"
    return figures


def cache_path():
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))))
    key = f"{cpu_kernels.cpu_model()}|{flags}|{torch.__version__}"
    return cpu_kernels.cache_dir() / f"dtype-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measure() -> dict:
    """Median seconds of one linear of SHAPE in float32 and in bfloat16, timed alternately."""
    probe = {dtype: _time(_linear(PROBE, dtype), 3) for dtype in (torch.float32, torch.bfloat16)}
    result = {"cpu": cpu_kernels.cpu_model(), "torch": torch.__version__, "shape": list(SHAPE)}
    if probe[torch.bfloat16] > 2 * probe[torch.float32]:  # emulated bf16: the full shape would take seconds
        scale = probe[torch.float32] / probe[torch.bfloat16]
        return result | {"float32_s": probe[torch.float32], "bfloat16_s": probe[torch.bfloat16], "speedup": scale,
                         "note": f"probe shape {PROBE} only: bf16 is emulated here"}
    runs = {dtype: _linear(SHAPE, dtype) for dtype in (torch.float32, torch.bfloat16)}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in runs}
    for _ in range(REPEATS):
        for dtype, run in runs.items():
            times[dtype].append(_time(run, CALLS))
    f32, bf16 = statistics.median(times[torch.float32]), statistics.median(times[torch.bfloat16])
    return result | {"float32_s": f32, "bfloat16_s": bf16, "speedup": f32 / bf16}


def _linear(shape: tuple[int, int, int], dtype: torch.dtype):
    rows, k, n = shape
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(k, n, bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    module = cpu_linear.PackedLinear(linear) if cpu_linear.available(dtype) else linear
    return lambda: module(x) if module is not linear else F.linear(x, linear.weight)


@torch.inference_mode()
def _time(run, calls: int) -> float:
    """Seconds per call, over `calls` calls after a warm-up (oneDNN picks and caches its kernel on the first)."""
    run()
    t = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - t) / calls
