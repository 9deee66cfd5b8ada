"""`engine.dtype=auto` on CPU, decided by measurement: the GEMM dtype that runs the decode step's weights faster.

A CPU flag says whether bf16 dot products exist (AVX-512 BF16, AMX), not whether torch's build uses them, nor
how they compare with float32 on this chip, nor for which matrix sizes: emulated bf16 ran ~200x slower than
float32 on an AVX2-only EPYC, native bf16 ~2.7x faster on a Zen 4 EPYC for large GEMMs, and for a tiny model's
64-wide linears oneDNN's bf16 call costs more than it saves. So the first engine on a CPU times one linear of
the model's shape (the working batch of rows, hidden size in, intermediate size out; prepacked for oneDNN
where the engine would prepack it) in both dtypes, interleaved, and keeps the fastest samples in the kernel cache
directory (`$BATCHGEN_CACHE_DIR`, else `~/.cache/batchgen`), keyed by CPU model, flags, torch version and
shape: later jobs read the file (a few milliseconds) instead of measuring again. bfloat16 is taken
only where it is clearly faster (BF16_MIN_SPEEDUP): it costs precision. The choice and its figures are logged.
An explicit `engine.dtype` never comes here. Knows tensors and timing, not models.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.backends.cpu import onednn
from batchgen.engines.hf.backends.cpu.runtime import cpu_flags, cpu_model

log = logging.getLogger(__name__)
ROWS = 64  # rows of the timed linear: the CPU working batch
DEFAULT_FEATURES = (1024, 1024)  # input and output features where the model's are unknown
MAX_FEATURES = 4096  # a side is timed at most this wide: a 70B model's 8192x28672 linear would cost seconds and
# ~1.4 GB to time, and the bf16/float32 ratio no longer moves with size there
PROBE = (16, 256, 256)  # timed first: an emulated bf16 shows itself here in milliseconds, not seconds
BF16_MIN_SPEEDUP = 1.25  # bf16 must run the linear at least this much faster than float32 to be chosen
REPEATS = 7  # samples per dtype, alternating
CALLS = 5  # calls per sample (a 64x1024x1024 call takes ~0.3-1 ms where bf16 or float32 is native)


def fastest_dtype(features: tuple[int, int] = DEFAULT_FEATURES) -> torch.dtype:
    """torch.bfloat16 or torch.float32 for a CPU engine with engine.dtype=auto whose linears are about `features`
    (in, out) wide (measured once per CPU kind and shape)."""
    if min(features) < onednn.MIN_FEATURES:  # not prepacked: bf16 would be a cast around each small GEMM
        log.info("engine.dtype=auto: float32 (the model's linears, %s, are under %d features: not prepacked for "
                 "oneDNN, so bf16 cannot pay)", "x".join(map(str, features)), onednn.MIN_FEATURES)
        return torch.float32
    figures = calibration(features)
    choice = torch.bfloat16 if figures["speedup"] >= BF16_MIN_SPEEDUP else torch.float32
    log.info("engine.dtype=auto on %s: %s (a %s linear took %.3f ms in float32, %.3f ms in bfloat16: bf16 %.2fx; "
             "chosen at >= %.2fx; %s)", figures["cpu"] or "this CPU", str(choice).removeprefix("torch."),
             "x".join(map(str, figures["shape"])), 1e3 * figures["float32_s"], 1e3 * figures["bfloat16_s"],
             figures["speedup"], BF16_MIN_SPEEDUP, figures["source"])
    return choice


def model_features(config: object) -> tuple[int, int]:
    """(hidden size, intermediate size) of a transformers config, each at most MAX_FEATURES; the defaults where it
    has neither."""
    hidden = getattr(config, "hidden_size", None)
    inter = getattr(config, "intermediate_size", None) or (4 * hidden if isinstance(hidden, int) else None)
    if not (isinstance(hidden, int) and isinstance(inter, int)):
        return DEFAULT_FEATURES
    return min(hidden, MAX_FEATURES), min(inter, MAX_FEATURES)


def calibration(features: tuple[int, int] = DEFAULT_FEATURES) -> dict:
    """The cached figures for this CPU kind and shape, measuring them first where there are none."""
    path = cache_path(features)
    try:
        figures = json.loads(path.read_text())
        figures["source"] = f"cached in {path.name}"
        return figures
    except (OSError, ValueError):
        pass
    figures = measure(features)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(figures))
        os.replace(tmp, path)  # atomic: a concurrent job reads the old state or the whole file
    except OSError as exc:
        log.debug("dtype calibration not cached (%s)", exc)
    figures["source"] = "measured now"
    return figures


def cache_path(features: tuple[int, int]):
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))))
    key = f"{cpu_model()}|{flags}|{torch.__version__}|{features}"
    return cpu_kernels.cache_dir() / f"dtype-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measure(features: tuple[int, int] = DEFAULT_FEATURES) -> dict:
    """Seconds of one linear of (ROWS, *features) in float32 and in bfloat16, timed alternately: the fastest
    sample of each (on a shared machine a slow sample measures the neighbours, not the dtype)."""
    shape = (ROWS, *features)
    probe = {dtype: _time(_linear(PROBE, dtype), 3) for dtype in (torch.float32, torch.bfloat16)}
    result = {"cpu": cpu_model(), "torch": torch.__version__, "shape": list(shape)}
    if probe[torch.bfloat16] > 2 * probe[torch.float32]:  # emulated bf16: the full shape would take seconds
        scale = probe[torch.float32] / probe[torch.bfloat16]
        return result | {"float32_s": probe[torch.float32], "bfloat16_s": probe[torch.bfloat16], "speedup": scale,
                         "shape": list(PROBE), "note": "the probe only: bf16 is emulated here"}
    runs = {dtype: _linear(shape, dtype) for dtype in (torch.float32, torch.bfloat16)}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in runs}
    for _ in range(REPEATS):
        for dtype, run in runs.items():
            times[dtype].append(_time(run, CALLS))
    f32, bf16 = min(times[torch.float32]), min(times[torch.bfloat16])  # the least disturbed sample of each
    return result | {"float32_s": f32, "bfloat16_s": bf16, "speedup": f32 / bf16}


def _linear(shape: tuple[int, int, int], dtype: torch.dtype):
    rows, k, n = shape
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(k, n, bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    packed = onednn.pack(linear) if onednn.available(dtype) else None  # as the engine would prepack it
    return (lambda: packed(x)) if packed is not None else (lambda: F.linear(x, linear.weight))


@torch.inference_mode()
def _time(run, calls: int) -> float:
    """Seconds per call, over `calls` calls after a warm-up (oneDNN picks and caches its kernel on the first)."""
    run()
    t = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - t) / calls
