"""reader/files.py: dataset.path resolved to its files (file, directory, glob or fsspec URL), in sorted order, hidden
files left out, the format told from the extensions; and the errors naming dataset.path."""

from __future__ import annotations

import pytest

from batchgen.errors import InputError
from batchgen.reader import DatasetConfig, open_reader, resolve_files
from tests.conftest import write_jsonl, write_parquet
from tests.reader.conftest import read_all


def test_parquet_directory_is_read_in_sorted_path_order_with_generated_ids(tmp_path):
    (tmp_path / "d").mkdir()
    write_parquet(tmp_path / "d" / "b.parquet", [{"prompt": "b0"}, {"prompt": "b1"}])
    write_parquet(tmp_path / "d" / "a.parquet", [{"prompt": "a0"}])
    ids, rows, _ = read_all(DatasetConfig(path=str(tmp_path / "d"), batch_rows=1))
    assert ids == ["a.parquet:0", "b.parquet:0", "b.parquet:1"]
    assert [r["prompt"] for r in rows] == ["a0", "b0", "b1"]


def test_missing_and_corrupt_files_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="dataset.path: no such file"):
        open_reader(DatasetConfig(path=str(tmp_path / "nope.parquet")))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(InputError, match="bad.parquet"):
        open_reader(DatasetConfig(path=str(tmp_path / "bad.parquet"))).columns()


def test_fsspec_url(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    ids, _, _ = read_all(DatasetConfig(path=f"file://{tmp_path}/in.jsonl"))
    assert ids == ["in.jsonl:0", "in.jsonl:1"]


def test_a_directory_is_searched_recursively_for_data_files_and_its_hidden_ones_left_out(tmp_path):
    """Names starting with `_` or `.` (an earlier job's _manifest, temp folders, .ipynb_checkpoints) and files of
    other extensions are not input; a nested file's id is its path under the directory."""
    d = tmp_path / "d"
    for sub in ("sub", "_tmp", ".ipynb_checkpoints"):
        (d / sub).mkdir(parents=True)
    for name in ("b.parquet", "sub/a.pq", "_tmp/x.parquet", ".ipynb_checkpoints/y.parquet", "_manifest.parquet",
                 ".hidden.parquet"):
        write_parquet(d / name, [{"prompt": name}])
    (d / "notes.txt").write_text("not data")
    (d / "_SUCCESS").write_text("")
    fmt, files, _, root = resolve_files(DatasetConfig(path=str(d)))
    assert (fmt, files, root) == ("parquet", [str(d / "b.parquet"), str(d / "sub" / "a.pq")], str(d))
    ids, rows, _ = read_all(DatasetConfig(path=str(d)))
    assert ids == ["b.parquet:0", "sub/a.pq:0"] and [r["prompt"] for r in rows] == ["b.parquet", "sub/a.pq"]


def test_a_glob_is_rooted_at_its_fixed_part_which_its_ids_are_relative_to(tmp_path):
    for day in ("2024-02", "2024-01"):
        (tmp_path / day).mkdir()
        write_jsonl(tmp_path / day / "rows.jsonl", [{"prompt": day}])
        write_jsonl(tmp_path / day / "_draft.jsonl", [{"prompt": "hidden"}])
    fmt, files, _, root = resolve_files(DatasetConfig(path=str(tmp_path / "2024-*" / "*.jsonl")))
    assert (fmt, root) == ("jsonl", str(tmp_path))
    assert files == [str(tmp_path / "2024-01" / "rows.jsonl"), str(tmp_path / "2024-02" / "rows.jsonl")]
    ids, _, _ = read_all(DatasetConfig(path=str(tmp_path / "2024-*" / "*.jsonl")))
    assert ids == ["2024-01/rows.jsonl:0", "2024-02/rows.jsonl:0"]


def test_the_format_is_told_by_extension_and_a_single_file_has_no_root(tmp_path):
    for name, fmt in (("a.jsonl", "jsonl"), ("a.ndjson", "jsonl"), ("a.json", "jsonl"), ("a.jsonl.gz", "jsonl")):
        (tmp_path / name).write_bytes(b"")
        assert resolve_files(DatasetConfig(path=str(tmp_path / name)))[::3] == (fmt, "")
    write_parquet(tmp_path / "a.pq", [{"prompt": "p"}])
    assert resolve_files(DatasetConfig(path=str(tmp_path / "a.pq")))[:2] == ("parquet", [str(tmp_path / "a.pq")])


def test_an_unknown_extension_is_refused_unless_the_format_is_set(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(InputError, match=r"dataset.format: cannot tell the format of .*rows.txt; set dataset.format"):
        resolve_files(DatasetConfig(path=str(path)))
    assert resolve_files(DatasetConfig(path=str(path), format="jsonl"))[:2] == ("jsonl", [str(path)])
    _, rows, _ = read_all(DatasetConfig(path=str(path), format="jsonl"))
    assert rows == [{"prompt": "a"}]


def test_parquet_and_jsonl_mixed_are_refused(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"prompt": "a"}])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b"}])
    for path in (tmp_path, tmp_path / "*"):
        with pytest.raises(InputError, match="dataset.path mixes Parquet and JSONL files; point it at one format"):
            resolve_files(DatasetConfig(path=str(path)))


def test_nothing_to_read_names_the_path(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.md").write_text("no data here")
    for path in (tmp_path / "empty", tmp_path / "*.csv"):
        with pytest.raises(InputError) as err:
            resolve_files(DatasetConfig(path=str(path)))
        assert str(err.value) == f"dataset.path: no Parquet or JSONL files match {path}"
    with pytest.raises(InputError) as err:
        resolve_files(DatasetConfig(path=str(tmp_path / "gone")))
    assert str(err.value) == f"dataset.path: no such file or directory: {tmp_path / 'gone'}"


def test_a_saved_hf_dataset_directory_is_format_hf_under_auto(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    assert resolve_files(DatasetConfig(path=str(tmp_path / "ds")))[:2] == ("hf", [str(tmp_path / "ds")])
    assert resolve_files(DatasetConfig(path="org/name", format="hf"))[:2] == ("hf", ["org/name"])
