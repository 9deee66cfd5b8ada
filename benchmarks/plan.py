"""`batchgen plan` against the job it plans: wall time of each on the same input, same run, and whether the plan's
prompt-token total (after run.too_long) equals the job's.

    python benchmarks/plan.py                  # 100,000 rows of Parquet, the tiny model, 16 new tokens each

Both run through the CLI in their own process (start-up included in both). The CPU is printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--workdir", type=Path, default=ROOT / "data" / "bench")
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    sys.path.insert(0, str(ROOT))
    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu
    from batchgen.engines.toymodel import BENCH_WORDS, cached_model

    args.workdir.mkdir(parents=True, exist_ok=True)
    model = cached_model(args.workdir, "tiny")
    data = args.workdir / f"plan-{args.rows}.parquet"
    if not data.exists():
        rng = random.Random(0)
        texts = [" ".join(rng.choice(BENCH_WORDS) for _ in range(int(rng.lognormvariate(3.0, 0.6)) + 1))
                 for _ in range(args.rows)]
        pq.write_table(pa.table({"prompt": texts}), data)
    out = args.workdir / "plan-out"
    common = ["name=plan-bench", f"output_dir={out}", f"dataset.path={data}", f"engine.model={model}",
              "sampling.max_new_tokens=16", "run.progress=false", "run.rows_per_part=4096"]
    times = {}
    for label, cmd in (("plan", ["plan", *common]), ("job", common)):
        if label == "job":
            for p in out.glob("part-*"):
                p.unlink()
        else:
            shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "batchgen", *cmd], cwd=ROOT, capture_output=True, text=True)
        times[label] = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        print(f"  {label}: {times[label]:.1f} s", flush=True)
    plan = json.loads((out / "_plan.json").read_text())
    written = ds.dataset(str(out), format="parquet").to_table(columns=["num_prompt_tokens"])
    job_tokens = sum(written.column(0).to_pylist())
    print(f"CPU: {describe_cpu()}")
    print(f"{args.rows} rows, tiny model, 16 new tokens each: plan {times['plan']:.1f} s, job {times['job']:.1f} s, "
          f"plan / job {times['plan'] / times['job']:.3f}")
    print(f"prompt tokens: plan {plan['prompt_tokens_after_fit']} after run.too_long, job {job_tokens}: "
          f"{'equal' if plan['prompt_tokens_after_fit'] == job_tokens else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
