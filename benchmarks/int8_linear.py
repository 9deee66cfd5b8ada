"""int8 GEMM paths reachable from torch on CPU, against float32 and bfloat16, on a Qwen2.5-0.5B-shaped model's linears.

    python benchmarks/int8_linear.py            # full: all shapes (LM head included), 2 and 1 threads, 9 rounds
    python benchmarks/int8_linear.py --quick    # short: the decoder layer's shapes only, 2 threads, 3 rounds
    python benchmarks/int8_linear.py --shapes qkv,o,gate_up,down --copies 12 --rounds 7   # weights past the L3

Times y = x @ W^T (no bias) for the linears of a Qwen2.5-0.5B-shaped model (hidden 896, intermediate 4864,
14 query heads and 2 kv heads of 64): qkv fused 896->1152, o 896->896, gate_up fused 896->9728, down 4864->896
and the LM head 896->151936, at M = 1 and M = 64 rows (one row decoding, and the engine's working batch).
The paths (each is checked to exist in this torch build; one that fails to build is reported and skipped):

  fp32           torch.nn.functional.linear, float32 (MKL / oneDNN)
  bf16           the same in bfloat16 (activations and weights bf16; native where the CPU has avx512_bf16 or
                 AMX, emulated otherwise: the header says which)
  dyn-x86        torch.ao.nn.quantized.dynamic.Linear (quantize_dynamic with per-channel int8 weights), under
  dyn-fbgemm     torch.backends.quantized.engine = x86 / fbgemm / onednn / qnnpack (those this build lists).
  dyn-onednn     The module quantizes activations per tensor (asymmetric uint8, the range found per call) and
  dyn-qnnpack    calls quantized::linear_dynamic with reduce_range=True (7-bit activations on x86)
  dyn-fbgemm-8b  quantized::linear_dynamic on the fbgemm packed weight with reduce_range=False (8-bit activations)
  int_mm-tok     per-token symmetric int8 activations (quantized in torch ops, timed), torch._int_mm
                 (int8 x int8 -> int32), then the int32 result scaled by the row and column scales to float32
  qlinear-tok    per-token symmetric int8 activations, stored as uint8 with zero point 128 (exact; int8
                 activations take a reference kernel here, seconds per call), onednn::qlinear_pointwise on a
                 weight prepacked by onednn::qlinear_prepack (int32 accumulation, weight scales applied inside,
                 float32 out), then the rows scaled by the token scales
  int8pack-wo    aten._weight_int8pack_mm: weight-only int8 (float32 activations, int8 weights converted to
                 float in the kernel), a reference: it does not compute in int8; timed at M = 1 only

Variants run interleaved (every variant once per round, in turn) after a warm-up; each sample is the mean of
enough calls to last about --target seconds; the figures are medians over the rounds. Speed ratios are medians of
same-round ratios: 'x fp32' = t(fp32) / t(variant), so above 1 is faster than float32; 'x bf16' likewise. The
'layer' columns sum the four decoder-layer shapes per round (one decoder layer's linears); 'lm_head' is the LM head.

With --copies N each shape gets N independent weights and the calls cycle over them: with one (the default) a
shape's weights stay in the caches between calls when they fit (int8 gate_up is 8.7 MB, a 32 MB L3 holds it, float32
does not), which flatters the smaller formats at M = 1 where a model's 24 layers would stream from memory; the LM
head (136 MB in int8) never fits. Accuracy is measured on the first copy.

Accuracy, against the float32 result, at M = 64, on two inputs: 'gauss' (x ~ N(0, 1)) and 'hot token' (the same
with row 0 multiplied by 20, as a massive-activation token such as the first one: a per-tensor activation scale
then follows that row, and the other rows lose precision). Weights ~ N(0, 0.02). Per output row: max abs error /
max abs of the reference row, and cosine similarity; the table gives the worst row over the rows and the group's
shapes (relerr: the largest, cos: the smallest).

The CPU model and flags come from /proc/cpuinfo; torch's own dispatch (the capability line) comes from CPUID, so a
tool that narrows /proc/cpuinfo changes the flags printed here but not the kernels the libraries pick.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # batchgen's OpenMP defaults (short spin, then sleep)
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896), "lm_head": (896, 151936)}
GROUPS = {"layer": ("qkv", "o", "gate_up", "down"), "lm_head": ("lm_head",)}
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
         "amx_int8", "amx_bf16")
ROWS = (1, 64)
FULL = dict(shapes=tuple(SHAPES), threads=(2, 1), rounds=9, target=0.05, copies=1)
QUICK = dict(shapes=GROUPS["layer"], threads=(2,), rounds=3, target=0.01, copies=1)


# -- the machine ----------------------------------------------------------------------------------

def cpu_info() -> tuple[str, str, list[str]]:
    """(model name, 'family F model M', flags) from /proc/cpuinfo."""
    name, fam, model, flags = platform.processor() or "?", "?", "?", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    name = value
                elif key == "cpu family":
                    fam = value
                elif key == "model":
                    model = value
                elif key == "flags":
                    flags = value.split()
                    break
    except OSError:
        pass
    return name, f"family {fam} model {model}", flags


def header() -> dict:
    name, fm, flags = cpu_info()
    have = [f for f in FLAGS if f in flags]
    native_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    print(f"CPU: {name} ({fm}), {os.cpu_count()} logical CPUs")
    print(f"flags: {' '.join(have) or '-'}; absent: {' '.join(f for f in FLAGS if f not in flags) or '-'}")
    print(f"torch {torch.__version__}; capability (CPUID): {torch.backends.cpu.get_cpu_capability()}; "
          f"quantized engines: {', '.join(torch.backends.quantized.supported_engines)}")
    print(f"bf16 linear: {'native (avx512_bf16/amx)' if native_bf16 else 'EMULATED (no avx512_bf16, no amx)'}; "
          f"torch._int_mm: {hasattr(torch, '_int_mm')}; aten._weight_int8pack_mm (weight-only): "
          f"{hasattr(torch.ops.aten, '_weight_int8pack_mm')}; onednn::qlinear_pointwise: "
          f"{hasattr(torch.ops.onednn, 'qlinear_pointwise')}")
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return {"native_bf16": native_bf16}


# -- the paths ------------------------------------------------------------------------------------

def quant_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (token for activations, output channel for weights): (int8, float32 scales (R, 1))."""
    scale = t.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(t / scale).clamp(-127, 127).to(torch.int8), scale


