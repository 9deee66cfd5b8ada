"""Where a decode step's time goes: one batch of rows decoded by batchgen's stepper, unquantized against int8.

    python benchmarks/decode_step.py --shape qwen2.5-0.5b                  # none and int8, 64 rows, 3 rounds
    python benchmarks/decode_step.py --shape qwen2.5-0.5b --rows 1 --configs int8
    python benchmarks/decode_step.py --device cuda --shape llama-3.2-1b --rows 256 --configs none

Each configuration runs in its own subprocess (configurations interleaved, `--rounds` times); in it the engine loads
the model as a job does (engine.dtype=auto), prefills `--rows` prompts of 30 to 200 tokens, then times `--steps`
decode steps, each with its greedy pick (the stepper's own where it gives one, else the sampler's argmax kernel).
A second pass of the same steps times the parts: every W8A8 or bf16 GEMM by shape, and batchgen's kernels between
them (timers around each call: the parts add up to a little more than the step; on CPU only: on CUDA the calls
return before their kernels end). The model is the one benchmarks/quantization.py and benchmarks/throughput.py build
for the shape under .bench/ (built here if missing).

Each step is set against its memory-bandwidth bound: the bytes a step must read (the weights in their dtype, the
input embedding table only where the LM head shares it; the keys and values of every position the rows attend over,
every layer) over the bandwidth of a large copy measured on the device (`dst.copy_(src)`, synchronised; a memcpy on
CPU), reads and writes counted. "Z% of bound" is the bound over the step: how near the step comes to reading its
bytes at copy speed.
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
    from batchgen.engines.hf.backends.cpu import onednn, ops
    from batchgen.engines.hf.quant import w8a8

    for name in KERNELS:
        if hasattr(ops, name):
            setattr(ops, name, timed(parts, name, getattr(ops, name)))
    w8a8.Int8DynamicLinear.matmul = timed(parts, lambda m, *_: f"int8 GEMM {m.in_features}x{m.out_features}",
                                          w8a8.Int8DynamicLinear.matmul)
    onednn.PackedLinear.forward = timed(parts, lambda m, *_: f"GEMM {m.in_features}x{m.out_features}",
                                        onednn.PackedLinear.forward)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device) -> float:
    """Bytes a second a large copy on the device moves, reads and writes counted (best of 5, synchronised): on CUDA
    1 GiB device to device, on CPU 256 MiB, past the caches (a memcpy)."""
    import torch

    src = torch.ones((1 << 30) if device.type == "cuda" else (1 << 28), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):  # the first warms up
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() / min(times[1:])


def weight_bytes_read(model) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer in its dtype, each storage once (fused
    projections' slices share their GEMM's weight), the input embedding table left out unless the LM head shares it
    (a step reads only its rows' embeddings)."""
    from batchgen.engines.hf.quant import tensor_bytes

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    head_tensors = {id(t) for t in [*head.parameters(), *head.buffers()]} if head is not None else set()
    skip = {id(t) for t in [*embed.parameters(), *embed.buffers()] if id(t) not in head_tensors}
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in skip:
            continue
        try:  # views of one storage (fused projections' slices) count once
            key, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # mkldnn packed weights, tensor subclasses
            key, size = id(tensor), tensor_bytes(tensor)
        if key not in seen:
            seen.add(key)
            total += size
    return total


def kv_bytes_read(cache, rows: int) -> int:
    """Bytes of keys and values the next decode step's `rows` rows attend over (each row's positions and the one it
    appends), every layer."""
    per_position = cache.k.element_size() * cache.k.numel() // (cache.k.shape[1] * cache.k.shape[3])  # all layers
    return 2 * per_position * (sum(cache.host_lengths[:rows]) + rows)


