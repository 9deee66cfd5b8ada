"""The committer on its own: assemble restores input order from results in any order, commit writes one part
atomically with the contract's schema and its counts, committed/clean_stale/finish read and tidy the directory."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import BatchgenError
from batchgen.output import committer as committer_mod
from batchgen.output.committer import Committer, OutputWriteError
from batchgen.output.rows.assemble import assemble
from batchgen.output.rows.schema import OUTPUT_COLUMNS
from batchgen.output.rows.stats import PartStats, stats_of
from batchgen.reader.values import JSON_TEXT
from batchgen.records import Part, PlannedPart, Result

CONTRACT_SCHEMA = [("id", pa.string()), ("sample_index", pa.int32()), ("generation", pa.string()),
                   ("finish_reason", pa.string()), ("num_prompt_tokens", pa.int32()),
                   ("num_generated_tokens", pa.int32()), ("seed", pa.int64()), ("error", pa.string())]
META = {"batchgen.config_hash": "cafe0123", "batchgen.model": json.dumps({"model": "m"})}


def make_part(index: int = 7, rows: int = 4) -> Part:
    """Rows with an int, a list and a JSON-text (mixed JSONL types) column besides the prompt."""
    schema = pa.schema([pa.field("prompt", pa.string()), pa.field("score", pa.int64()),
                        pa.field("tags", pa.list_(pa.string())), pa.field("mixed", pa.string(), metadata=JSON_TEXT)])
    table = pa.Table.from_arrays([
        pa.array([f"p{i}" for i in range(rows)]), pa.array([i * 10 for i in range(rows)], pa.int64()),
        pa.array([[f"t{i}"] * i for i in range(rows)], pa.list_(pa.string())),
        pa.array([json.dumps(v) for v in [1, "a", None, [2]]][:rows])], schema=schema)
    return Part(index=index, start=index * rows, table=table, ids=[f"id{index}-{i}" for i in range(rows)],
                read_errors=[None] * rows)


def planned_of(part: Part, n: int, errors: dict[int, str] | None = None) -> PlannedPart:
    errors = errors or {}
    row_errors = [errors.get(row) for row in range(part.num_rows)]
    seeds = [1000 * row + s for row in range(part.num_rows) for s in range(n)]
    return PlannedPart(part=part, requests=[], errors=row_errors, seeds=seeds, n=n)


def results_for(planned: PlannedPart, *, shuffle_seed: int = 0) -> list[Result]:
    n = planned.n
    out = [Result(key=row * n + s, text=f"gen {row}.{s}", finish_reason="stop" if s % 2 else "length",
                  num_prompt_tokens=5 + row, num_generated_tokens=s + 1)
           for row in range(planned.part.num_rows) if planned.errors[row] is None for s in range(n)]
    random.Random(shuffle_seed).shuffle(out)
    return out


# -- assemble --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle_seed", [0, 1, 2])
def test_assemble_restores_input_order_with_samples_consecutive(shuffle_seed):
    planned = planned_of(make_part(), n=3)
    rows = assemble(planned, results_for(planned, shuffle_seed=shuffle_seed))
    assert [(r.row, r.id, r.sample_index) for r in rows] == [
        (row, f"id7-{row}", s) for row in range(4) for s in range(3)]
    assert [r.generation for r in rows] == [f"gen {row}.{s}" for row in range(4) for s in range(3)]
    assert [r.seed for r in rows] == planned.seeds
    assert [r.num_generated_tokens for r in rows] == [s + 1 for _ in range(4) for s in range(3)]
    assert all(r.error is None and r.finish_reason in ("stop", "length") for r in rows)


def test_an_error_row_gets_one_error_row_per_sample_with_its_planned_seed():
    planned = planned_of(make_part(), n=2, errors={1: "empty_prompt", 3: "too_long: 9 > 8"})
    rows = assemble(planned, results_for(planned))
    assert len(rows) == 8
    for r in rows:
        if r.row in (1, 3):
            assert (r.finish_reason, r.generation) == ("error", None)
            assert (r.num_prompt_tokens, r.num_generated_tokens) == (0, 0)
            assert r.error == planned.errors[r.row] and r.seed == planned.seeds[r.row * 2 + r.sample_index]
        else:
            assert r.error is None and r.generation == f"gen {r.row}.{r.sample_index}"


def test_a_missing_result_raises_naming_the_part_and_row():
    planned = planned_of(make_part(), n=2)
    results = [r for r in results_for(planned) if r.key != 5]  # row 2, sample 1
    with pytest.raises(BatchgenError, match=r"part 7: .*no result for row 'id7-2' sample 1"):
        assemble(planned, results)


def test_an_unknown_result_key_raises_naming_the_part():
    planned = planned_of(make_part(), n=2)
    extra = Result(key=99, text="x", finish_reason="stop", num_prompt_tokens=1, num_generated_tokens=1)
    with pytest.raises(BatchgenError, match=r"part 7: .*unknown requests \[99\]"):
        assemble(planned, results_for(planned) + [extra])


def test_a_result_for_an_error_row_is_unknown():
    """An error row was never requested: a result under its key means the engine and the plan disagree."""
    planned = planned_of(make_part(), n=1, errors={2: "empty_prompt"})
    stray = Result(key=2, text="x", finish_reason="stop", num_prompt_tokens=1, num_generated_tokens=1)
    with pytest.raises(BatchgenError, match=r"part 7: .*unknown requests \[2\]"):
        assemble(planned, results_for(planned) + [stray])


def test_stats_count_error_rows_once_per_row_and_prompt_tokens_once_per_row():
    part = make_part()
    planned = planned_of(part, n=3, errors={0: "empty_prompt", 2: "too_long: x"})
    stats = stats_of(part, assemble(planned, results_for(planned)))
    assert stats == PartStats(rows=4, samples=12, errors={"empty_prompt": 1, "too_long": 1},
                              prompt_tokens=(5 + 1) + (5 + 3), generated_tokens=2 * (1 + 2 + 3))
    assert stats.error_rows == 2


# -- commit ----------------------------------------------------------------------------------------------------


def committer_in(tmp_path, passthrough=("score", "tags", "mixed")) -> Committer:
    return Committer(tmp_path, passthrough=list(passthrough), metadata=dict(META))


def commit_part(c: Committer, index: int = 7, n: int = 2, errors: dict[int, str] | None = None):
    part = make_part(index)
    planned = planned_of(part, n=n, errors=errors)
    rows = assemble(planned, results_for(planned))
    return part, rows, c.commit(part, rows)


def test_commit_writes_the_part_under_its_final_name_and_nothing_else(tmp_path):
    c = committer_in(tmp_path)
    commit_part(c)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-00007.parquet"]
    assert c.part_path(7) == tmp_path / "part-00007.parquet"


def test_the_committed_file_has_the_contract_schema_then_passthrough_columns(tmp_path):
    c = committer_in(tmp_path)
    part, rows, _ = commit_part(c, errors={1: "empty_prompt"})
    table = pq.read_table(tmp_path / "part-00007.parquet")
    assert table.column_names == [*OUTPUT_COLUMNS, "score", "tags", "mixed"]
    assert [(f.name, f.type) for f in table.schema][:8] == CONTRACT_SCHEMA
    assert [f.type for f in table.schema][8:] == [pa.int64(), pa.list_(pa.string()), pa.string()]
    assert table.schema.field("mixed").metadata == JSON_TEXT  # a JSON-text column stays marked as such
    assert not table.schema.field("id").nullable and table.schema.field("generation").nullable
    assert table.column("id").to_pylist() == [r.id for r in rows]
    assert table.column("sample_index").to_pylist() == [0, 1] * 4
    assert table.column("generation").to_pylist() == [r.generation for r in rows]
    assert table.column("finish_reason").to_pylist()[2:4] == ["error", "error"]
    assert table.column("error").to_pylist()[2:4] == ["empty_prompt", "empty_prompt"]
    assert table.column("seed").to_pylist() == [r.seed for r in rows]
    assert table.column("score").to_pylist() == [0, 0, 10, 10, 20, 20, 30, 30]  # each sample carries its row's
    assert table.column("tags").to_pylist()[6] == ["t3", "t3", "t3"]
    assert table.column("mixed").to_pylist()[:4] == ['1', '1', '"a"', '"a"']


def test_the_committed_file_carries_its_index_stats_and_the_run_metadata(tmp_path):
    c = committer_in(tmp_path)
    part, rows, stats = commit_part(c, errors={0: "bad_template: x", 3: "bad_template: y"})
    meta = pq.read_metadata(c.part_path(7)).metadata
    assert meta[b"batchgen.part"] == b"7"
    assert meta[b"batchgen.config_hash"] == b"cafe0123" and json.loads(meta[b"batchgen.model"]) == {"model": "m"}
    assert json.loads(meta[b"batchgen.stats"])["errors"] == {"bad_template": 2}
    assert c.read_stats(7) == stats == stats_of(part, rows)
    assert stats.rows == 4 and stats.samples == 8


def test_committed_lists_final_part_names_only(tmp_path):
    c = committer_in(tmp_path)
    commit_part(c, 0)
    commit_part(c, 3)
    for leftover in (".part-00005.parquet.tmp-123", "_part-00005.journal", "part-1.parquet", "part-00006.parquet.x",
                     "_manifest.json", "_SUCCESS"):
        (tmp_path / leftover).write_bytes(b"")
    assert c.committed() == {0, 3}


def test_commit_without_passthrough_has_just_the_output_columns(tmp_path):
    c = committer_in(tmp_path, passthrough=())
    commit_part(c, 2)
    assert pq.read_table(c.part_path(2)).column_names == list(OUTPUT_COLUMNS)


class Killed(BaseException):
    """Stands for the process dying mid-write (not an OSError: nothing in the committer may catch it)."""


def test_a_failed_write_leaves_no_file_and_reports_the_path(tmp_path, monkeypatch):
    def half_write(table, f, **kw):
        f.write(b"PAR1 half a part")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(committer_mod.pq, "write_table", half_write)
    c = committer_in(tmp_path)
    with pytest.raises(OutputWriteError, match=r"part-00007\.parquet: No space left"):
        commit_part(c)
    assert list(tmp_path.iterdir()) == [] and c.committed() == set()


def test_a_failed_rename_leaves_no_file_under_the_final_name(tmp_path, monkeypatch):
    def no_rename(tmp, final):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(committer_mod, "replace_durably", no_rename)
    c = committer_in(tmp_path)
    with pytest.raises(OutputWriteError):
        commit_part(c)
    assert list(tmp_path.iterdir()) == []


def test_a_kill_mid_write_leaves_only_a_temp_file_that_clean_stale_removes(tmp_path, monkeypatch):
    def killed_write(table, f, **kw):
        f.write(b"PAR1 torn")
        raise Killed

    c = committer_in(tmp_path)
    with monkeypatch.context() as m:
        m.setattr(committer_mod.pq, "write_table", killed_write)
        with pytest.raises(Killed):
            commit_part(c)
    names = [p.name for p in tmp_path.iterdir()]
    assert "part-00007.parquet" not in names and c.committed() == set()
    assert len(names) == 1 and committer_mod.TMP_PART_RE.match(names[0])
    c.clean_stale(lambda k: True)
    assert list(tmp_path.iterdir()) == []
    commit_part(c)  # the rerun commits the part
    assert c.committed() == {7} and pq.read_table(c.part_path(7)).num_rows == 8


def test_a_kill_before_the_rename_leaves_a_whole_temp_file_and_no_final_one(tmp_path, monkeypatch):
    """Killed after the temp file is complete but before the rename: no final file, the temp one is whole."""
    def killed(tmp, final):
        raise Killed

    monkeypatch.setattr(committer_mod, "replace_durably", killed)
    c = committer_in(tmp_path)
    with pytest.raises(Killed):
        commit_part(c)
    (tmp,) = tmp_path.iterdir()
    assert committer_mod.TMP_PART_RE.match(tmp.name) and c.committed() == set()
    assert pq.read_table(tmp).num_rows == 8


# -- clean_stale, write_empty, finish -------------------------------------------------------------------------


def test_clean_stale_removes_own_temp_parts_and_journals_of_committed_parts_only(tmp_path):
    c = committer_in(tmp_path)
    commit_part(c, 2)
    files = {
        ".part-00000.parquet.tmp-11": False,  # shard 0's (mine): removed
        ".part-00001.parquet.tmp-11": True,  # shard 1's: kept
        "_part-00002.journal": False,  # its part is committed: removed
        "_part-00004.journal": True,  # its part is not: kept, the resume reuses it
        "._status.json.tmp-11": False,  # a temp copy of my own status file
        "._status.shard-00001.json.tmp-11": True,  # another shard's status file's temp copy
        "_manifest.json": True,
    }
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    c.clean_stale(lambda k: k % 2 == 0, ("_status.json",))
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {name for name, kept in files.items() if kept} | {"part-00002.parquet"}


def test_clean_stale_removes_a_temp_journal_of_its_own_parts(tmp_path):
    c = committer_in(tmp_path)
    (tmp_path / "._part-00004.journal.tmp-11").write_bytes(b"x")
    c.clean_stale(lambda k: k % 2 == 0)
    assert list(tmp_path.iterdir()) == []


def test_clean_stale_keeps_another_shards_temp_journal(tmp_path):
    c = committer_in(tmp_path)
    (tmp_path / "._part-00001.journal.tmp-11").write_bytes(b"x")  # part 1 belongs to shard 1 of 2
    c.clean_stale(lambda k: k % 2 == 0)
    assert (tmp_path / "._part-00001.journal.tmp-11").exists()


def test_write_empty_gives_one_readable_part_with_the_schema_and_no_row_group(tmp_path):
    c = committer_in(tmp_path)
    c.write_empty([pa.field("score", pa.int64())])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-00000.parquet"]
    pf = pq.ParquetFile(c.part_path(0))
    assert pf.metadata.num_rows == 0 and pf.metadata.num_row_groups == 0
    schema = pf.schema_arrow
    assert [(f.name, f.type) for f in schema] == [*CONTRACT_SCHEMA, ("score", pa.int64())]
    assert schema.metadata[b"batchgen.config_hash"] == b"cafe0123"
    assert c.committed() == {0} and c.read_stats(0) == PartStats()


def test_finish_writes_success_only_once_every_part_is_committed(tmp_path):
    c = committer_in(tmp_path)
    for k in (0, 1, 3):
        commit_part(c, k)
    (tmp_path / ".part-00002.parquet.tmp-5").write_bytes(b"x")  # in flight is not committed
    assert c.finish(4) is False and not (tmp_path / "_SUCCESS").exists()
    commit_part(c, 2)
    assert c.finish(5) is False and not (tmp_path / "_SUCCESS").exists()
    assert c.finish(4) is True and (tmp_path / "_SUCCESS").exists()
