"""The cost of structured outputs: the hf engine's decode throughput with and without a JSON schema, same run.

    python benchmarks/constraints.py                  # 32 rows at batch 32, 64 new tokens, the benchmark model
    python benchmarks/constraints.py --backends       # also: xgrammar vs llguidance mask time (where installed)

Workload (seeded): the benchmark model's shape with a 32k-token vocabulary (125M parameters; the mask's cost grows
with the vocabulary), 32 prompts of about 50 tokens, decoded together (engine.max_batch_size=32). "free": no
constraint, EOS ignored, 64 new tokens. "schema": a JSON schema whose one string field has minLength 400, so that
every row is still inside the string after 64 tokens and both runs generate exactly the same number of tokens
(every token masked by the grammar, the cost this measures). One engine is loaded once; the two runs alternate
(A B A B ...), and the ratio is taken per repeat and as the ratio of medians. Printed beside the figures: the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SCHEMA = {"type": "object", "properties": {"summary": {"type": "string", "minLength": 400}}, "required": ["summary"],
          "additionalProperties": False}


def requests(tok, rows: int, new_tokens: int, seed: int, constraint):
    from batchgen.engines.toymodel import BENCH_WORDS
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    rng = random.Random(seed)
    params = SampleParams(max_new_tokens=new_tokens, temperature=0.0, top_p=1.0, top_k=0, stop=(),
                          ignore_eos=constraint is None, constraint=constraint)
    prompts = [" ".join(rng.choice(BENCH_WORDS) for _ in range(int(rng.lognormvariate(3.9, 0.3))))
               for _ in range(rows)]
    return [Request(key=k, prompt_ids=tok(p)["input_ids"], params=params, seed=None) for k, p in enumerate(prompts)]


def timed(engine, reqs) -> tuple[float, int]:
    start = time.perf_counter()
    results = engine.generate(reqs)
    return time.perf_counter() - start, sum(r.num_generated_tokens for r in results)


def backends(tok, rows: int, steps: int = 64) -> None:
    """Mask time per decode step for `rows` matchers of the schema, xgrammar vs llguidance (warm-up step excluded)."""
    import torch

    vocab = len(tok)
    out = []
    try:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        mask = xgr.allocate_token_bitmask(rows, vocab)
        fill = lambda m, b, i: m.fill_next_token_bitmask(b, i)  # noqa: E731
        out.append(("xgrammar", _mask_loop(matchers, mask, vocab, steps, fill, xgr.apply_token_bitmask_inplace,
                                           lambda m, t: m.accept_token(t), torch)))
    except ImportError:
        out.append(("xgrammar", None))
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        lltok = llguidance.hf.from_tokenizer(tok)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
        mask = lt.allocate_token_bitmask(rows, lltok.vocab_size)
        out.append(("llguidance", _mask_loop(matchers, mask, vocab, steps, lambda m, b, i: lt.fill_next_token_bitmask(
            m, b, i), lt.apply_token_bitmask_inplace, lambda m, t: m.consume_token(t), torch)))
    except ImportError:
        out.append(("llguidance", None))
    for name, ms in out:
        print(f"  {name}: " + ("not installed" if ms is None else f"{ms:.2f} ms per step to fill and apply {rows} "
                                                                   f"rows' masks"))


def _mask_loop(matchers, mask, vocab, steps, fill, apply, accept, torch) -> float:
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):
        logits = torch.randn(len(matchers), vocab, generator=gen)
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            fill(m, mask, i)
        apply(logits, mask)
        times.append(time.perf_counter() - start)
        for m, t in zip(matchers, logits.argmax(-1).tolist()):
            accept(m, t)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="bench", help="toymodel size [bench: the benchmark model]")
    parser.add_argument("--vocab", type=int, default=32000, help="tokenizer size [32000, a real model's order; "
                        "the benchmark words alone give about 400]")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--backends", action="store_true", help="also time xgrammar vs llguidance mask filling")
    parser.add_argument("--workdir", type=Path, default=ROOT / "data" / "bench")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from batchgen.constraints import Constraint
    from batchgen.engines import build_engine
    from batchgen.engines.base import EngineConfig
    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu
    from batchgen.engines.toymodel import cached_model

    args.workdir.mkdir(parents=True, exist_ok=True)
    model = cached_model(args.workdir, args.size, vocab=args.vocab)
    tok = AutoTokenizer.from_pretrained(model)
    engine = build_engine(EngineConfig(name="hf", model=str(model), dtype=args.dtype, max_batch_size=args.rows), tok)
    schema = Constraint("json_schema", json.dumps(SCHEMA, sort_keys=True))
    runs = {"free": requests(tok, args.rows, args.new_tokens, 0, None),
            "schema": requests(tok, args.rows, args.new_tokens, 0, schema)}
    print(f"CPU: {describe_cpu()}")
    print(f"engine: {engine.identity()}; {args.rows} rows at batch {args.rows}, {args.new_tokens} new tokens each, "
          f"{args.repeats} repeats, alternating")
    timed(engine, runs["free"])  # warm-up: kernels, caches, the grammar compiled once
    timed(engine, runs["schema"])
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name, reqs in runs.items():
            seconds, tokens = timed(engine, reqs)
            assert tokens == args.rows * args.new_tokens, f"{name}: {tokens} tokens, expected equal work"
            rates[name].append(tokens / seconds)
            print(f"  repeat {repeat + 1} {name}: {tokens / seconds:.1f} tok/s", flush=True)
    free, constrained = statistics.median(rates["free"]), statistics.median(rates["schema"])
    per = ", ".join(f"{1 - s / f:.1%}" for f, s in zip(rates["free"], rates["schema"]))
    print(f"\n| run | tok/s (median) |\n| --- | ---: |\n| free | {free:.1f} |\n| JSON schema | {constrained:.1f} |")
    print(f"overhead of the schema at batch {args.rows}: {1 - constrained / free:.1%} (per repeat: {per})")
    if args.backends:
        print(f"\nmask backends, the same schema, {args.rows} rows, vocabulary {len(tok)}:")
        backends(tok, args.rows)


if __name__ == "__main__":
    main()