def dynamic_module(w: torch.Tensor, engine: str) -> torch.nn.Module:
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    torch.backends.quantized.engine = engine
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    model = quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear: per_channel_dynamic_qconfig},
                             dtype=torch.qint8)
    return model[0]


def add_dynamic(add: Callable, w: torch.Tensor, rows: tuple[int, ...]) -> None:
    engines = torch.backends.quantized.supported_engines
    for engine in ("x86", "fbgemm", "onednn", "qnnpack"):
        if engine in engines:
            add(f"dyn-{engine}", engine, lambda e=engine: dict.fromkeys(rows, dynamic_module(w, e)))
    if "fbgemm" in engines:
        def fbgemm_8bit() -> dict:
            packed = dynamic_module(w, "fbgemm")._packed_params._packed_params
            return dict.fromkeys(rows, lambda x: torch.ops.quantized.linear_dynamic(x, packed, False))
        add("dyn-fbgemm-8b", "fbgemm", fbgemm_8bit)


def add_int8(add: Callable, w: torch.Tensor, rows: tuple[int, ...]) -> None:
    wq, ws = quant_rows(w)  # (N, K) int8, (N, 1)
    if hasattr(torch, "_int_mm"):
        wqt, wst = wq.t(), ws.t().contiguous()  # (K, N) column-major view: oneDNN takes it as a transposed B

        def int_mm(x: torch.Tensor) -> torch.Tensor:
            xq, xs = quant_rows(x)
            return torch._int_mm(xq, wqt).to(torch.float32).mul_(xs * wst)
        add("int_mm-tok", None, lambda: dict.fromkeys(rows, int_mm))
    if hasattr(torch.ops.onednn, "qlinear_prepack"):
        wsc, wzp = ws.flatten(), torch.zeros(w.shape[0], dtype=torch.int64)

        def qlinear() -> dict:  # uint8 activations: int8 ones take a reference kernel here (seconds per call)
            fns = {}
            for m in rows:
                packed = torch.ops.onednn.qlinear_prepack(wq, [m, w.shape[1]])

                def fn(x: torch.Tensor, packed=packed) -> torch.Tensor:
                    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
                    xu = torch.round(x / scale).clamp_(-127, 127).add_(128).to(torch.uint8)  # zero point 128: exact
                    y = torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, packed, wsc, wzp, None, 1.0, 0,
                                                           torch.float32, "none", [], "")
                    return y.mul_(scale)
                fns[m] = fn
            return fns
        add("qlinear-tok", None, qlinear)
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):  # M = 1 only: at 64 rows it takes seconds on the LM head
        wsf = ws.flatten()
        add("int8pack-wo", None, lambda: {1: lambda x: torch.ops.aten._weight_int8pack_mm(x, wq, wsf)})


