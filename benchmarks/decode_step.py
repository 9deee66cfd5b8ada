"""Where a decode step's time goes: one batch of rows decoded by batchgen's stepper, unquantized against int8.

    python benchmarks/decode_step.py --shape qwen2.5-0.5b                  # none and int8, 64 rows, 3 rounds
    python benchmarks/decode_step.py --shape qwen2.5-0.5b --rows 1 --configs int8

Each configuration runs in its own subprocess (configurations interleaved, `--rounds` times); in it the engine loads
the model as a job does (engine.dtype=auto), prefills `--rows` prompts of 30 to 200 tokens, then times `--steps`
decode steps, each with its greedy pick (the stepper's own where it gives one, else the sampler's argmax kernel).
A second pass of the same steps times the parts: every W8A8 or bf16 GEMM by shape, and batchgen's kernels between
them (timers around each call: the parts add up to a little more than the step). The model is the one
benchmarks/quantization.py builds for the shape (run it once first).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from batchgen.engines import prepare_process  # noqa: E402

prepare_process()
QUANTIZATION = {"none": None, "int8": "int8", "int8_wo": "int8_wo", "int4": "int4"}
KERNELS = ("decode_layer_attention", "add_rms_norm", "add_rms_norm_u8", "silu_mul", "silu_mul_u8", "quantize_rows",
           "scale_rows_argmax", "argmax_rows")


def timed(parts: dict, key, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        name = key(*args) if callable(key) else key
        parts[name] += time.perf_counter() - t
        return out
    return wrapper


def instrument(parts: dict) -> None:
    """Timers around each GEMM (by its shape) and each of batchgen's kernels between them."""
    from batchgen.engines.hf.backends.cpu import kernels, onednn
    from batchgen.engines.hf.quant import w8a8

    for name in KERNELS:
        if hasattr(kernels, name):
            setattr(kernels, name, timed(parts, name, getattr(kernels, name)))
    w8a8.Int8DynamicLinear.matmul = timed(parts, lambda m, *_: f"int8 GEMM {m.in_features}x{m.out_features}",
                                          w8a8.Int8DynamicLinear.matmul)
    onednn.PackedLinear.forward = timed(parts, lambda m, *_: f"GEMM {m.in_features}x{m.out_features}",
                                        onednn.PackedLinear.forward)


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.hf.backends.cpu import kernels
    from batchgen.engines.hf.engine import HFEngine
    from batchgen.engines.hf.step import LlamaStepper

    model = ROOT / ".bench" / f"model-{args.shape}"
    engine = HFEngine(HFConfig(model=str(model), device="cpu", quantization=QUANTIZATION[args.child]),
                      AutoTokenizer.from_pretrained(model))
    stepper = LlamaStepper(engine.model, engine.activation_dtype, engine.dtype)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(30, 200, (args.rows,), generator=gen).tolist()
    prompts = [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in lengths]
    parts: dict[str, float] = collections.defaultdict(float)

    def step(cache, tokens) -> None:
        logits, picks = stepper.decode_picks(cache, tokens)
        if picks is None:
            kernels.argmax_rows(kernels.load(), logits.float().contiguous())

    def run(cache) -> list[float]:
        times, tokens = [], torch.randint(100, 20000, (args.rows,), generator=gen)
        for _ in range(args.steps):
            t = time.perf_counter()
            step(cache, tokens)
            times.append(time.perf_counter() - t)
        return times

    with torch.inference_mode():
        caches = []
        for _ in range(2):
            cache = stepper.new_cache(args.rows, 200 + 2 * args.steps + 1)
            for i in range(0, args.rows, 8):
                stepper.prefill(cache, i, prompts[i:i + 8])
            caches.append(cache)
        times = run(caches[0])
        instrument(parts)
        run(caches[1])
    print(json.dumps({"step_ms": statistics.median(times) * 1e3, "describe": stepper.describe(),
                      "parts_ms": {k: v * 1e3 / args.steps for k, v in parts.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--configs", default="none,int8")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    configs = args.configs.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for _ in range(args.rounds):
        for config in configs:
            proc = subprocess.run([sys.executable, __file__, "--child", config, "--shape", args.shape, "--rows",
                                   str(args.rows), "--steps", str(args.steps)], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{config} failed:\n{proc.stderr[-3000:]}")
            runs[config].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(describe_cpu())
    print(f"{args.shape}, {args.rows} rows, {args.steps} steps, {args.rounds} rounds interleaved; medians")
    base = statistics.median(r["step_ms"] for r in runs[configs[0]])
    for config in configs:
        step = statistics.median(r["step_ms"] for r in runs[config])
        print(f"\n{config}: {step:.1f} ms a step ({base / step:.2f}x {configs[0]}); {runs[config][0]['describe']}")
        names = sorted(runs[config][0]["parts_ms"], key=lambda k: -runs[config][0]["parts_ms"][k])
        for name in names:
            print(f"  {name:32s} {statistics.median(r['parts_ms'].get(name, 0.0) for r in runs[config]):7.2f} ms")


if __name__ == "__main__":
    main()
