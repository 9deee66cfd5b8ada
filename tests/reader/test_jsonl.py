"""reader/jsonl.py: line by line, a bad line one error row naming its line; column types decided over every line
(the typing pass), which also counts the rows and marks the part starts; the pass saved and reused (index,
use_index) only under the same shape."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa

from batchgen.reader import DatasetConfig, is_json_text, open_reader
from batchgen.reader.jsonl import JsonlReader
from tests.conftest import write_jsonl
from tests.reader.conftest import read_all


def test_jsonl_bad_lines_become_error_rows_with_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "ok", "n": 1}, "{not json", "", b"\xff\xfe bad utf8", "[1, 2]", {"prompt": "ok2", "n": "x"},
    ])
    with open(path, "ab") as f:
        f.write(b'{"prompt": "truncated')  # a final line cut off mid-write, no newline
    ids, rows, errors = read_all(DatasetConfig(path=str(path)))
    assert len(ids) == 6
    assert errors[0] is None and errors[4] is None
    assert errors[1].startswith("malformed_json: line 2")
    assert errors[2].startswith("invalid_utf8: line 4")
    assert errors[3].startswith("malformed_json: line 5")
    assert errors[5].startswith("malformed_json: line 7")
    assert (rows[0]["n"], rows[4]["n"]) == ("1", '"x"')  # mixed types: every value as JSON text, exactly


def test_a_bad_lines_error_names_its_line_and_the_id_it_gets(tmp_path):
    """The line counts from 1 (an editor's), the generated id `<file>:<row>` from 0 without blank lines: the error
    names both, streamed or read from a part's mark, so neither is taken for the other."""
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, "", {"prompt": "b"}, "{oops", {"prompt": "c"},
                                                b"\xff", {"prompt": "d"}])
    ids, _, errors = read_all(DatasetConfig(path=str(path)))
    assert (ids[2], ids[4]) == ("bad.jsonl:2", "bad.jsonl:4")
    assert errors[2].startswith("malformed_json: line 4 (bad.jsonl:2): ")
    assert errors[4].startswith("invalid_utf8: line 6 (bad.jsonl:4): ")
    reader = open_reader(DatasetConfig(path=str(path)))
    reader.stride = 2
    (second,) = reader.iter_range(2, 4)  # from the mark at row 2
    assert second.ids[0] == "bad.jsonl:2" and second.read_errors[0].startswith("malformed_json: line 4 (bad.jsonl:2)")


def test_the_typing_pass_keeps_native_types_only_where_every_value_fits_one(tmp_path):
    rows = [{"b": True, "i": 1, "f": 1.5, "s": "x", "l": [1, 2], "st": {"k": 1, "v": "a"}, "none": None,
             "int_float": 1, "big_float": 2**60, "bool_int": True, "deep": {"k": 1}, "empty": {}, "huge": 2**70},
            {"b": False, "i": 2, "f": 2.0, "s": "y", "l": [], "st": {"k": 2}, "none": None,
             "int_float": 2.5, "big_float": 1.0, "bool_int": 3, "deep": {"k": "one"}, "empty": {}, "huge": 1}]
    reader = open_reader(DatasetConfig(path=str(write_jsonl(tmp_path / "in.jsonl", rows))))
    schema = reader.schema()
    native = {f.name: f.type for f in schema if not is_json_text(f)}
    assert native == {"b": pa.bool_(), "i": pa.int64(), "f": pa.float64(), "s": pa.string(),
                      "l": pa.list_(pa.int64()), "st": pa.struct([("k", pa.int64()), ("v", pa.string())]),
                      "none": pa.string(), "int_float": pa.float64()}
    # no single Arrow type holds these exactly: JSON text, every value as written
    assert [f.name for f in schema if is_json_text(f)] == ["big_float", "bool_int", "deep", "empty", "huge"]
    table = pa.concat_tables(b.table for b in reader.iter_batches())
    assert table.column("big_float").to_pylist() == [str(2**60), "1.0"]  # not rounded through a float
    assert table.column("huge").to_pylist() == [str(2**70), "1"]
    assert table.column("bool_int").to_pylist() == ["true", "3"]
    assert table.column("int_float").to_pylist() == [1.0, 2.5]
    assert table.column("st").to_pylist() == [{"k": 1, "v": "a"}, {"k": 2, "v": None}]


def test_the_typing_pass_stops_at_the_limit(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"n": 1}, {"n": 2}, {"n": "three"}, {"n": 4}])
    reader = open_reader(DatasetConfig(path=str(path), limit=2))
    assert reader.schema().field("n").type == pa.int64()  # the third line, past the limit, does not count
    assert reader.count_rows() == 2 and reader.rows_typed == 2
    assert read_all(DatasetConfig(path=str(path), limit=2))[1] == [{"n": 1}, {"n": 2}]


