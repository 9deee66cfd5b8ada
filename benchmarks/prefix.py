"""Shared prefixes computed once: batchgen's hf engine with and without its prefix cache, and vLLM CPU with its
automatic prefix caching, on an annotation-style workload, side by side.

    python benchmarks/prefix.py                    # 128 rows, a 600-token shared prefix, the benchmark model
    python benchmarks/prefix.py --no-vllm          # hf only

Workload (seeded): every row is one 600-token instruction block followed by its own text (log-normal around 50
tokens), 32 new tokens each, EOS ignored; the benchmark model of benchmarks/throughput.py (76M parameters). Each
run is a real batchgen job through the CLI in its own process, interleaved and repeated; generation time excludes
start-up and model load (reported apart). Printed per run: generation time, the ratio to E without the cache, and
the prompt tokens the engine computed (hf: prefill tokens from the job's status; vLLM does not report its cache
hits to batchgen, so its figure is the prompt tokens it was given).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the river town market opened closed with many people after rain sun night lamp bread clock train "
         "harbour music quiet loud green blue small large old new fast slow city field stone road").split()


def build(workdir: Path, rows: int, prefix_tokens: int, seed: int) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from batchgen.engines.toymodel import cached_model

    model = cached_model(workdir, "bench", seed)
    data = workdir / f"prefix-{rows}-{prefix_tokens}-{seed}.parquet"
    if not data.exists():
        tok = AutoTokenizer.from_pretrained(model)
        rng = random.Random(seed)
        words = [rng.choice(WORDS) for _ in range(prefix_tokens * 2)]
        while len(tok(" ".join(words)).input_ids) > prefix_tokens:
            words.pop()
        head = "Instructions: " + " ".join(words)
        texts = []
        for _ in range(rows):
            own = max(1, int(rng.lognormvariate(3.9, 0.5)))  # median e^3.9 ~ 50 tokens
            texts.append(" ".join(rng.choice(WORDS) for _ in range(own)))
        pq.write_table(pa.table({"head": [head] * rows, "text": texts}), data)
    return model, data


def run(python: str, engine: str, model: Path, data: Path, out: Path, extra: list[str]) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    args = [python, "-m", "batchgen", f"engine={engine}", "name=prefix", f"output_dir={out}", f"dataset.path={data}",
            "dataset.template='{head} Text: {text}'", "sampling.max_new_tokens=32", "sampling.ignore_eos=true",
            f"engine.model={model}", "run.progress=false", *extra]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=3600)  # the CLI's OpenMP defaults
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if "this run:" in x)
    job_s = float(line.split(" in ")[1].split("s")[0])
    load_s = float(line.split("model load ")[1].split("s")[0])
    status = json.loads((out / "_status.json").read_text())
    stats = status.get("engine") or {}
    computed = stats.get("prefill_tokens")  # None for vLLM: its cache hits are not reported to batchgen
    return {"gen_s": job_s - load_s, "load_s": load_s, "prompt_tokens": status["prompt_tokens"],
            "computed": computed, "reused": stats.get("prefix_tokens_reused"),
            "cache_mb": (stats.get("prefix_cache_bytes") or 0) / 2**20}


def shown(result: dict) -> str:
    if result["computed"] is None:
        return f"not reported (given {result['prompt_tokens']})"
    return str(result["computed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--prefix-tokens", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--workdir", type=Path, default=ROOT / "data" / "bench")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = parser.parse_args()
    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    args.workdir.mkdir(parents=True, exist_ok=True)
    model, data = build(args.workdir, args.rows, args.prefix_tokens, args.seed)
    runs = [("E, prefix cache (auto)", sys.executable, "hf", ["engine.prefix_cache=auto"]),
            ("E, no prefix cache", sys.executable, "hf", ["engine.prefix_cache=off"])]
    if not args.no_vllm:
        runs.append(("vLLM CPU, automatic prefix caching", args.vllm_python, "vllm",
                     ["engine.enable_prefix_caching=true"]))
    print(f"CPU: {describe_cpu()}")
    print(f"{args.rows} rows, a {args.prefix_tokens}-token shared prefix, 32 new tokens each, {args.repeats} repeats")
    samples: dict[str, list[dict]] = {label: [] for label, *_ in runs}
    for repeat in range(args.repeats):
        for label, python, engine, extra in runs:
            result = run(python, engine, model, data, args.workdir / "prefix-out", extra)
            samples[label].append(result)
            print(f"  repeat {repeat + 1} {label}: generation {result['gen_s']:.1f} s, load {result['load_s']:.1f} s, "
                  f"prompt tokens computed {shown(result)}", flush=True)
    base = samples["E, no prefix cache"]
    print("\n| run | generation s (median) | E without the cache / run (per repeat) | prompt tokens computed "
          "| of prompt tokens | load s |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for label, *_ in runs:
        got = samples[label]
        gen = statistics.median(s["gen_s"] for s in got)
        ratios = ", ".join(f"{b['gen_s'] / s['gen_s']:.2f}" for s, b in zip(got, base))
        computed = got[0]["computed"]
        share = "" if computed is None else f"{computed / got[0]['prompt_tokens']:.0%}"
        load = statistics.median(s["load_s"] for s in got)
        print(f"| {label} | {gen:.1f} | {statistics.median(b['gen_s'] for b in base) / gen:.2f} ({ratios}) | "
              f"{shown(got[0])} | {share} | {load:.1f} |")
    cached = samples["E, prefix cache (auto)"][0]
    print(f"\nprefix cache: {cached['reused']} prompt tokens reused, {cached['cache_mb']:.1f} MiB held")
    if not args.no_vllm:
        v = statistics.median(s["gen_s"] for s in samples["vLLM CPU, automatic prefix caching"])
        e = statistics.median(s["gen_s"] for s in samples["E, prefix cache (auto)"])
        print(f"E with the prefix cache / vLLM with automatic prefix caching: {v / e:.2f}x (generation time)")


if __name__ == "__main__":
    main()
