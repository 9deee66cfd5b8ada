"""Does the part size cost speed? The same job at several `run.rows_per_part`, side by side.

    python benchmarks/parts.py                      # hf engine: parts of 32, 256 and the whole input, + 32 unstreamed
    python benchmarks/parts.py --engine vllm        # the same on vLLM's CPU build (.venv-vllm)

A part is the unit of commit. With the streaming seam (batchgen/run/feed.py) the engine pulls the next parts'
requests while the current part's last rows finish, so small parts should cost no speed. Each configuration is
a real job through the CLI in its own process; configurations are interleaved (A B C D, repeated) and medians
reported. `32 / look-ahead 0` runs one part at a time (what batchgen did before the seam) for comparison.
Printed per configuration: the job's generation time (model load excluded) and its ratio to the whole-input
run, the useful-slot occupancy (mean live rows per decode step over engine.max_batch_size; for vLLM the
requests queued per step, capped at its max_num_seqs), the most parts in flight, and the job's peak RSS.
Workload (seeded): prompts log-normal around 60 words, per-row max_new_tokens uniform in [16, 128], EOS
ignored; a ~26M-parameter random-weight Llama ("mid").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the river town market opened closed with many people after rain sun night lamp bread clock train "
         "harbour music quiet loud green blue small large old new fast slow city field stone road").split()
SLOTS = 64  # engine.max_batch_size of every run (the hf engine's CPU default), so occupancy compares
# a job process that reports its peak RSS on exit
MEASURED = ("import atexit, resource, sys, runpy; atexit.register(lambda: print('MAXRSS_KB', resource.getrusage("
            "resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)); sys.argv = ['batchgen', *sys.argv[1:]]; "
            "runpy.run_module('batchgen', run_name='__main__')")


def build(workdir: Path, rows: int, seed: int) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.engines.toymodel import cached_model

    model = cached_model(workdir, "mid", seed)
    data = workdir / f"parts-{rows}-{seed}.parquet"
    if not data.exists():
        rng = random.Random(seed)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(min(400, max(3, int(rng.lognormvariate(4.1, 0.6))))))
                   for _ in range(rows)]
        caps = [rng.randint(16, 128) for _ in range(rows)]
        pq.write_table(pa.table({"prompt": prompts, "max_new_tokens": caps}), data)
    return model, data


def run_job(python: str, engine: str, model: Path, data: Path, out: Path, rows_per_part: int,
            lookahead: str) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    args = [f"engine={engine}", "name=parts", f"output_dir={out}", f"dataset.path={data}",
            "dataset.max_new_tokens_column=max_new_tokens", "sampling.max_new_tokens=128", "sampling.ignore_eos=true",
            f"engine.model={model}", f"engine.max_batch_size={SLOTS}", f"run.rows_per_part={rows_per_part}",
            f"run.lookahead_parts={lookahead}", "run.progress=false"]
    if engine == "hf":
        args.append("engine.dtype=float32")
    proc = subprocess.run([python, "-c", MEASURED, *args], capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    logged = "\n".join(p.read_text() for p in out.glob("_logs/*/*.log"))  # the run's log, where the summary left it
    streamed = next((x for x in logged.splitlines() if "streamed: up to" in x), "")
    in_flight = int(streamed.split("up to ")[1].split()[0]) if streamed else 1
    rss_kb = int(next(x for x in proc.stderr.splitlines() if x.startswith("MAXRSS_KB")).split()[1])
    status = json.loads((out / "_status.json").read_text())
    stats = status.get("engine") or {}
    if "decode_steps" in stats:  # hf: live rows per decode step
        occupancy = stats["decode_row_steps"] / max(stats["decode_steps"], 1)
    else:  # vllm: requests queued per step, capped at max_num_seqs
        occupancy = stats.get("queued_row_steps", 0) / max(stats.get("steps", 0), 1)
    return {"gen_s": generation_s(proc.stdout), "occupancy_rows": occupancy, "in_flight": in_flight,
            "rss_mb": rss_kb / 1024, "generated": status["generated_tokens"]}


def generation_s(summary: str) -> float:
    """A job's generation time from its printed summary: the run's wall time less start-up and model load."""
    line = next(x for x in summary.splitlines() if "this run:" in x)
    return float(line.split(" in ")[1].split("s")[0]) - float(line.split("model load ")[1].split("s")[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--rows", type=int, default=384)
    parser.add_argument("--parts", default="32,256", help="rows_per_part values besides the whole input")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=ROOT / "data" / "bench")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = parser.parse_args()
    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    args.workdir.mkdir(parents=True, exist_ok=True)
    model, data = build(args.workdir, args.rows, args.seed)
    python = args.vllm_python if args.engine == "vllm" else sys.executable
    configs = [(args.rows, "null", "whole input")] + [(int(p), "null", f"{p} rows") for p in args.parts.split(",")]
    smallest = min(int(p) for p in args.parts.split(","))
    configs.append((smallest, "0", f"{smallest} rows, look-ahead 0"))
    print(f"CPU: {describe_cpu()}")
    print(f"engine={args.engine}, {args.rows} rows, {args.repeats} repeats interleaved, model {model.name}")
    samples: dict[str, list[dict]] = {label: [] for _, _, label in configs}
    for repeat in range(args.repeats):
        for rows_per_part, lookahead, label in configs:
            t = time.perf_counter()
            result = run_job(python, args.engine, model, data, args.workdir / "parts-out", rows_per_part, lookahead)
            samples[label].append(result)
            took = time.perf_counter() - t
            print(f"  repeat {repeat + 1} {label}: generation {result['gen_s']:.1f} s ({took:.0f} s with load)",
                  flush=True)
    base = statistics.median(s["gen_s"] for s in samples["whole input"])
    print("\n| run.rows_per_part | generation s (median) | vs whole input | per repeat (same repeat's whole input) "
          "| live rows per step "
          "(of max_batch_size) | parts in flight | peak RSS MB |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for _, _, label in configs:
        runs = samples[label]
        gen = statistics.median(s["gen_s"] for s in runs)
        occ = statistics.median(s["occupancy_rows"] for s in runs)
        share = f"{occ:.1f} of {SLOTS} ({occ / SLOTS:.0%})"
        per = ", ".join(f"{s['gen_s'] / w['gen_s']:.3f}" for s, w in zip(runs, samples["whole input"]))
        print(f"| {label} | {gen:.1f} | {gen / base:.3f} | {per} | {share} | {max(s['in_flight'] for s in runs)} | "
              f"{max(s['rss_mb'] for s in runs):.0f} |")


if __name__ == "__main__":
    main()
