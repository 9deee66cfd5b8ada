"""Random-kill harness: SIGKILL a job at random moments, resume it after each kill until it is done, and
check that nothing was lost, duplicated or torn (docs/contract.md section 6, rule 2).

    python scripts/kill_harness.py --kills 20          # the documented run (tests run it with --kills 5)

1. build a tiny random-weight model and a dataset (or take --model), and run the job once, uninterrupted
2. run the same job as `python -m batchgen` in a subprocess and SIGKILL it after a random delay: a few
   kills during start-up, most while parts are generated, journaled and committed. The test hook
   BATCHGEN_TEST_CRASH_WINDOW_S widens the crash windows (a journal frame half written, a part written
   under its temp name, a part committed with its journal not yet removed) so that random kills land in them
3. after every kill: every committed part reads back whole and holds exactly its input rows
4. resume until a run exits 0 (a run that finishes before its kill starts a fresh round in a new output_dir)
5. the final output equals the uninterrupted run's, every id once per sample index, no journal or temp left
Prints the kills survived, where they landed (as seen on disk) and the rows checked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
WORDS = ("the river town market opened closed with many people after rain sun night lamp bread clock train "
         "harbour music quiet loud green blue small large old new fast slow").split()


@dataclass
class Report:
    kills: int = 0  # SIGKILLs that hit a live job
    rounds: int = 1  # output dirs used (a new one when a run finished before its kill)
    landed: Counter = field(default_factory=Counter)  # what each kill left on disk
    rows_checked: int = 0  # input rows checked in final outputs
    samples_checked: int = 0  # output rows checked
    wall_s: float = 0.0

    def render(self) -> str:
        where = ", ".join(f"{k} {v}" for k, v in sorted(self.landed.items()))
        return (f"kill harness: {self.kills} kills survived in {self.rounds} round(s) ({where}); "
                f"{self.rows_checked} rows / {self.samples_checked} samples checked, exactly once each and "
                f"identical to an uninterrupted run; {self.wall_s:.0f}s")


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))) for _ in range(n)]


def build_inputs(work: Path, rows: int, model: str | None) -> tuple[str, Path]:
    data = work / "in.parquet"
    pq.write_table(pa.table({"uid": [f"r{i:04d}" for i in range(rows)], "prompt": texts(rows, 1)}), data)
    if model is None:
        from batchgen.engines.toymodel import build_model

        model = str(work / "tiny-llama")
        build_model(model, texts(400, 0), size="tiny")
    return model, data


def overrides(model: str, data: Path, out: Path, rows_per_part: int, max_new_tokens: int,
              extra: tuple[str, ...] = ()) -> list[str]:
    return [*extra, "name=kill-harness", f"output_dir={out}", f"dataset.path={data}", "dataset.id_column=uid",
            f"engine.model={model}", "engine.dtype=float32", "engine.max_batch_size=2", "engine.threads=1",
            "sampling.n=2", f"sampling.max_new_tokens={max_new_tokens}", f"run.rows_per_part={rows_per_part}",
            "run.progress=false"]


def reference_run(args: list[str]) -> tuple[pa.Table, float]:
    """The uninterrupted run, in this process."""
    from hydra import compose, initialize_config_dir

    from batchgen.commands.compose import CONF_DIR, to_job_config
    from batchgen.run.runner import run_job

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = to_job_config(compose(config_name="config", overrides=args))
    summary = run_job(cfg)
    return read_output(Path(cfg.output_dir)), summary.wall_s - summary.load_s


def read_output(out: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in sorted(out.glob("part-*.parquet"))])


def start(args: list[str], window_s: float) -> subprocess.Popen:
    env = os.environ | {"BATCHGEN_TEST_CRASH_WINDOW_S": str(window_s), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "batchgen", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_until_generating(proc: subprocess.Popen, out: Path, timeout: float = 300) -> bool:
    """True once this process works on a part (its status names one); False if it exited first."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        try:
            status = json.loads((out / "_status.json").read_text())
            if status.get("pid") == proc.pid and status.get("current_part"):
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    return False


