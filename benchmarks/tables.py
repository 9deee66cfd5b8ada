"""What does a table output cost? The same job with output.sink=parquet, delta and iceberg, side by side.

    python benchmarks/tables.py                        # 256 rows, parts of 32 (8 commits), 2 repeats
    python benchmarks/tables.py --rows 512 --rows-per-part 32 --repeats 3 --upsert

The workload of benchmarks/parts.py (a ~26M-parameter random-weight Llama, "mid"; prompts log-normal around 60
words; per-row max_new_tokens uniform in [16, 128], EOS ignored), on the hf engine, each configuration a real job
through the CLI in its own process, configurations interleaved (parquet, delta, iceberg, repeated). Printed per
configuration: the job's generation time (model load excluded) and its ratio to the Parquet-only job's in the same
repeat, and the time the table commits took (the job's own summary: `table: N parts committed ... in S s`) as a share
of its generation time: the cost a table output adds per part. Delta on a local path, Iceberg in a SQLite catalog
with a local warehouse; --upsert merges each part (output.mode=upsert) instead of appending.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parts_module():
    spec = importlib.util.spec_from_file_location("bench_parts", ROOT / "benchmarks" / "parts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sink_args(sink: str, where: Path, upsert: bool) -> list[str]:
    mode = ["output.mode=upsert"] * upsert
    if sink == "delta":
        return ["output.sink=delta", f"output.table={where / 'delta'}", *mode]
    if sink == "iceberg":
        return ["output.sink=iceberg", "output.table=bench.annotations", *mode,
                f"output.catalog={{type: sql, uri: 'sqlite:///{where}/catalog.db', warehouse: 'file://{where}/wh'}}"]
    return []


def run_job(model: Path, data: Path, where: Path, sink: str, rows_per_part: int, upsert: bool) -> dict:
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    args = ["name=tables", f"output_dir={where / 'out'}", f"dataset.path={data}",
            "dataset.max_new_tokens_column=max_new_tokens", "sampling.max_new_tokens=128", "sampling.ignore_eos=true",
            f"engine.model={model}", "engine.dtype=float32", f"run.rows_per_part={rows_per_part}",
            "run.progress=false", *sink_args(sink, where, upsert)]
    proc = subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    table = next((x for x in proc.stdout.splitlines() if "  table: " in x), "")
    commits = int(table.split("table: ")[1].split()[0]) if table else 0
    commit_s = float(table.split(" in ")[1].split("s")[0]) if table else 0.0
    return {"gen_s": parts_module().generation_s(proc.stdout), "commits": commits, "commit_s": commit_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--rows-per-part", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--upsert", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=ROOT / "data" / "bench")
    args = parser.parse_args()
    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    args.workdir.mkdir(parents=True, exist_ok=True)
    model, data = parts_module().build(args.workdir, args.rows, args.seed)
    print(f"CPU: {describe_cpu()}")
    print(f"{args.rows} rows, parts of {args.rows_per_part}, {args.repeats} repeats interleaved, model {model.name}, "
          f"mode {'upsert' if args.upsert else 'append'}")
    sinks = ("parquet", "delta", "iceberg")
    samples: dict[str, list[dict]] = {s: [] for s in sinks}
    for repeat in range(args.repeats):
        for sink in sinks:
            t = time.perf_counter()
            result = run_job(model, data, args.workdir / f"tables-{sink}", sink, args.rows_per_part, args.upsert)
            samples[sink].append(result)
            print(f"  repeat {repeat + 1} {sink}: generation {result['gen_s']:.1f} s, {result['commits']} table "
                  f"commits in {result['commit_s']:.2f} s ({time.perf_counter() - t:.0f} s with load)", flush=True)
    print("\n| output.sink | generation s (median) | vs parquet, per repeat | table commits | commit s per part "
          "(median) | commit time / generation time (median) |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for sink in sinks:
        runs = samples[sink]
        gen = statistics.median(r["gen_s"] for r in runs)
        per = ", ".join(f"{r['gen_s'] / p['gen_s']:.3f}" for r, p in zip(runs, samples["parquet"]))
        commits = runs[0]["commits"]
        per_part = statistics.median(r["commit_s"] / max(r["commits"], 1) for r in runs)
        share = statistics.median(r["commit_s"] / r["gen_s"] for r in runs)
        print(f"| {sink} | {gen:.1f} | {per} | {commits} | {per_part:.3f} | {share:.2%} |")


if __name__ == "__main__":
    main()
