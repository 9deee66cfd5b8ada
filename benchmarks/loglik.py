"""task=loglik against Hugging Face's own forward in fixed batches of 16: rows per second, same run.

    python benchmarks/loglik.py                      # the benchmark model, 256 rows
    python benchmarks/loglik.py --shape qwen2.5-0.5b --rows 128

Workload (seeded): `--rows` texts of lognormal length (median about 120 tokens, some past 400), each scored whole
(every token after the first). "batchgen": the hf engine's loglik path alone (engine.generate over the requests:
longest first in groups within engine.max_batch_tokens, the Llama-family step's prefill, the LM head over the scored
positions only). "hf": AutoModelForCausalLM's forward on the same token ids in input order, batches of 16 right-
padded with an attention mask, log-softmax over the logits, the scored tokens gathered: what a script would do.
Both in float32 (`--dtype`), same weights, same threads. The two alternate (A B A B ...); the ratio is batchgen's
rows/s over hf's, per repeat and as the median. Printed beside the figures: the CPU, and the largest difference
between the two's per-row log-likelihoods.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def texts(rows: int, seed: int = 3) -> list[str]:
    from batchgen.engines.toymodel import BENCH_WORDS

    rng = random.Random(seed)
    return [" ".join(rng.choice(BENCH_WORDS) for _ in range(max(4, int(rng.lognormvariate(4.6, 0.6)))))
            for _ in range(rows)]


def hf_forward(model, ids: list[list[int]], batch: int = 16) -> list[float]:
    import torch

    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), batch):
            group = ids[start:start + batch]
            width = max(map(len, group))
            x = torch.zeros((len(group), width), dtype=torch.long)
            mask = torch.zeros_like(x)
            for r, seq in enumerate(group):
                x[r, :len(seq)] = torch.tensor(seq)
                mask[r, :len(seq)] = 1
            logp = torch.log_softmax(model(input_ids=x, attention_mask=mask).logits.float(), dim=-1)
            picked = logp[:, :-1].gather(2, x[:, 1:, None])[..., 0] * mask[:, 1:]
            out += picked.double().sum(dim=1).tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="bench")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchgen.engines import build_engine
    from batchgen.engines.hf.backends.cpu import runtime
    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu
    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.toymodel import cached_model
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    runtime.keep_freed_memory()
    model_dir = str(cached_model(ROOT / ".bench", args.shape))
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(t)["input_ids"] for t in texts(args.rows)]
    params = SampleParams(max_new_tokens=0, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=False,
                          score_from=1)
    reqs = [Request(key=k, prompt_ids=seq, params=params, seed=None) for k, seq in enumerate(ids)]
    engine = build_engine(HFConfig(model=model_dir, dtype=args.dtype), tok)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    engine.generate(reqs[:8])  # warm both
    hf_forward(hf, ids[:8])
    ours, theirs, diff = [], [], 0.0
    for _ in range(args.repeats):
        start = time.perf_counter()
        results = engine.generate(reqs)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        reference = hf_forward(hf, ids)
        theirs.append(time.perf_counter() - start)
        diff = max(diff, max(abs(r.loglik[0] - x) for r, x in zip(results, reference)))
    ratios = [t / o for o, t in zip(ours, theirs)]
    tokens = sum(map(len, ids))
    print(describe_cpu())
    print(f"{args.shape}, {args.dtype}, {args.rows} rows, {tokens} tokens (median {statistics.median(map(len, ids))}, "
          f"longest {max(map(len, ids))}); largest |loglik difference| {diff:.2e}")
    print("batchgen rows/s: " + ", ".join(f"{args.rows / s:.1f}" for s in ours))
    print("hf (batches of 16) rows/s: " + ", ".join(f"{args.rows / s:.1f}" for s in theirs))
    print("batchgen / hf: " + ", ".join(f"{r:.2f}" for r in ratios) + f"; median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
