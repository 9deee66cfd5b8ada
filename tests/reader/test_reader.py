"""Readers: formats, ids, order across files, limit, malformed JSONL lines, and the memory bound."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import InputError
from batchgen.reader import DatasetConfig, open_reader
from tests.conftest import write_jsonl, write_parquet


def read_all(cfg: DatasetConfig) -> tuple[list[str], list, list]:
    ids, rows, errors = [], [], []
    for batch in open_reader(cfg).iter_batches():
        ids += batch.ids
        rows += batch.table.to_pylist()
        errors += batch.read_errors
    return ids, rows, errors


def test_parquet_directory_is_read_in_sorted_path_order_with_generated_ids(tmp_path):
    (tmp_path / "d").mkdir()
    write_parquet(tmp_path / "d" / "b.parquet", [{"prompt": "b0"}, {"prompt": "b1"}])
    write_parquet(tmp_path / "d" / "a.parquet", [{"prompt": "a0"}])
    ids, rows, _ = read_all(DatasetConfig(path=str(tmp_path / "d"), batch_rows=1))
    assert ids == ["a.parquet:0", "b.parquet:0", "b.parquet:1"]
    assert [r["prompt"] for r in rows] == ["a0", "b0", "b1"]


def test_glob_limit_and_id_column(tmp_path):
    for k in range(3):
        write_parquet(tmp_path / f"x{k}.parquet", [{"key": 10 * k + i, "prompt": "p"} for i in range(4)])
    ids, _, _ = read_all(DatasetConfig(path=str(tmp_path / "x*.parquet"), id_column="key", limit=6, batch_rows=3))
    assert ids == ["0", "1", "2", "3", "10", "11"]


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


def test_hf_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"prompt": ["a", "b", "c"], "id": [5, 6, 7]}).save_to_disk(str(tmp_path / "ds"))
    cfg = DatasetConfig(path=str(tmp_path / "ds"), id_column="id", batch_rows=2)
    assert open_reader(cfg).count_rows() == 3
    ids, rows, _ = read_all(cfg)
    assert ids == ["5", "6", "7"] and [r["prompt"] for r in rows] == ["a", "b", "c"]


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


@pytest.mark.slow
def test_two_million_row_parquet_streams_in_bounded_memory(tmp_path):
    """RSS growth while streaming 2,000,000 rows through the planner stays under 300 MB."""
    path = tmp_path / "big.parquet"
    schema = pa.schema([("prompt", pa.string()), ("meta", pa.int64())])
    with pq.ParquetWriter(path, schema) as writer:
        for chunk in range(20):
            base = chunk * 100_000
            writer.write_table(pa.table({"prompt": [f"prompt number {base + i} " * 3 for i in range(100_000)],
                                         "meta": list(range(base, base + 100_000))}, schema=schema))
    script = textwrap.dedent(f"""
        import json, resource
        from batchgen.job import JobConfig
        from batchgen.prompts.planner import Planner
        from batchgen.reader import DatasetConfig, open_reader
        cfg = JobConfig(name="m", dataset=DatasetConfig(path={str(path)!r}))
        cfg.run.rows_per_part = 1024
        reader = open_reader(cfg.dataset)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        planner = Planner(cfg, reader, renderer=None, tokenizer=None)
        rows = sum(part.num_rows for part in planner.parts(skip=set()))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"rows": rows, "growth_mb": (peak - base) / 1024}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"streamed {result['rows']} rows, RSS growth {result['growth_mb']:.0f} MB")
    assert result["rows"] == 2_000_000
    assert result["growth_mb"] < 300
