"""The hf engine's token choice alone: `Sampler.pick` on random float32 logits, seeded sampled rows.

    python benchmarks/sampler.py                                   # batches 1, 8, 64; vocabularies 32000, 151936
    python benchmarks/sampler.py --batches 64 --vocab 151936 --steps 20 --json out.json

Each (batch, vocabulary) times `--steps` picks after two warm-up picks: every row sampled at temperature 0.8, top_p
0.95 (benchmarks/throughput.py --sampling's settings) from its own seed, the sampler built as the engine builds it on
the CPU (its backend's draw ops where the backend has them). Median ms a pick; the CPU named as every benchmark
names it. To compare two versions, run each from its own checkout in turn (same machine, same hour).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path.cwd() if (Path.cwd() / "batchgen").is_dir() else Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from batchgen.engines import prepare_process  # noqa: E402

prepare_process()


class Tokenizer:
    """What the sampler asks of a tokenizer when no row has a stop string or a constraint."""

    eos_token_id = 0

    def __len__(self) -> int:
        return 1


def sampler(vocab: int):
    import torch

    from batchgen.engines.hf import backends
    from batchgen.engines.hf.sampling.sampler import Sampler

    cpu = torch.device("cpu")
    ops = getattr(backends.for_device(cpu), "draw_ops", None)
    extra = {"ops": ops()} if ops is not None else {}
    return Sampler(Tokenizer(), {0}, cpu, vocab_size=vocab, **extra)


def time_picks(batch: int, vocab: int, steps: int) -> float:
    """Median ms a pick of `batch` sampled rows over `vocab` logits."""
    import torch

    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    params = SampleParams(max_new_tokens=10 ** 6, temperature=0.8, top_p=0.95, top_k=0, stop=(), ignore_eos=True)
    reqs = [Request(key=i, prompt_ids=[1, 2, 3], params=params, seed=1000 + i) for i in range(batch)]
    chooser = sampler(vocab)
    draws = [chooser.start(r) for r in reqs]
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch, vocab, generator=gen) * 3 for _ in range(4)]
    times = []
    for step in range(steps + 2):
        t = time.perf_counter()
        chooser.pick(logits[step % 4], reqs, draws)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--vocab", default="32000,151936")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    print(describe_cpu(), f"torch threads {torch.get_num_threads()}", flush=True)
    out = {}
    for vocab in map(int, args.vocab.split(",")):
        for batch in map(int, args.batches.split(",")):
            out[f"{batch}x{vocab}"] = ms = time_picks(batch, vocab, args.steps)
            print(f"pick [{batch}, {vocab}]: {ms:.2f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
