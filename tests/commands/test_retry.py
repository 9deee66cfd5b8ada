"""batchgen retry: the erring rows of a finished job generated again in attempt parts beside the originals, the
latest-attempt view (pyarrow, pandas, datasets, duckdb) one row per (id, sample_index), resumable after SIGKILL. On
engine=dummy, but for the SIGKILL test: there the hf engine is killed mid-part and its resumed rows must equal an
uninterrupted retry's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.commands.retry import ID_COLUMN, INPUT_FILE
from batchgen.output.view import duckdb_sql, latest
from batchgen.run.runner import run_job
from tests.conftest import REPO, compose_job, corpus, dummy_overrides, job_overrides, run_cli, write_parquet

MAX_LEN, NEW = 64, 16


def long_prompt(i: int) -> str:
    return " ".join(corpus(12, seed=100 + i))  # well over MAX_LEN - NEW tokens


def dataset(tmp_path: Path) -> tuple[Path, list[str]]:
    texts = corpus(24, seed=21)
    long_rows = {2, 5, 9, 14, 15, 20}
    rows = [{"uid": f"r{i:02d}", "prompt": long_prompt(i) if i in long_rows else t, "topic": f"t{i % 3}"}
            for i, t in enumerate(texts)]
    return write_parquet(tmp_path / "in.parquet", rows), [f"r{i:02d}" for i in sorted(long_rows)]


def job_args(model: str, data: Path, out: Path, *extra: str, overrides=dummy_overrides) -> list[str]:
    return overrides(model, data, out, "dataset.id_column=uid", f"engine.max_model_len={MAX_LEN}",
                     f"sampling.max_new_tokens={NEW}", "sampling.ignore_eos=true", "run.too_long=skip",
                     "run.rows_per_part=5", "run.max_error_rate=0.9", *extra)


def finished_job(model: str, tmp_path: Path, name: str = "out", overrides=dummy_overrides) -> tuple[Path, list[str]]:
    data, long_ids = dataset(tmp_path)
    out = tmp_path / name
    summary = run_job(compose_job(job_args(model, data, out, overrides=overrides)))
    assert summary.state == "done" and summary.totals.errors == {"too_long": len(long_ids)}
    return out, long_ids


def test_a_retry_with_truncation_leaves_every_id_once_in_the_latest_attempt_view(tiny_model, tmp_path):
    out, long_ids = finished_job(tiny_model, tmp_path)
    before = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    done = run_cli(["retry", str(out), "--kinds", "too_long", "run.too_long=truncate_left"])
    assert done.returncode == 0, done.stderr[-3000:]
    attempt = out / "_attempts" / "attempt-001"
    assert (attempt / "_SUCCESS").exists()
    kept = out / "_attempts" / "original"  # the job's parts as committed, kept when the publish replaced them
    assert {p.name: p.read_bytes() for p in kept.glob("part-*.parquet")} == before
    assert pq.read_table(out).num_rows == 24  # reading the directory gives the latest attempt's rows, once each
    retried = pq.read_table(attempt).to_pylist()  # its parts (_input.parquet is skipped, as by any reader)
    assert sorted(r["id"] for r in retried) == long_ids
    assert {r["attempt"] for r in retried} == {1} and all(r["error"] is None for r in retried)
    assert all(r["topic"] for r in retried)  # the job's passthrough columns, and no column of retry's own
    assert ID_COLUMN not in pq.read_schema(attempt / "part-00000.parquet").names
    view = latest(out).to_pylist()
    assert [r["id"] for r in view] == [f"r{i:02d}" for i in range(24)]  # every id once, in input order
    assert all(r["error"] is None for r in view)
    assert [r["attempt"] for r in view] == [1 if r["id"] in long_ids else 0 for r in view]
    # the retried rows equal a job that truncated from the start (same ids, same seeds)
    data = tmp_path / "in.parquet"
    run_job(compose_job(job_args(tiny_model, data, tmp_path / "ref", "run.too_long=truncate_left")))
    ref = {r["id"]: r["generation"] for r in pq.read_table(tmp_path / "ref").to_pylist()}
    assert {r["id"]: r["generation"] for r in view} == ref
    status = run_cli(["status", str(out)]).stdout
    assert "attempt-001: complete: 6 rows retried (too_long; overrides: run.too_long=truncate_left)" in status
    # nothing left to retry: a second retry says so and writes nothing
    again = run_cli(["retry", str(out), "--kinds", "too_long"])
    assert again.returncode == 0 and "nothing to retry" in again.stdout
    assert not (out / "_attempts" / "attempt-002").exists()


def test_the_view_reads_the_same_in_pandas_datasets_and_duckdb(tiny_model, tmp_path):
    import datasets
    import duckdb

    out, long_ids = finished_job(tiny_model, tmp_path)
    assert run_cli(["retry", str(out), "run.too_long=truncate_left"]).returncode == 0
    table = latest(out)
    frame = table.to_pandas()
    assert frame.groupby(["id", "sample_index"]).size().max() == 1 and len(frame) == 24
    ds = datasets.Dataset(table)
    assert ds.num_rows == 24 and sorted(ds["id"]) == sorted(frame["id"])
    sql = duckdb.sql(duckdb_sql(out)).arrow()
    sql = sql.read_all() if hasattr(sql, "read_all") else sql
    key = lambda r: (r["id"], r["sample_index"])  # noqa: E731
    pick = ["id", "sample_index", "generation", "error", "attempt", "topic"]
    assert sorted(sql.select(pick).to_pylist(), key=key) == sorted(table.select(pick).to_pylist(), key=key)
    assert latest(out, columns=["id", "generation"]).column_names == ["id", "generation"]


def test_a_failed_retry_keeps_the_earlier_success_and_a_later_attempt_wins_over_an_error(tiny_model, tmp_path):
    """Attempt 1 still skips the long rows (no override): the view keeps attempt 1's error rows (the latest, all
    erred); attempt 2 truncates: it wins. A row that succeeded at attempt 0 is never replaced by a failure."""
    out, long_ids = finished_job(tiny_model, tmp_path)
    assert run_cli(["retry", str(out), "run.max_error_rate=1"]).returncode == 0  # every row errs again
    view = latest(out).to_pylist()
    assert [r["attempt"] for r in view if r["id"] in long_ids] == [1] * len(long_ids)
    assert all(r["error"].startswith("too_long") for r in view if r["id"] in long_ids)
    assert run_cli(["retry", str(out), "run.too_long=truncate_left"]).returncode == 0
    view = latest(out).to_pylist()
    assert [r["attempt"] for r in view if r["id"] in long_ids] == [2] * len(long_ids)
    assert len(view) == 24 and all(r["error"] is None for r in view)


def test_retry_refuses_an_unfinished_job_a_changed_input_and_keys_it_sets(tiny_model, tmp_path):
    out, _ = finished_job(tiny_model, tmp_path)
    refused = run_cli(["retry", str(out), "dataset.path=/elsewhere.parquet"])
    assert refused.returncode == 2 and "dataset.path: set by batchgen retry" in refused.stderr
    refused = run_cli(["retry", str(out), "--kinds", "malformed_json"])
    assert refused.returncode == 2 and "cannot be retried" in refused.stderr
    refused = run_cli(["retry", str(out), "run.too_long=sideways"])
    assert refused.returncode == 2 and "run.too_long must be one of" in refused.stderr
    (out / "_SUCCESS").unlink()
    refused = run_cli(["retry", str(out)])
    assert refused.returncode == 2 and "is not complete" in refused.stderr
    (out / "_SUCCESS").write_text("")
    write_parquet(tmp_path / "in.parquet", [{"uid": "x", "prompt": "changed", "topic": "t"}])
    refused = run_cli(["retry", str(out)])
    assert refused.returncode == 2 and "input changed since it ran" in refused.stderr


def committed(attempt: Path) -> int:
    return len(list(attempt.glob("part-*.parquet")))


@pytest.mark.slow
def test_a_retry_killed_with_sigkill_resumes_to_the_same_rows_exactly_once(tiny_model, tmp_path):
    out, long_ids = finished_job(tiny_model, tmp_path, overrides=job_overrides)  # the hf engine
    clean = tmp_path / "clean"
    shutil.copytree(out, clean)
    args = ["retry", "--kinds", "too_long", "run.too_long=truncate_left", "run.rows_per_part=1",
            "sampling.max_new_tokens=48", "engine.max_model_len=64"]
    assert run_cli([args[0], str(clean), *args[1:]]).returncode == 0
    attempt = out / "_attempts" / "attempt-001"
    kills = 0
    for round_ in range(3):  # the first kill mid-part (a journal written), the next ones after a further commit
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", args[0], str(out), *args[1:]], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})
        deadline = time.time() + 120
        before = committed(attempt)
        while proc.poll() is None and time.time() < deadline:
            if committed(attempt) > before or round_ == 0 and any(attempt.glob("_part-*.journal")):
                break
            time.sleep(0.005)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait(timeout=30)
        if (attempt / "_SUCCESS").exists():
            break
    assert kills >= 1
    assert (attempt / INPUT_FILE).exists()
    resumed = run_cli([args[0], str(out)])  # the unfinished attempt, from its recorded kinds and overrides
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not (out / "_attempts" / "attempt-002").exists()
    view, ref = latest(out).to_pylist(), latest(clean).to_pylist()
    assert [r["id"] for r in view] == [f"r{i:02d}" for i in range(24)]
    assert [(r["id"], r["generation"], r["attempt"]) for r in view] == [(r["id"], r["generation"], r["attempt"])
                                                                        for r in ref]
    retried = pq.read_table(attempt, columns=["id"]).column("id").to_pylist()
    assert sorted(retried) == long_ids  # no duplicate in the attempt's parts
    print(f"retry: {kills} SIGKILLs, then resumed: {len(long_ids)} rows exactly once, identical to an "
          f"uninterrupted retry; attempt recorded as {json.loads((attempt / '_retry.json').read_text())}")


def test_a_manifest_alone_never_turns_on_a_models_own_code_for_a_retry(tiny_model, tmp_path):
    """An output directory is data: a manifest that records engine.trust_remote_code=true (planted, or from a job
    whose model you do not have) is refused by `batchgen retry` until its command line says it again."""
    out, _ = finished_job(tiny_model, tmp_path)
    path = out / "_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"]["engine"]["trust_remote_code"] = True
    path.write_text(json.dumps(manifest))
    refused = run_cli(["retry", str(out), "--kinds", "too_long", "run.too_long=truncate_left"])
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (f"records engine.trust_remote_code=true: batchgen retry runs no code because an output's manifest names "
            f"it; if you trust it, say it again: batchgen retry {out} engine.trust_remote_code=true") in refused.stderr
    assert not (out / "_attempts").exists()
    done = run_cli(["retry", str(out), "--kinds", "too_long", "run.too_long=truncate_left",
                    "engine.trust_remote_code=true"])
    assert done.returncode == 0, done.stderr[-3000:]


DECIDE = '+decide.questions=[{name: bug, kind: predicate, prompt: " Is it a bug?"}]'


def test_a_retry_of_a_decide_output_answers_its_rows_and_a_failed_attempt_does_not_block_the_next(tiny_model,
                                                                                                 tmp_path):
    """task=decide: retry took the question columns for passthrough columns and was refused, and the attempt it had
    written blocked every later retry with other settings. An attempt that committed no part is replaced now."""
    data, long_ids = dataset(tmp_path)
    out = tmp_path / "out"
    summary = run_job(compose_job(job_overrides(tiny_model, data, out, "task=decide", DECIDE, "dataset.id_column=uid",
                                                f"engine.max_model_len={MAX_LEN}", "run.too_long=skip",
                                                "run.max_error_rate=0.9")))
    assert summary.totals.errors == {"too_long": len(long_ids)}
    failed = run_cli(["retry", str(out), "dataset.stop_column=missing"])  # found once the attempt's input is written
    assert failed.returncode == 2 and (out / "_attempts" / "attempt-001" / INPUT_FILE).exists()  # half-written
    done = run_cli(["retry", str(out), "engine.max_model_len=1024"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "committed no part; replaced by this one" in done.stderr
    attempt = out / "_attempts" / "attempt-001"
    assert json.loads((attempt / "_retry.json").read_text())["overrides"] == ["engine.max_model_len=1024"]
    view = latest(out).to_pylist()
    assert [r["id"] for r in view] == [f"r{i:02d}" for i in range(24)] and all(r["error"] is None for r in view)
    assert all(r["bug"]["answer"] in ("yes", "no") and r["topic"] for r in view)
    assert [r["attempt"] for r in view] == [1 if r["id"] in long_ids else 0 for r in view]


def test_an_input_column_named_as_retrys_own_is_refused_at_the_jobs_start(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"uid": "a", "prompt": "a b", ID_COLUMN: "x"}])
    refused = run_cli([*job_args(tiny_model, data, tmp_path / "out")])
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"has a column '{ID_COLUMN}': names starting with '_batchgen_' are batchgen's own" in refused.stderr
    assert not (tmp_path / "out").exists()


def test_retry_prints_plain_lines_and_ends_pointing_at_batchgen_view(tiny_model, tmp_path):
    """The console had the run's INFO log lines (`[time][batchgen.commands.retry][INFO] - attempt 1: ...`) and ended
    on Python's `batchgen.output.view.latest(...)`; now plain lines, INFO only with -v, and the last line says that
    the top-level parts show the latest attempts and names `batchgen view OUTPUT_DIR`."""
    out, _ = finished_job(tiny_model, tmp_path, name="my out")
    done = run_cli(["retry", str(out), "--kinds", "too_long", "run.max_error_rate=1"])  # every row errs again
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[INFO]" not in done.stdout + done.stderr and done.stderr == "", done.stderr[-3000:]
    said = done.stdout.splitlines()
    assert said[0] == f"attempt 1: retrying 6 rows that erred with too_long, in {out}/_attempts/attempt-001"
    assert "published attempt 1:" in done.stdout and "6 of 24 rows still fail (too_long=6)" in done.stdout
    assert "batchgen.output.view" not in done.stdout
    assert said[-1] == (f"the top-level parts now show each row's latest attempt: pd.read_parquet('{out}') reads "
                        f"them; to see them with their attempt: batchgen view '{out}'")
    verbose = run_cli(["retry", "-v", str(out), "run.too_long=truncate_left"])
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "][INFO] - " in verbose.stderr  # the run's log lines, asked for
    assert "0 of 24 rows still fail" in verbose.stdout
    assert verbose.stdout.splitlines()[-1].endswith(f"batchgen view '{out}'")
