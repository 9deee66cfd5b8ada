"""OpenMP waiting and the thread governor: a real batchgen job on the throughput benchmark's workload, on an idle
machine and beside other busy processes, under three OpenMP settings (interleaved, medians):

- passive: OMP_WAIT_POLICY=PASSIVE (batchgen's CLI default before the governor): threads sleep at once;
- default: the CLI's defaults now (a short spin, GOMP_SPINCOUNT=10000, and the governor,
  engines/hf/backends/cpu/threads.py);
- spin, fixed: the same spin with the governor off (BATCHGEN_ADAPT_THREADS=0): what the governor saves.

    python benchmarks/threads.py                 # 64 rows, 2 repeats, one busy process beside the job when busy
    python benchmarks/threads.py --busy 2 --rows 32

The busy processes are plain Python loops started before the job and stopped after it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SETTINGS = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "default": {},
    "spin, fixed": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000", "BATCHGEN_ADAPT_THREADS": "0"},
}
BUSY = "while True: pass"


def job(model: Path, data: Path, out: Path, rows: int, setting: dict[str, str]) -> dict:
    """One job through the CLI (throughput.py's E) under `setting`: its figures, and whether the governor acted."""
    from throughput import run_job

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                             "BATCHGEN_ADAPT_THREADS")} | setting
    result, log = run_job(model, data, "auto", out, rows, env=env)
    return result | {"governed": "other work holds the cores" in log}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the job in the 'busy' runs")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".bench")
    args = parser.parse_args()
    import pyarrow.parquet as pq
    from throughput import build  # the throughput benchmark's model and workload

    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    args.workdir.mkdir(parents=True, exist_ok=True)
    model, data = build(args.workdir, size="bench", rows=args.rows, seed=0)
    useful = sum(pq.read_table(data).column("max_new_tokens").to_pylist())
    times: dict[tuple[str, str], list[float]] = {}
    governed: dict[tuple[str, str], int] = {}
    for repeat in range(args.repeats):
        for load in ("idle", "busy"):
            for name, setting in SETTINGS.items():
                hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy if load == "busy"
                                                                                       else 0)]
                try:
                    time.sleep(0.5 if hogs else 0)
                    r = job(model, data, args.workdir / "threads-out", args.rows, setting)
                finally:
                    for hog in hogs:
                        hog.kill()
                        hog.wait()
                times.setdefault((load, name), []).append(r["gen_s"])
                governed[load, name] = governed.get((load, name), 0) + r["governed"]
                print(f"  repeat {repeat + 1}, {load}, {name}: {r['gen_s']:.1f} s{' (governed)' * r['governed']}",
                      flush=True)
    print(f"\n{describe_cpu()}")
    print(f"workload: the throughput benchmark's, {args.rows} rows, {useful} useful tokens; busy: {args.busy} "
          f"process(es) in a Python loop; {args.repeats} repeats, medians")
    print("| machine | setting | generation s | useful tok/s | vs passive | governor acted |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for load in ("idle", "busy"):
        base = statistics.median(times[load, "passive"])
        for name in SETTINGS:
            gen = statistics.median(times[load, name])
            print(f"| {load} | {name} | {gen:.1f} | {useful / gen:.1f} | {base / gen:.2f}x | "
                  f"{governed[load, name]}/{args.repeats} |")


if __name__ == "__main__":
    main()
