"""Table outputs (output.sink=delta|iceberg): every committed part one table transaction, exactly once whatever is
killed where; upserts for retries and nightly increments; schema drift refused or evolved; read back by duckdb,
polars and the formats' own readers. engine=dummy throughout (each sample a function of its request): what is under
test is the committer and the table, not a model."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from batchgen.commands.compose import config_from
from batchgen.commands.retry import main as retry_main
from batchgen.errors import ConfigError
from batchgen.output.view import latest
from batchgen.run.runner import run_job
from tests.conftest import REPO, compose_job, corpus, dummy_overrides, read_output, run_cli, write_parquet

pytest.importorskip("deltalake", reason="the table tests need deltalake (pip install -e '.[dev]')")
pytest.importorskip("pyiceberg", reason="the table tests need pyiceberg (pip install -e '.[dev]')")

TEXTS = corpus(80, seed=41)
KEY = ["id", "sample_index"]
DATA_COLUMNS = ["id", "sample_index", "generation", "finish_reason", "num_prompt_tokens", "num_generated_tokens",
                "seed", "error", "attempt"]


def rows(lo: int, hi: int) -> list[dict]:
    return [{"uid": f"u{i:03d}", "prompt": TEXTS[i]} for i in range(lo, hi)]


def sink_args(kind: str, where: Path, *extra: str) -> list[str]:
    if kind == "delta":
        return ["output.sink=delta", f"output.table={where / 'delta-table'}", *extra]
    return ["output.sink=iceberg", "output.table=nightly.annotations",
            f"output.catalog={{type: sql, uri: 'sqlite:///{where}/catalog.db', warehouse: 'file://{where}/wh'}}",
            *extra]


def args(model: str, data: Path, out: Path, kind: str, where: Path, *extra: str) -> list[str]:
    return dummy_overrides(model, data, out, "dataset.id_column=uid", "run.rows_per_part=8", "sampling=sample",
                           "sampling.n=2", "sampling.max_new_tokens=6", *sink_args(kind, where), *extra)


def read_table(kind: str, where: Path) -> pa.Table:
    if kind == "delta":
        from deltalake import DeltaTable

        return DeltaTable(str(where / "delta-table")).to_pyarrow_table()
    return iceberg_table(where).scan().to_arrow()


def iceberg_table(where: Path):
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog("default", type="sql", uri=f"sqlite:///{where}/catalog.db", warehouse=f"file://{where}/wh")
    return catalog.load_table("nightly.annotations")


def sorted_rows(table: pa.Table, columns: list[str] = DATA_COLUMNS) -> list[dict]:
    table = table.select(columns)
    return sorted(table.to_pylist(), key=lambda r: (r["id"], r["sample_index"], r.get("attempt") or 0))


def with_attempt(table: pa.Table, attempt: int = 0) -> pa.Table:
    if "attempt" in table.column_names:
        return table
    return table.append_column("attempt", pa.array([attempt] * table.num_rows, pa.int32()))


def assert_once(table: pa.Table) -> None:
    keys = table.group_by(KEY).aggregate([([], "count_all")])
    assert pc.max(keys.column("count_all")).as_py() == 1, "a (id, sample_index) is in the table twice"


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_each_part_is_one_transaction_and_the_table_equals_the_parts(tiny_model, tmp_path, kind):
    data = write_parquet(tmp_path / "in.parquet", rows(0, 30))
    summary = run_job(compose_job(args(tiny_model, data, tmp_path / "out", kind, tmp_path)))
    assert summary.state == "done"
    table = read_table(kind, tmp_path)
    assert table.num_rows == 60 and "attempt" in table.column_names
    assert sorted_rows(table) == sorted_rows(with_attempt(read_output(tmp_path / "out")))
    assert_once(table)
    if kind == "delta":
        from deltalake import DeltaTable

        dt = DeltaTable(str(tmp_path / "delta-table"))
        assert dt.version() == 4  # the empty table created (version 0), then 4 parts, 4 commits (versions 1..4)
        job_id = __import__("json").loads((tmp_path / "out" / "_manifest.json").read_text())["job_id"]
        assert all(dt.transaction_version(f"batchgen-{job_id}-part-{k:05d}") == 1 for k in range(4))
    else:
        summaries = [s.summary.additional_properties for s in iceberg_table(tmp_path).metadata.snapshots]
        assert len(summaries) == 4 and all(s["batchgen.txn"].endswith(f"part-{k:05d}") for k, s in
                                           enumerate(sorted(summaries, key=lambda s: s["batchgen.txn"])))
    assert run_job(compose_job(args(tiny_model, data, tmp_path / "out", kind, tmp_path))).state == "already_done"
    assert read_table(kind, tmp_path).num_rows == 60


@pytest.mark.filterwarnings("ignore:Iceberg scan planning")
@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_read_back_by_duckdb_and_polars(tiny_model, tmp_path, kind):
    import duckdb
    import polars as pl

    data = write_parquet(tmp_path / "in.parquet", rows(0, 20))
    run_job(compose_job(args(tiny_model, data, tmp_path / "out", kind, tmp_path)))
    if kind == "delta":
        from deltalake import DeltaTable

        annotations = DeltaTable(str(tmp_path / "delta-table")).to_pyarrow_dataset()  # noqa: F841 - duckdb's scan
        frame = pl.read_delta(str(tmp_path / "delta-table"))
    else:
        annotations = iceberg_table(tmp_path).scan().to_arrow()  # noqa: F841 - duckdb's scan
        frame = pl.scan_iceberg(iceberg_table(tmp_path)).collect()
    got = duckdb.sql("SELECT id, count(*) AS samples, count(DISTINCT sample_index) AS distinct_samples "
                     "FROM annotations GROUP BY id ORDER BY id").fetchall()
    assert got == [(f"u{i:03d}", 2, 2) for i in range(20)]
    expected = sorted_rows(with_attempt(read_output(tmp_path / "out")))
    assert sorted_rows(frame.to_arrow()) == expected


def kill_at(point: str, cli: list[str]) -> None:
    proc = run_cli(cli, env={"BATCHGEN_TEST_KILL_AT": point})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_kill_between_the_part_and_its_table_commit_or_right_after_leaves_each_row_once(tiny_model, tmp_path,
                                                                                          kind):
    data = write_parquet(tmp_path / "in.parquet", rows(0, 30))
    run_job(compose_job(args(tiny_model, data, tmp_path / "clean", kind, tmp_path / "reference")))
    cli = args(tiny_model, data, tmp_path / "out", kind, tmp_path)
    kill_at("part committed before its table commit", cli)  # part 0 in output_dir, not in the table
    assert (tmp_path / "out" / "part-00000.parquet").exists()
    kill_at("part committed to its table", cli)  # the first part committed by this run, in the table
    proc = run_cli(cli)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logs = "".join(p.read_text() for p in (tmp_path / "out").glob("_logs/*/*.log"))
    assert "part 0 is in output_dir but not in the" in logs  # the second run committed it first
    table = read_table(kind, tmp_path)
    assert_once(table)
    assert sorted_rows(table) == sorted_rows(read_table(kind, tmp_path / "reference"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_random_sigkills_resumed_leave_the_table_equal_to_an_uninterrupted_run(tiny_model, tmp_path, kind):
    data = write_parquet(tmp_path / "in.parquet", rows(0, 48))
    run_job(compose_job(args(tiny_model, data, tmp_path / "clean", kind, tmp_path / "reference")))
    cli = args(tiny_model, data, tmp_path / "out", kind, tmp_path, "run.rows_per_part=4",
               "+engine.extra_args.delay_s=0.002")
    env = os.environ | {"BATCHGEN_TEST_CRASH_WINDOW_S": "0.01", "PYTHONUNBUFFERED": "1"}
    rng = random.Random(11)
    kills = 0
    while kills < 5:
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", *cli], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.8, 2.5))  # start-up is about 1 s: some kills land before the first part
        if proc.poll() is not None:
            break
        proc.kill()
        proc.wait()
        kills += 1
    proc = run_cli(cli)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = read_table(kind, tmp_path)
    assert_once(table)
    assert sorted_rows(table) == sorted_rows(read_table(kind, tmp_path / "reference"))
    print(f"{kind}: {kills} SIGKILLs, table of {table.num_rows} rows equal to the uninterrupted run's")


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_two_shards_committing_at_once_lose_and_double_no_part(tiny_model, tmp_path, kind):
    data = write_parquet(tmp_path / "in.parquet", rows(0, 40))
    procs = [subprocess.Popen([sys.executable, "-m", "batchgen",
                               *args(tiny_model, data, tmp_path / "out", kind, tmp_path, "run.rows_per_part=2",
                                     "run.num_shards=2", f"run.shard={shard}")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for shard in (0, 1)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    table = read_table(kind, tmp_path)
    assert table.num_rows == 80
    assert_once(table)
    assert sorted_rows(table) == sorted_rows(with_attempt(read_output(tmp_path / "out")))


MAX_LEN = 64


def long_prompt(i: int) -> str:
    return " ".join(" ".join(corpus(40, seed=500 + i)).split()[:150])


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_upsert_a_retry_replaces_error_rows_and_the_table_is_the_latest_attempt_view(tiny_model, tmp_path, kind):
    rows_in = rows(0, 20)
    for i in (3, 11, 12):
        rows_in[i]["prompt"] = long_prompt(i)  # too long for MAX_LEN: error rows, mended by a retry
    data = write_parquet(tmp_path / "in.parquet", rows_in)
    out = tmp_path / "out"
    summary = run_job(compose_job(args(tiny_model, data, out, kind, tmp_path, "output.mode=upsert",
                                       f"engine.max_model_len={MAX_LEN}", "run.too_long=skip",
                                       "run.max_error_rate=0.5")))
    assert summary.totals.errors == {"too_long": 3}
    before = read_table(kind, tmp_path)
    assert pc.sum(pc.is_valid(before.column("error"))).as_py() == 6  # 3 rows, 2 samples each
    assert retry_main([str(out), "--kinds", "too_long", "engine.max_model_len=2000"], config_from) == 0
    table = read_table(kind, tmp_path)
    assert table.num_rows == 40 and pc.sum(pc.is_valid(table.column("error"))).as_py() == 0
    assert_once(table)
    assert sorted(set(pc.filter(table, pc.equal(table.column("attempt"), 1)).column("id").to_pylist())) == \
        ["u003", "u011", "u012"]
    assert sorted_rows(table) == sorted_rows(latest(out))


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_upsert_a_second_night_appends_only_its_new_ids(tiny_model, tmp_path, kind):
    first = write_parquet(tmp_path / "day1.parquet", rows(0, 24))
    second = write_parquet(tmp_path / "day2.parquet", rows(0, 36))  # yesterday's 24 rows and 12 new ones
    run_job(compose_job(args(tiny_model, first, tmp_path / "night1", kind, tmp_path, "output.mode=upsert")))
    night1 = read_table(kind, tmp_path)
    run_job(compose_job(args(tiny_model, second, tmp_path / "night2", kind, tmp_path, "output.mode=upsert",
                             f"run.skip_existing={tmp_path / 'night1'}")))
    table = read_table(kind, tmp_path)
    assert table.num_rows == 72
    assert_once(table)
    assert sorted_rows(table)[:48] == sorted_rows(night1)  # yesterday's rows untouched (ids sort before)
    union = pa.concat_tables([with_attempt(read_output(tmp_path / "night1")),
                              with_attempt(read_output(tmp_path / "night2"))])
    assert sorted_rows(table) == sorted_rows(union)


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_schema_drift_is_refused_naming_the_columns_unless_add_columns(tiny_model, tmp_path, kind):
    data = write_parquet(tmp_path / "in.parquet", rows(0, 10))
    run_job(compose_job(args(tiny_model, data, tmp_path / "night1", kind, tmp_path)))
    drift = args(tiny_model, data, tmp_path / "night2", kind, tmp_path, "output.usage=true")
    with pytest.raises(ConfigError, match="no columns cached_prompt_tokens, reasoning_tokens, latency_s: set "
                                          "output.schema_evolution=add_columns"):
        run_job(compose_job(drift))
    assert read_table(kind, tmp_path).num_rows == 20  # the table unchanged
    proc = run_cli(drift)  # the part is committed in output_dir; a rerun is refused the same way, exit 2
    assert proc.returncode == 2 and "latency_s" in proc.stderr
    run_job(compose_job([*drift, "output.schema_evolution=add_columns"]))
    table = read_table(kind, tmp_path)
    assert table.num_rows == 40 and "latency_s" in table.column_names
    assert table.filter(pc.is_null(table.column("latency_s"))).num_rows == 20  # night 1's rows: null


def test_a_column_of_another_type_is_refused(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", rows(0, 10))
    carried = "dataset.passthrough_columns=[uid]"  # the id column too (by default `id` alone carries it)
    run_job(compose_job(args(tiny_model, data, tmp_path / "night1", "delta", tmp_path, carried)))
    other = write_parquet(tmp_path / "other.parquet", [{"uid": i, "prompt": TEXTS[i]} for i in range(10)])
    with pytest.raises(ConfigError, match=r"other types for columns: uid \(int64 here, string in the table\)"):
        run_job(compose_job(args(tiny_model, other, tmp_path / "night2", "delta", tmp_path, carried,
                                 "output.schema_evolution=add_columns")))


def test_upsert_refuses_a_part_with_a_repeated_id(tiny_model, tmp_path):
    rows_in = rows(0, 6)
    rows_in[4]["uid"] = rows_in[1]["uid"]
    data = write_parquet(tmp_path / "in.parquet", rows_in)
    proc = run_cli(args(tiny_model, data, tmp_path / "out", "delta", tmp_path, "output.mode=upsert"))
    assert proc.returncode == 1 and "appears more than once" in proc.stderr and "u001" in proc.stderr


def test_delta_on_s3(s3, tiny_model, tmp_path):
    fs, env = s3
    data = write_parquet(tmp_path / "in.parquet", rows(0, 20))
    options = (f"output.storage_options={{AWS_ENDPOINT_URL: '{env['FSSPEC_S3_ENDPOINT_URL']}', "
               f"AWS_ALLOW_HTTP: 'true', AWS_REGION: us-east-1}}")
    cli = dummy_overrides(tiny_model, data, "s3://bucket/tables-out", "dataset.id_column=uid", "run.rows_per_part=8",
                          "output.sink=delta", "output.table=s3://bucket/tables/annotations", options)
    kill_at("part committed before its table commit", cli)
    proc = run_cli(cli)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from deltalake import DeltaTable

    storage = {"AWS_ENDPOINT_URL": env["FSSPEC_S3_ENDPOINT_URL"], "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1"}
    table = DeltaTable("s3://bucket/tables/annotations", storage_options=storage).to_pyarrow_table()
    assert table.num_rows == 20
    assert_once(table)
    run_job(compose_job(dummy_overrides(tiny_model, data, tmp_path / "clean", "dataset.id_column=uid",
                                        "run.rows_per_part=8")))
    assert sorted_rows(table) == sorted_rows(with_attempt(read_output(tmp_path / "clean")))


def test_status_names_the_table(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", rows(0, 10))
    run_job(compose_job(args(tiny_model, data, tmp_path / "out", "delta", tmp_path)))
    proc = run_cli(["status", str(tmp_path / "out")])
    assert proc.returncode == 0
    assert f"table: delta {tmp_path / 'delta-table'}, 2 of 2 parts committed" in proc.stdout


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_view_and_report_read_the_table_output(tiny_model, tmp_path, kind):
    import json

    data = write_parquet(tmp_path / "in.parquet", rows(0, 10))
    run_job(compose_job(args(tiny_model, data, tmp_path / "out", kind, tmp_path)))
    proc = run_cli(["view", str(tmp_path / "out"), "--table", "--columns", "id,sample_index,generation"])
    assert proc.returncode == 0, proc.stderr
    got = sorted((r["id"], r["sample_index"], r["generation"]) for r in map(json.loads, proc.stdout.splitlines()))
    table = read_table(kind, tmp_path)
    assert got == sorted(zip(*(table.column(c).to_pylist() for c in ("id", "sample_index", "generation"))))
    assert run_cli(["report", str(tmp_path / "out")]).returncode == 0
    page = next((tmp_path / "out").glob("_report*.html")).read_text()
    assert "table output" in page and "2 of 2 parts committed" in page


@pytest.mark.parametrize("mode", ["append", "upsert"])
@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_commit_that_loses_a_race_is_retried_against_the_table_as_it_then_is(tmp_path, kind, mode, caplog):
    """Output b commits its part against the table as it was before output a's commit landed (a stale snapshot,
    as a shard or Ray worker racing another has): both parts end in the table once."""
    from batchgen.job import OutputConfig
    from batchgen.output.tables import open_sink

    catalog = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"{tmp_path}/wh"}
    composed = OutputConfig(sink=kind, mode=mode, **({"table": str(tmp_path / "delta-table")} if kind == "delta" else
                                                     {"table": "nightly.annotations", "catalog": catalog}))

    def part(prefix: str) -> pa.Table:
        return pa.table({"id": [f"{prefix}{i}" for i in range(4)], "sample_index": pa.array([0] * 4, pa.int32()),
                         "generation": [f"text {prefix}{i}" for i in range(4)]})

    a, b = open_sink(composed, "job-a"), open_sink(composed, "job-b")
    a.commit(0, part("x"), 0)  # the table exists
    stale = b._load()
    a.commit(1, part("y"), 0)
    loads = iter([stale])
    fresh = b._load
    b._load = lambda: next(loads, None) or fresh()
    with caplog.at_level("INFO"):
        b.commit(0, part("z"), 0)
    table = read_table(kind, tmp_path)
    assert sorted(table.column("id").to_pylist()) == sorted([f"{p}{i}" for p in "xyz" for i in range(4)])
    assert b.known == {0} and b.commits == 1
    if kind == "iceberg":  # the catalog refuses a commit on stale metadata: pyiceberg retries it (0.12), else batchgen
        assert "concurrent update, retrying" in caplog.text or "lost a race" in caplog.text


def test_two_first_commits_creating_the_iceberg_namespace_at_once_both_land(tmp_path):
    """The SQL catalog checks that a namespace is missing, then inserts it: two shards' first commits can both pass
    the check (forced here: the other's namespace lands in between) and the second insert fails on the catalog's
    unique key. The namespace exists then, so the commit goes on."""
    from batchgen.job import OutputConfig
    from batchgen.output.tables import open_sink

    catalog = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"{tmp_path}/wh"}
    composed = OutputConfig(sink="iceberg", table="nightly.annotations", catalog=catalog)
    a, b = open_sink(composed, "job-a"), open_sink(composed, "job-b")
    a.catalog.create_namespace("nightly")  # the other shard's, between b's check and b's insert
    exists, checks = b.catalog.namespace_exists, []

    def checked_before_it_landed(namespace):  # b's first check ran before a's namespace landed
        checks.append(namespace)
        return len(checks) > 1 and exists(namespace)

    b.catalog.namespace_exists = checked_before_it_landed
    b.commit(0, pa.table({"id": ["z0", "z1"], "sample_index": pa.array([0, 0], pa.int32()),
                          "generation": ["a", "b"]}), 0)
    assert sorted(read_table("iceberg", tmp_path).column("id").to_pylist()) == ["z0", "z1"] and len(checks) > 1


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_upsert_replaces_only_the_samples_it_carries(tmp_path, kind):
    """A part carrying sample 1 of an id replaces that sample only; the id's sample 0 stays as it was, other ids
    are untouched, new keys are appended."""
    from batchgen.job import OutputConfig
    from batchgen.output.tables import open_sink

    catalog = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"{tmp_path}/wh"}
    output = OutputConfig(sink=kind, mode="upsert", **({"table": str(tmp_path / "delta-table")} if kind == "delta"
                                                       else {"table": "nightly.annotations", "catalog": catalog}))
    sink = open_sink(output, "job")

    def part(keys: list[tuple[str, int]], text: str) -> pa.Table:
        return pa.table({"id": [k for k, _ in keys], "sample_index": pa.array([s for _, s in keys], pa.int32()),
                         "generation": [f"{text} {k}{s}" for k, s in keys]})

    sink.commit(0, part([("a", 0), ("a", 1), ("b", 0), ("b", 1)], "old"), 0)
    sink.commit(1, part([("a", 1), ("c", 0)], "new"), 1)
    got = sorted(zip(*(read_table(kind, tmp_path).column(c).to_pylist() for c in ("id", "sample_index",
                                                                                 "generation", "attempt"))))
    assert got == [("a", 0, "old a0", 0), ("a", 1, "new a1", 1), ("b", 0, "old b0", 0), ("b", 1, "old b1", 0),
                   ("c", 0, "new c0", 1)]


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_resume_skips_the_parts_the_table_holds_whose_files_output_dir_lost(tiny_model, tmp_path, kind):
    data = write_parquet(tmp_path / "in.parquet", rows(0, 30))
    cli = args(tiny_model, data, tmp_path / "out", kind, tmp_path)
    first = run_job(compose_job(cli))
    (tmp_path / "out" / "part-00001.parquet").unlink()  # a lost file (another machine's staging, a cleanup)
    (tmp_path / "out" / "_SUCCESS").unlink()
    again = run_job(compose_job(cli))
    assert again.state == "done" and again.generated_tokens == 0  # part 1 is in the table: nothing generated
    assert again.totals.rows == first.totals.rows == 30 and again.totals.samples == 60  # its counts from the table
    table = read_table(kind, tmp_path)
    assert table.num_rows == 60
    assert_once(table)