def inspect(out: Path, expected_ids: list[str], rows_per_part: int, n: int) -> list[str]:
    """Check every committed part after a kill; name what the kill left behind."""
    from batchgen.output.journal import read_journal

    seen = []
    for path in sorted(out.glob("part-*.parquet")):
        k = int(path.stem.split("-")[1])
        ids = pq.read_table(path).column("id").to_pylist()  # raises on a torn file
        want = [i for i in expected_ids[k * rows_per_part:(k + 1) * rows_per_part] for _ in range(n)]
        assert ids == want, f"{path.name}: ids {ids[:4]}... != {want[:4]}..."
    done = {int(p.stem.split("-")[1]) for p in out.glob("part-*.parquet")}
    for path in out.glob("_part-*.journal"):
        k = int(path.name[6:11])
        _, results, torn = read_journal(path)
        if k in done:
            seen.append("journal beside its committed part")
        elif torn:
            seen.append("torn journal tail")
        elif results:
            seen.append("mid-part with results journaled")
    if list(out.glob(".part-*.tmp-*")):
        seen.append("part under its temp name")
    if len([p for p in out.glob("_part-*.journal") if int(p.name[6:11]) not in done]) > 1:
        seen.append("several parts in flight")
    return seen or ["between parts or at start-up"]


def progress_of(out: Path) -> tuple[int, int]:
    """(parts committed, samples journaled): grows whenever a killed run got something done."""
    from batchgen.output.journal import read_journal

    if not out.exists():
        return (0, 0)
    journaled = sum(len(read_journal(p)[1]) for p in out.glob("_part-*.journal"))
    return (len(list(out.glob("part-*.parquet"))), journaled)


def check_final(out: Path, reference: pa.Table, expected_ids: list[str], n: int) -> None:
    got = read_output(out)
    pairs = list(zip(got.column("id").to_pylist(), got.column("sample_index").to_pylist()))
    assert Counter(pairs) == Counter((i, s) for i in expected_ids for s in range(n)), "an id is missing or repeated"
    assert got.equals(reference), "output differs from the uninterrupted run"
    left = [p.name for p in out.iterdir() if "journal" in p.name or ".tmp-" in p.name]
    assert not left and (out / "_SUCCESS").exists(), f"left behind: {left}"


def run_harness(kills: int, *, work: Path, model: str | None = None, rows: int = 40, rows_per_part: int = 6,
                max_new_tokens: int = 12, window_s: float = 0.02, seed: int = 0, log=print,
                extra: tuple[str, ...] = ()) -> Report:
    """`kills` SIGKILLs survived, every output checked against an uninterrupted run; `extra`: more overrides for
    every run (a constrained job's sampling.json_schema, say)."""
    rng = random.Random(seed)
    report = Report()
    t0 = time.time()
    model, data = build_inputs(work, rows, model)
    expected_ids = [f"r{i:04d}" for i in range(rows)]
    reference, gen_s = reference_run(overrides(model, data, work / "reference", rows_per_part, max_new_tokens,
                                                   extra))
    parts = -(-rows // rows_per_part)
    gen_est = gen_s + window_s * (2 * rows + 20 * parts)  # generation with the crash windows (see crash_window)
    out = work / "run-1"
    base_delay = max_delay = 2.0 * gen_est / kills
    progress = progress_of(out)
    while True:
        args = overrides(model, data, out, rows_per_part, max_new_tokens, extra)
        proc = start(args, window_s)
        if report.kills < kills:
            if rng.random() < 0.15:
                time.sleep(rng.uniform(0.0, 3.0))  # during start-up, before or while the lock is taken
            elif wait_until_generating(proc, out):
                time.sleep(rng.uniform(0.0, max_delay))
        else:
            proc.wait(timeout=600)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            report.kills += 1
            landed = inspect(out, expected_ids, rows_per_part, 2)
            report.landed.update(landed)
            now = progress_of(out)  # no progress since the last kill: allow longer runs, so the job cannot livelock
            max_delay = base_delay if now > progress else max_delay * 1.5
            progress = max(progress, now)
            log(f"kill {report.kills}: {', '.join(landed)}; {len(list(out.glob('part-*.parquet')))} parts committed")
            continue
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert proc.returncode == 0, f"run failed with exit {proc.returncode}:\n{err[-3000:]}"
        check_final(out, reference, expected_ids, 2)
        report.rows_checked += rows
        report.samples_checked += reference.num_rows
        if report.kills >= kills:
            break
        report.rounds += 1  # finished before its kill: go on in a fresh output_dir
        out = work / f"run-{report.rounds}"
        max_delay, progress = base_delay, (0, 0)
    report.wall_s = time.time() - t0
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs to survive [20]")
    parser.add_argument("--rows", type=int, default=40, help="input rows [40]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times [0]")
    parser.add_argument("--model", help="model directory [a tiny random-weight Llama built here]")
    parser.add_argument("--window", type=float, default=0.02, help="crash-window test hook, seconds [0.02]")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kill-harness-") as work:
        report = run_harness(args.kills, work=Path(work), model=args.model, rows=args.rows, seed=args.seed,
                             window_s=args.window)
    print(report.render())


if __name__ == "__main__":
    main()