def build_variants(w: torch.Tensor, rows: tuple[int, ...]) -> tuple[dict, dict]:
    """name: (engine or None, {M: fn(x) -> y}) for the paths that build here; name: reason for those that do not."""
    out, skipped = {}, {}

    def add(name: str, engine: Optional[str], make: Callable[[], dict]) -> None:
        try:
            out[name] = (engine, make())
        except Exception as e:  # a path this build or CPU lacks: reported, not fatal
            skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"

    out["fp32"] = (None, {m: (lambda x: F.linear(x, w)) for m in rows})
    wb = w.to(torch.bfloat16)
    add("bf16", None, lambda: {m: (lambda x: F.linear(x, wb)) for m in rows})
    add_dynamic(add, w, rows)
    add_int8(add, w, rows)
    return out, skipped


def cycled(copies: list[dict]) -> dict:
    """One variant set whose every call takes the next copy's weights (a working set the copies' size)."""
    out = {}
    for name, (engine, fns) in copies[0].items():
        out[name] = (engine, {m: cycle_fn([c[name][1][m] for c in copies if name in c]) for m in fns})
    return out


def cycle_fn(fns: list[Callable]) -> Callable:
    turn = itertools.cycle(fns)
    return lambda x: next(turn)(x)


def x_for(name: str, x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16) if name == "bf16" else x


# -- accuracy -------------------------------------------------------------------------------------

