"""reader/values.py: a column's values as the input wrote them, a JSON-text column (mixed types) decoded."""

from __future__ import annotations

import json

import pyarrow as pa

from batchgen.reader import DatasetConfig, column_values, is_json_text, open_reader
from batchgen.reader.values import JSON_TEXT
from tests.conftest import write_jsonl


def test_is_json_text_reads_the_fields_marker_only():
    assert is_json_text(pa.field("x", pa.string(), metadata=JSON_TEXT))
    assert not is_json_text(pa.field("x", pa.string()))
    assert not is_json_text(pa.field("x", pa.string(), metadata={b"batchgen.encoding": b"utf8"}))
    assert not is_json_text(pa.field("x", pa.string(), metadata={b"other": b"json"}))


def test_a_json_text_column_is_decoded_to_each_rows_own_value_and_nulls_stay_null():
    written = [7, "7", 2.5, True, [1, "a"], {"k": None}, None]
    text = pa.array([None if v is None else json.dumps(v) for v in written], pa.string())
    table = pa.Table.from_arrays([text], schema=pa.schema([pa.field("v", pa.string(), metadata=JSON_TEXT)]))
    assert column_values(table, "v") == written


def test_a_native_column_is_returned_as_is_even_when_its_strings_look_like_json():
    table = pa.table({"s": ["7", '{"a": 1}', None], "n": [1, 2, 3], "l": [[1], [], None]})
    assert column_values(table, "s") == ["7", '{"a": 1}', None]
    assert column_values(table, "n") == [1, 2, 3]
    assert column_values(table, "l") == [[1], [], None]


def test_a_mixed_jsonl_column_reads_back_as_written(tmp_path):
    """The JSONL reader keeps a mixed column as JSON text; column_values gives back the values, types and all."""
    written = [3, "three", [3], {"n": 3}, None, 3.5]
    path = write_jsonl(tmp_path / "in.jsonl", [{"v": v, "s": "x"} for v in written])
    table = next(open_reader(DatasetConfig(path=str(path))).iter_batches()).table
    assert is_json_text(table.schema.field("v")) and not is_json_text(table.schema.field("s"))
    assert table.column("v").to_pylist()[:2] == ["3", '"three"']  # stored as JSON text
    assert column_values(table, "v") == written
    assert column_values(table, "s") == ["x"] * 6
