"""reader/base.py: rows numbered across files, dataset.limit, row ids (given or `<file>:<row>`), the fingerprint."""

from __future__ import annotations

import os
import shutil

import fsspec
import pyarrow as pa

from batchgen.reader import DatasetConfig, Reader, open_reader
from tests.conftest import write_jsonl, write_parquet
from tests.reader.conftest import read_all


class TableReader(Reader):
    """The base alone: each "file" is a list of ready tables, under the root /data."""

    def __init__(self, cfg: DatasetConfig, tables: dict[str, list[pa.Table]]):
        super().__init__(cfg, list(tables), fsspec.filesystem("file"), "/data")
        self.tables = tables

    def columns(self) -> list[str]:
        return ["k"]

    def _file_batches(self, path):
        for table in self.tables[path]:
            yield table, [None] * table.num_rows


def keys(*values) -> pa.Table:
    return pa.table({"k": pa.array(values, pa.int64())})


TABLES = {"/data/a.parquet": [keys(1, 2), keys(3)], "/data/sub/b.parquet": [keys(None, 5, 6)]}


def batches(reader: Reader) -> list[tuple[int, list[str], list]]:
    return [(b.start, b.ids, b.table.column("k").to_pylist()) for b in reader.iter_batches()]


def test_glob_limit_and_id_column(tmp_path):
    for k in range(3):
        write_parquet(tmp_path / f"x{k}.parquet", [{"key": 10 * k + i, "prompt": "p"} for i in range(4)])
    ids, _, _ = read_all(DatasetConfig(path=str(tmp_path / "x*.parquet"), id_column="key", limit=6, batch_rows=3))
    assert ids == ["0", "1", "2", "3", "10", "11"]


def test_rows_are_numbered_across_files_and_ids_count_from_each_files_first_row():
    reader = TableReader(DatasetConfig(path="unused"), TABLES)
    assert batches(reader) == [(0, ["a.parquet:0", "a.parquet:1"], [1, 2]), (2, ["a.parquet:2"], [3]),
                               (3, ["sub/b.parquet:0", "sub/b.parquet:1", "sub/b.parquet:2"], [None, 5, 6])]
    assert reader.rows_read == 6
    assert reader.count_rows() is None  # the base knows no cheap count


def test_an_id_column_gives_the_ids_and_a_null_id_falls_back_to_the_generated_one():
    reader = TableReader(DatasetConfig(path="unused", id_column="k"), TABLES)
    assert [ids for _, ids, _ in batches(reader)] == [["1", "2"], ["3"], ["sub/b.parquet:0", "5", "6"]]


def test_limit_cuts_mid_batch_and_stops_before_the_next_file():
    assert batches(TableReader(DatasetConfig(path="unused", limit=4), TABLES)) == [
        (0, ["a.parquet:0", "a.parquet:1"], [1, 2]), (2, ["a.parquet:2"], [3]), (3, ["sub/b.parquet:0"], [None])]
    assert batches(TableReader(DatasetConfig(path="unused", limit=3), TABLES))[-1] == (2, ["a.parquet:2"], [3])
    assert batches(TableReader(DatasetConfig(path="unused", limit=0), TABLES)) == []


def test_a_file_outside_the_root_is_labelled_by_its_name():
    reader = TableReader(DatasetConfig(path="unused"), {"/elsewhere/deep/c.parquet": [keys(7)]})
    assert [ids for _, ids, _ in batches(reader)] == [["c.parquet:0"]]


def test_mixed_type_ids_are_the_values_as_written(tmp_path):
    """A JSONL id column mixing strings and numbers is JSON text; the ids are its values, not their JSON."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a"}, {"id": 7}, {"id": None}, {"other": 1}, {"id": 2.5}])
    ids, _, _ = read_all(DatasetConfig(path=str(path), id_column="id"))
    assert ids == ["a", "7", "in.jsonl:2", "in.jsonl:3", "2.5"]


def test_the_fingerprint_is_path_size_and_digest_of_the_bytes_not_of_the_name(tmp_path, monkeypatch):
    first = write_parquet(tmp_path / "a.parquet", [{"prompt": "x"}])
    reader = open_reader(DatasetConfig(path=str(first)))
    (entry,) = reader.fingerprint()
    assert entry["path"] == str(first) and entry["size"] == os.path.getsize(first)
    assert entry["digest"].startswith("full:")
    copy = shutil.copy(first, tmp_path / "b.parquet")  # the same bytes elsewhere: the same digest
    assert open_reader(DatasetConfig(path=str(copy))).fingerprint()[0]["digest"] == entry["digest"]
    monkeypatch.chdir(tmp_path)  # a relative path is recorded absolute
    assert open_reader(DatasetConfig(path="a.parquet")).fingerprint() == [entry]
    write_parquet(first, [{"prompt": "y"}])  # other bytes, the same size
    assert reader.fingerprint() == [entry]  # computed once per reader
    (changed,) = open_reader(DatasetConfig(path=str(first))).fingerprint()
    assert changed["size"] == entry["size"] and changed["digest"] != entry["digest"]
