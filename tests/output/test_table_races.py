"""Table outputs written by two outputs at once (two jobs, two shards, Ray workers): the table's creation and every
part's commit race another writer's. Invariants: each (id, sample_index) once in an upsert table, every part once in
an append table, whichever writer created the table and whichever commit landed first. Forced interleavings (one
writer's view of the table taken before the other's commit landed) and real concurrent runs, repeated."""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from tests.output.test_tables import KEY, read_table

pytest.importorskip("deltalake", reason="the table tests need deltalake (pip install -e '.[dev]')")
pytest.importorskip("pyiceberg", reason="the table tests need pyiceberg (pip install -e '.[dev]')")

IDS = 100  # the same ids in both writers' parts
PART_ROWS = 20


def sink(kind: str, where: Path, mode: str, job_id: str):
    from batchgen.job import OutputConfig
    from batchgen.output.tables import open_sink

    catalog = {"type": "sql", "uri": f"sqlite:///{where}/catalog.db", "warehouse": f"{where}/wh"}
    table = {"table": str(where / "delta-table")} if kind == "delta" else {"table": "nightly.annotations",
                                                                          "catalog": catalog}
    return open_sink(OutputConfig(sink=kind, mode=mode, **table), job_id)


def part(index: int, writer: str, *, prefix: str = "u") -> pa.Table:
    ids = range(index * PART_ROWS, (index + 1) * PART_ROWS)
    return pa.table({"id": [f"{prefix}{i:03d}" for i in ids], "sample_index": pa.array([0] * PART_ROWS, pa.int32()),
                     "generation": [f"{writer} {i}" for i in ids]})


def keys_counted(table: pa.Table) -> dict[int, int]:
    """How many keys the table holds once, twice, ...: {1: 200} is each key once."""
    counts = table.group_by(KEY).aggregate([([], "count_all")]).column("count_all").to_pylist()
    return {n: counts.count(n) for n in sorted(set(counts))}


def stale_once(writer, view):
    """The writer's next look at the table sees `view` (taken before another writer's commit landed), later ones the
    table as it then is."""
    fresh, views = writer._load, [view]
    writer._load = lambda: views.pop() if views else fresh()


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_an_upsert_that_saw_no_table_merges_into_the_one_another_output_created(tmp_path, kind):
    """b looked before a's first commit created the table: b's first part is merged into a's table, not appended."""
    a, b = sink(kind, tmp_path, "upsert", "job-a"), sink(kind, tmp_path, "upsert", "job-b")
    stale_once(b, None)
    a.commit(0, part(0, "a"), 0)
    b.commit(0, part(0, "b"), 0)
    table = read_table(kind, tmp_path)
    assert keys_counted(table) == {1: PART_ROWS}
    assert set(table.column("generation").to_pylist()) == {f"b {i}" for i in range(PART_ROWS)}  # b's landed last
    assert a.known == b.known == {0}


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_an_upsert_read_before_another_outputs_commit_of_the_same_keys_merges_them(tmp_path, kind):
    """The table exists; b read it before a's commit of the same new keys landed: b's commit is merged against the
    table as it then is (a conflict retried), not appended beside a's rows."""
    a, b = sink(kind, tmp_path, "upsert", "job-a"), sink(kind, tmp_path, "upsert", "job-b")
    a.commit(0, part(0, "a", prefix="x"), 0)
    stale_once(b, b._load())
    a.commit(1, part(0, "a"), 0)
    b.commit(0, part(0, "b"), 0)
    table = read_table(kind, tmp_path)
    assert keys_counted(table) == {1: 2 * PART_ROWS}
    assert b.known == {0} and b.commits == 1


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_an_append_that_saw_no_table_loses_no_part(tmp_path, kind):
    a, b = sink(kind, tmp_path, "append", "job-a"), sink(kind, tmp_path, "append", "job-b")
    stale_once(b, None)
    a.commit(0, part(0, "a"), 0)
    b.commit(0, part(1, "b"), 0)
    assert keys_counted(read_table(kind, tmp_path)) == {1: 2 * PART_ROWS}


def write_at_once(kind: str, where: Path, mode: str, ids: dict[str, range]) -> None:
    """Two outputs, each committing its parts (ids[writer]: their numbers) from its own thread, started together
    into a table that does not exist yet."""
    start, failures = threading.Barrier(len(ids)), []
    if kind == "iceberg":
        _ = sink(kind, where, mode, "job-first").catalog  # the catalog's own first use at once: the test below's

    def write(writer: str) -> None:
        try:
            out = sink(kind, where, mode, f"job-{writer}")
            start.wait()
            for k in ids[writer]:
                out.commit(k, part(k, writer), 0)
        except Exception as exc:  # noqa: BLE001 - reported by the test below
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_two_outputs_upserting_the_same_ids_into_a_new_table_at_once_hold_each_key_once(tmp_path, kind):
    for round_ in range(4):
        where = tmp_path / f"round-{round_}"
        write_at_once(kind, where, "upsert", {"a": range(IDS // PART_ROWS), "b": range(IDS // PART_ROWS)})
        assert keys_counted(read_table(kind, where)) == {1: IDS}, f"round {round_}"


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_two_outputs_appending_to_a_new_table_at_once_lose_no_part(tmp_path, kind):
    for round_ in range(3):
        where = tmp_path / f"round-{round_}"
        write_at_once(kind, where, "append", {"a": range(0, 5), "b": range(5, 10)})
        table = read_table(kind, where)
        assert keys_counted(table) == {1: 10 * PART_ROWS}, f"round {round_}"
        assert pc.count_distinct(table.column("generation")).as_py() == 10 * PART_ROWS


def test_two_first_uses_of_a_new_sql_catalog_at_once_both_load_it(tmp_path):
    """The SQL catalog's first use creates its own tables, checking first: two writers' first uses at once can both
    pass the check, and the second's CREATE TABLE fails; the tables exist then, so the catalog loads."""
    for round_ in range(5):
        failures = load_at_once(tmp_path / f"round-{round_}")
        assert not failures, f"round {round_}: {failures}"


def load_at_once(where: Path) -> list[Exception]:
    """Two writers' first uses of a new SQL catalog at once; what they raised."""
    where.mkdir()
    start, failures = threading.Barrier(2), []

    def load(writer: str) -> None:
        try:
            out = sink("iceberg", where, "append", f"job-{writer}")
            start.wait()
            out.catalog.list_namespaces()
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=load, args=(w,)) for w in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return failures