def row_errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(worst row's max abs error / max abs of the reference row, worst row's cosine similarity)."""
    y = y.to(torch.float32)
    rel = ((y - ref).abs().amax(dim=1) / ref.abs().amax(dim=1).clamp(min=1e-30)).max().item()
    cos = F.cosine_similarity(y, ref, dim=1).min().item()
    return rel, cos


def accuracy(variants: dict, w: torch.Tensor, gen: torch.Generator) -> dict:
    """{input: {variant: (relerr, cos)}} at M = 64."""
    x = torch.randn(64, w.shape[1], generator=gen)
    hot = x.clone()
    hot[0] *= 20.0
    result = {}
    for label, inp in (("gauss", x), ("hot token", hot)):
        ref = F.linear(inp.double(), w.double()).float()
        result[label] = {}
        for name, (engine, fns) in variants.items():
            if engine:
                torch.backends.quantized.engine = engine
            if 64 in fns:
                result[label][name] = row_errors(fns[64](x_for(name, inp)), ref)
    return result


# -- timing ---------------------------------------------------------------------------------------

def time_calls(fn: Callable, x: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn(x)
    return (time.perf_counter() - t0) / n


def time_shape(variants: dict, k: int, m: int, rounds: int, target: float, gen: torch.Generator) -> dict:
    """{variant: [seconds per call, one per round]}, the variants interleaved."""
    x = torch.randn(m, k, generator=gen)
    variants = {name: v for name, v in variants.items() if m in v[1]}
    calls = {}
    for name, (engine, fns) in variants.items():  # warm-up and calibration
        if engine:
            torch.backends.quantized.engine = engine
        xi = x_for(name, x)
        time_calls(fns[m], xi, 2)
        calls[name] = max(1, min(1000, round(target / max(time_calls(fns[m], xi, 1), 1e-7))))
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (engine, fns) in variants.items():
            if engine:
                torch.backends.quantized.engine = engine
            samples[name].append(time_calls(fns[m], x_for(name, x), calls[name]))
    return samples


# -- report ---------------------------------------------------------------------------------------

def group_stats(samples: dict, shapes: tuple[str, ...], name: str, base: str) -> tuple[float, float]:
    """(median ms per call summed over the shapes, median of same-round ratios t(base) / t(name))."""
    rounds = len(samples[shapes[0]][name])
    tot = [sum(samples[s][name][r] for s in shapes) for r in range(rounds)]
    if base not in samples[shapes[0]]:
        return statistics.median(tot) * 1e3, float("nan")
    ref = [sum(samples[s][base][r] for s in shapes) for r in range(rounds)]
    return statistics.median(tot) * 1e3, statistics.median(b / t for b, t in zip(ref, tot))


def print_timing(threads: int, m: int, samples: dict, names: list[str]) -> None:
    shapes = [s for s in SHAPES if s in samples]
    groups = {g: tuple(s for s in members if s in samples) for g, members in GROUPS.items()}
    groups = {g: members for g, members in groups.items() if members}
    cols = [f"{s} ms" for s in shapes]
    for g in groups:
        cols += [f"{g} ms", f"{g} x fp32", f"{g} x bf16"]
    print(f"\n## threads {threads}, M = {m}: ms per call (median), speed vs fp32 and bf16 (above 1: faster)")
    print("| variant | " + " | ".join(cols) + " |")
    print("| --- | " + " | ".join("---:" for _ in cols) + " |")
    for name in names:
        if name not in samples[shapes[0]]:
            continue
        cells = [f"{statistics.median(samples[s][name]) * 1e3:.3f}" for s in shapes]
        for members in groups.values():
            ms, x32 = group_stats(samples, members, name, "fp32")
            _, x16 = group_stats(samples, members, name, "bf16")
            cells += [f"{ms:.3f}", f"{x32:.2f}", f"{x16:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def print_accuracy(acc: dict, names: list[str]) -> None:
    groups = {g: [s for s in members if s in acc] for g, members in GROUPS.items()}
    groups = {g: members for g, members in groups.items() if members}
    inputs = ("gauss", "hot token")
    cols = [f"{g} {i} {what}" for i in inputs for g in groups for what in ("relerr", "cos")]
    print("\n## accuracy vs float32 at M = 64 (worst row: max abs err / max abs ref, cosine)")
    print("| variant | " + " | ".join(cols) + " |")
    print("| --- | " + " | ".join("---:" for _ in cols) + " |")
    for name in names:
        cells = []
        for i in inputs:
            for members in groups.values():
                pairs = [acc[s][i][name] for s in members if name in acc[s][i]]
                if not pairs:
                    cells += ["-", "-"]
                    continue
                cells += [f"{max(p[0] for p in pairs):.2e}", f"{min(p[1] for p in pairs):.6f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run: the decoder layer's shapes (no LM head), "
                    "2 threads, 3 rounds, ~10 ms samples")
    ap.add_argument("--shapes", help=f"comma-separated subset of {','.join(SHAPES)} (default: all; --quick: the "
                    "layer's)")
    ap.add_argument("--threads", help="comma-separated torch thread counts (default 2,1; --quick: 2)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per configuration (default 9; --quick: 3)")
    ap.add_argument("--target", type=float, help="seconds per sample, calls averaged (default 0.05; --quick: 0.01)")
    ap.add_argument("--copies", type=int, help="independent weight copies per shape, the calls cycling over them "
                    "(default 1: one weight, which stays in cache when it fits; 12 puts the layer's int8 weights "
                    "past a 32 MB L3, as a model's 24 layers are)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    plan = dict(QUICK if args.quick else FULL)
    if args.shapes:
        plan["shapes"] = tuple(s for s in args.shapes.split(",") if s)
        unknown = [s for s in plan["shapes"] if s not in SHAPES]
        if unknown:
            ap.error(f"unknown shapes {unknown}; known: {list(SHAPES)}")
    if args.threads:
        plan["threads"] = tuple(int(t) for t in args.threads.split(","))
    plan["rounds"] = args.rounds or plan["rounds"]
    plan["target"] = args.target or plan["target"]
    plan["copies"] = args.copies or plan["copies"]
    header()
    print(f"plan: shapes {','.join(plan['shapes'])}; M {ROWS}; threads {plan['threads']}; rounds {plan['rounds']}; "
          f"~{plan['target'] * 1e3:.0f} ms per sample; {plan['copies']} weight copies per shape")
    gen = torch.Generator().manual_seed(args.seed)
    timings = {(t, m): {} for t in plan["threads"] for m in ROWS}  # (threads, M): {shape: {variant: [s]}}
    acc, names, skipped = {}, [], {}
    t_start = time.perf_counter()
    torch.set_num_threads(max(plan["threads"]))
    with torch.no_grad():
        for shape in plan["shapes"]:
            k, n = SHAPES[shape]
            w = torch.randn(n, k, generator=gen) * 0.02
            variants, skip = build_variants(w, ROWS)
            skipped.update(skip)
            acc[shape] = accuracy(variants, w, gen)
            if plan["copies"] > 1:  # the calls cycle over independent weights, as a model's layers do
                variants = cycled([variants] + [build_variants(torch.randn(n, k, generator=gen) * 0.02, ROWS)[0]
                                                for _ in range(plan["copies"] - 1)])
            names += [v for v in variants if v not in names]
            for threads in plan["threads"]:
                torch.set_num_threads(threads)
                for m in ROWS:
                    timings[(threads, m)][shape] = time_shape(variants, k, m, plan["rounds"], plan["target"], gen)
            print(f"  {shape} {k}->{n} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
            del variants, w
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    for (threads, m), samples in timings.items():
        print_timing(threads, m, samples, names)
    print_accuracy(acc, names)
    print(f"\nload average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
          f"{time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
