"""batchgen's own int8 GEMMs against oneDNN's, on a Qwen2.5-0.5B-shaped model's linears.

    python benchmarks/int8_gemm.py                    # every shape, M = 1 4 16 64 256 1024, 5 rounds
    python benchmarks/int8_gemm.py --rows 1,64 --rounds 3

Times the W8A8 product of already quantized rows (uint8 = int8 + 128) by int8 weights, float32 out, times the
channel scales: oneDNN's `onednn::qlinear_pointwise` (what W8A8 ran on CPUs without AMX before) against batchgen's
GEMM that runs here (cpu/int8_gemm.py: the AVX-512 VNNI kernel, or the AMX one), and batchgen's W4A8 GEMM (int4
weights, group 64) where it runs. Shapes: qkv fused 896->1152, o 896->896, gate_up fused 896->9728, down 4864->896,
the LM head 896->151936. The variants run interleaved, each sample the mean of enough calls to last about 0.05 s;
figures are medians over the rounds, ratios medians of same-round ratios (oneDNN's time over the variant's: above 1
is faster than oneDNN). One weight per shape: at one row the smaller weights stay in the caches between calls (a
model's 24 layers stream from memory), so the LM head's row is the one that shows the memory-bound rate. Before
timing, batchgen's int8 output is checked equal to oneDNN's, bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from batchgen.engines import prepare_process  # noqa: E402

prepare_process()
SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896), "lm_head": (896, 151936)}


def timed(fn, arg, target: float = 0.05) -> float:
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < target or calls < 3:
        fn(arg)
        calls += 1
    return (time.perf_counter() - start) / calls


def variants(k: int, n: int, gen):
    import torch

    from batchgen.engines.hf.backends.cpu import int8_gemm
    from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
    from batchgen.engines.hf.quant import w4a8, w8a8

    lib = cpu_kernels.load()
    weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 50
    onednn = torch.ops.onednn.qlinear_prepack(weight, None)
    zero = torch.zeros(n, dtype=torch.int64)
    out = {"oneDNN": lambda q: w8a8._gemm(q, onednn, scale, zero)}
    which = int8_gemm.kernel(lib, n, k)
    if which is not None:
        packed, comp = int8_gemm.pack(weight)
        out[f"batchgen {which}"] = lambda q: int8_gemm.gemm(lib, which, q, packed, comp, scale)
    if w4a8.runs_here(lib):
        linear = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            linear.weight.normal_(0, 0.02, generator=gen)
        module = w4a8.Int4DynamicLinear(linear)
        out["batchgen W4A8"] = lambda q: module.matmul(w8a8.QuantizedRows(q, None))
    return out


def main() -> None:
    import torch

    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64,256,1024")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(describe_cpu(), f"; torch threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    print("| shape | M | oneDNN us | variant | us | x oneDNN |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        fns = variants(k, n, gen)
        for m in map(int, args.rows.split(",")):
            q = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.uint8)
            for label, fn in fns.items():
                if label.startswith("batchgen") and "W4A8" not in label:
                    assert torch.equal(fn(q), fns["oneDNN"](q)), (name, m, label)
            samples = {label: [] for label in fns}
            for _ in range(args.rounds):
                for label, fn in fns.items():
                    samples[label].append(timed(fn, q))
            base = statistics.median(samples["oneDNN"])
            for label in fns:
                if label == "oneDNN":
                    continue
                ratio = statistics.median(a / b for a, b in zip(samples["oneDNN"], samples[label]))
                print(f"| {name} | {m} | {base * 1e6:.1f} | {label} | {statistics.median(samples[label]) * 1e6:.1f} "
                      f"| {ratio:.2f} |")


if __name__ == "__main__":
    main()
