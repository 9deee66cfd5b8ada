"""Scaling out on one machine: the same job with launcher=ray and 1 then 2 workers (a local Ray cluster), rows/s
as a same-run ratio, and the scaling efficiency. Also what a shard reads: input rows decoded by each of 3 shards
of a Parquet input (parts cut from its footers) against the whole input (what every shard read before).

    python benchmarks/scale.py                 # 384 rows, 32 new tokens, the mid model (26M), 2 repeats

Each Ray worker gets engine.threads = cores / workers, so both runs use the whole machine; on a 2-core machine
2 workers share the cores a single worker had, so expect well below 2x. Generation time excludes start-up and
model load (reported apart). The CPU is printed beside the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(workdir: Path, rows: int, seed: int) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.engines.toymodel import BENCH_WORDS, cached_model

    model = cached_model(workdir, "mid", seed)
    data = workdir / f"scale-{rows}-{seed}.parquet"
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(BENCH_WORDS) for _ in range(int(rng.lognormvariate(3.5, 0.5)))) for _ in range(rows)]
    pq.write_table(pa.table({"uid": [f"r{i}" for i in range(rows)], "prompt": texts}), data, row_group_size=16)
    return model, data


def job(model: Path, data: Path, out: Path, *extra: str):
    import shutil

    from hydra import compose, initialize_config_dir

    from batchgen.commands.compose import CONF_DIR, to_job_config

    shutil.rmtree(out, ignore_errors=True)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_job_config(compose(config_name="config", overrides=[
            "name=scale", f"output_dir={out}", f"dataset.path={data}", "dataset.id_column=uid",
            f"engine.model={model}", "sampling.max_new_tokens=32", "sampling.ignore_eos=true", "run.rows_per_part=16",
            "run.progress=false", *extra]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=ROOT / "data" / "bench")
    args = parser.parse_args()
    import ray

    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu
    from batchgen.run.runner import run_job

    args.workdir.mkdir(parents=True, exist_ok=True)
    model, data = build(args.workdir, args.rows, 0)
    cores = os.cpu_count() or 1
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    print(f"CPU: {describe_cpu()}")
    print(f"{args.rows} rows, 32 new tokens each, parts of 16 rows, mid model, launcher=ray, {args.repeats} repeats")
    rates: dict[int, list[float]] = {1: [], 2: []}
    for repeat in range(args.repeats):
        for workers in (1, 2):
            threads = max(cores // workers, 1)
            cfg = job(model, data, args.workdir / "scale-out", "launcher=ray", f"launcher.num_workers={workers}",
                      f"launcher.num_cpus={cores / workers}", f"engine.threads={threads}")
            s = run_job(cfg)
            gen_s = s.wall_s - s.load_s
            rates[workers].append(args.rows / gen_s)
            print(f"  repeat {repeat + 1}: {workers} worker(s) x {threads} threads: {args.rows / gen_s:.1f} rows/s "
                  f"(generation {gen_s:.1f} s, start-up and load {s.load_s:.1f} s)", flush=True)
    ray.shutdown()
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    per = ", ".join(f"{b / a:.2f}" for a, b in zip(rates[1], rates[2]))
    print(f"\n| workers | rows/s (median) |\n| --- | ---: |\n| 1 | {one:.1f} |\n| 2 | {two:.1f} |")
    print(f"2 workers / 1 worker: {two / one:.2f}x (per repeat {per}); scaling efficiency {two / one / 2:.0%}")
    print("\ninput rows read per shard, 3 shards of a Parquet input (engine=dummy): parts cut from the footers, and "
          "streamed as before this release (each shard reads past the others' parts):")
    from batchgen.reader.parquet import ParquetReader

    for label, seek in (("seeking", True), ("streamed", False)):
        ParquetReader.seekable = seek  # type: ignore[misc]
        read = [run_job(job(model, data, args.workdir / f"scale-shards-{label}", f"run.shard={k}", "run.num_shards=3",
                            "engine=dummy", "+engine.extra_args.delay_s=0")).rows_read for k in range(3)]
        print(f"  {label}: rows read per shard {read} of {args.rows}")
    ParquetReader.seekable = True  # type: ignore[misc]


if __name__ == "__main__":
    main()