def test_an_input_without_a_readable_record_has_no_columns_and_no_rows(tmp_path):
    (tmp_path / "blank.jsonl").write_bytes(b"\n  \n\n")
    reader = open_reader(DatasetConfig(path=str(tmp_path / "blank.jsonl")))
    assert (reader.columns(), reader.count_rows(), list(reader.iter_batches())) == (None, 0, [])
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    reader = open_reader(DatasetConfig(path=str(bad)))
    assert reader.columns() is None and reader.count_rows() == 1  # the bad line is still a row, an error row


def two_files(tmp_path) -> DatasetConfig:
    write_jsonl(tmp_path / "x.jsonl", [{"prompt": f"x{i}", "n": i} for i in range(3)])
    write_jsonl(tmp_path / "y.jsonl", [{"prompt": f"y{i}", "n": i} for i in range(4)])
    return DatasetConfig(path=str(tmp_path / "[xy].jsonl"))


def test_a_saved_pass_is_reused_and_a_range_read_from_its_mark_across_files(tmp_path):
    cfg = two_files(tmp_path)
    whole = open_reader(cfg)
    whole.stride = 2
    assert not whole.seekable  # no marks before the pass
    saved = json.loads(json.dumps(whole.index()))  # as saved beside the output
    assert whole.seekable and whole.rows_typed == 7
    assert saved["rows"] == 7 and saved["shape"] == {"format": "jsonl", "stride": 2, "limit": None,
                                                     "max_line_bytes": cfg.max_line_bytes, "max_depth": 32}
    assert [(m[0], m[3]) for m in saved["marks"]] == [(0, 0), (0, 2), (1, 1), (1, 3)]  # (file, row in file)
    shard = open_reader(cfg)
    shard.stride = 2
    assert shard.use_index(saved)
    assert shard.seekable and shard.schema() == whole.schema() and shard.count_rows() == 7
    got = [(b.start, b.ids, b.table.column("prompt").to_pylist()) for b in shard.iter_range(2, 6)]
    assert got == [(2, ["x.jsonl:2"], ["x2"]), (3, ["y.jsonl:0", "y.jsonl:1", "y.jsonl:2"], ["y0", "y1", "y2"])]
    assert shard.rows_typed == 0 and shard.rows_read == 4  # no pass, and no line before row 2 read


def test_a_saved_pass_of_another_shape_is_not_used(tmp_path):
    cfg = two_files(tmp_path)
    whole = open_reader(cfg)
    whole.stride = 2
    saved = json.loads(json.dumps(whole.index()))
    others = {"stride": (cfg, 3), "limit": (DatasetConfig(path=cfg.path, limit=5), 2),
              "max_line_bytes": (DatasetConfig(path=cfg.path, max_line_bytes=100), 2),
              "format": (DatasetConfig(path=cfg.path, format="openai_batch"), 2)}
    for what, (other, stride) in others.items():
        reader = open_reader(other)
        reader.stride = stride
        assert not reader.use_index(saved), what
        assert reader.count_rows() == (5 if what == "limit" else 7) and reader.rows_typed > 0, what  # its own pass


def test_a_value_that_no_longer_fits_the_saved_types_is_a_bad_value_row_not_coerced(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "n": 1}, {"prompt": "b", "n": 2}])
    first = open_reader(DatasetConfig(path=str(path)))
    first.stride = 1
    saved = first.index()
    write_jsonl(path, [{"prompt": "a", "n": 1}, {"prompt": "b", "n": "two"}])  # changed after the pass
    later = open_reader(DatasetConfig(path=str(path)))
    later.stride = 1
    assert later.use_index(saved)
    (batch,) = later.iter_range(0, 2)
    assert batch.table.column("n").to_pylist() == [1, None]
    assert batch.read_errors == [None, "bad_value: column 'n' holds a str where the input's other rows have int64"]


def test_a_compressed_file_is_read_but_never_seekable(tmp_path):
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n\n{"prompt": "b"}\n'))
    reader = open_reader(DatasetConfig(path=str(path)))
    assert isinstance(reader, JsonlReader)
    reader.stride = 1
    assert reader.count_rows() == 2 and not reader.seekable
    assert read_all(DatasetConfig(path=str(path))) == (["in.jsonl.gz:0", "in.jsonl.gz:1"],
                                                       [{"prompt": "a"}, {"prompt": "b"}], [None, None])