def timed_steps(stepper, cache, rows: int, steps: int, vocab: int, gen) -> tuple[list[float], list[int]]:
    """`steps` decode steps of `rows` rows, each with its greedy pick: each step's seconds (synchronised), and the
    KV cache bytes it attended over."""
    import torch

    from batchgen.engines.hf.backends.cpu import kernels
    from batchgen.engines.hf.backends.cpu import ops as cpu_ops

    device = cache.k.device
    tokens = torch.randint(min(100, vocab // 2), min(20000, vocab), (rows,), generator=gen).to(device)
    times, kv = [], []
    for _ in range(steps):
        kv.append(kv_bytes_read(cache, rows))
        sync(device)
        t = time.perf_counter()
        logits, picks = stepper.decode_picks(cache, tokens)
        if picks is None and device.type == "cpu":
            cpu_ops.argmax_rows(kernels.load(), logits.float().contiguous())
        elif picks is None:
            logits.argmax(dim=-1)
        sync(device)
        times.append(time.perf_counter() - t)
    return times, kv


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.hf.engine import HFEngine

    model = ROOT / ".bench" / f"model-{args.shape}"
    engine = HFEngine(HFConfig(model=str(model), device=args.device, quantization=QUANTIZATION[args.child]),
                      AutoTokenizer.from_pretrained(model))
    stepper = engine.stepper  # the engine's own decode step on this device
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(30, 200, (args.rows,), generator=gen).tolist()
    prompts = [torch.randint(min(100, vocab // 2), min(20000, vocab), (n,), generator=gen).tolist() for n in lengths]
    parts: dict[str, float] = collections.defaultdict(float)
    cpu = torch.device(args.device).type == "cpu"
    with torch.inference_mode():
        caches = []
        for _ in range(2 if cpu else 1):  # the second for the parts' pass, on CPU
            cache = stepper.new_cache(args.rows, 200 + 2 * args.steps + 1)
            for i in range(0, args.rows, 8):
                stepper.prefill(cache, i, prompts[i:i + 8])
            caches.append(cache)
        times, kv = timed_steps(stepper, caches[0], args.rows, args.steps, vocab, gen)
        if cpu:
            instrument(parts)
            timed_steps(stepper, caches[1], args.rows, args.steps, vocab, gen)
    bandwidth, weights = copy_bandwidth(caches[0].k.device), weight_bytes_read(engine.model)
    print(json.dumps({"step_ms": statistics.median(times) * 1e3, "describe": stepper.describe(),
                      "bound_ms": (weights + statistics.median(kv)) / bandwidth * 1e3, "bandwidth": bandwidth,
                      "weight_bytes": weights, "kv_bytes": statistics.median(kv),
                      "parts_ms": {k: v * 1e3 / args.steps for k, v in parts.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--configs", default="none,int8")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    build(args.shape)
    configs = args.configs.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for _ in range(args.rounds):
        for config in configs:
            proc = subprocess.run([sys.executable, __file__, "--child", config, "--shape", args.shape, "--rows",
                                   str(args.rows), "--steps", str(args.steps), "--device", args.device],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{config} failed:\n{proc.stderr[-3000:]}")
            runs[config].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(describe_cpu() if args.device == "cpu" else describe_device(args.device))
    print(f"{args.shape}, {args.rows} rows, {args.steps} steps, {args.rounds} rounds interleaved; medians")
    base = statistics.median(r["step_ms"] for r in runs[configs[0]])
    for config in configs:
        step = statistics.median(r["step_ms"] for r in runs[config])
        print(f"\n{config}: {step:.1f} ms a step ({base / step:.2f}x {configs[0]}); {runs[config][0]['describe']}")
        print(bound_line(runs[config], step))
        names = sorted(runs[config][0]["parts_ms"], key=lambda k: -runs[config][0]["parts_ms"][k])
        for name in names:
            print(f"  {name:32s} {statistics.median(r['parts_ms'].get(name, 0.0) for r in runs[config]):7.2f} ms")


def bound_line(runs: list[dict], step: float) -> str:
    """"step X ms, bound Y ms (Z% of bound)" and what the bound is made of (medians over the rounds)."""
    bound = statistics.median(r["bound_ms"] for r in runs)
    bandwidth = statistics.median(r["bandwidth"] for r in runs)
    weights, kv = (statistics.median(r[k] for r in runs) / 1e6 for k in ("weight_bytes", "kv_bytes"))
    return (f"  step {step:.2f} ms, bound {bound:.2f} ms ({100 * bound / step:.0f}% of bound): {weights:.1f} MB of "
            f"weights + {kv:.1f} MB of keys and values read at {bandwidth / 1e9:.0f} GB/s (copy, reads and writes)")


def describe_device(device: str) -> str:
    import torch

    return f"{device}: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def build(shape: str) -> Path:
    """The shape's random-weight model under .bench/, as benchmarks/quantization.py builds it, if not there yet."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quantization import build as build_model

    return build_model(ROOT / ".bench", shape)


if __name__ == "__main__":
    main()
