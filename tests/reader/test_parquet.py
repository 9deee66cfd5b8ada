"""reader/parquet.py: row counts from the footers, batches row group by row group across files, a range read from
only the row groups that hold it (a shard's parts), the files' schemas unified, and the pages verified for only the
row groups a worker reads; and the streaming memory bound."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import InputError
from batchgen.reader import DatasetConfig, open_reader
from batchgen.reader.parquet import ParquetReader


def grouped(path: Path, prefix: str, rows: int, group: int, **kwargs) -> Path:
    pq.write_table(pa.table({"prompt": [f"{prefix}{i}" for i in range(rows)]}), path, row_group_size=group, **kwargs)
    return path


def two_files(tmp_path: Path) -> Path:
    """a.parquet: 10 rows in row groups of 4, 4, 2; b.parquet: 5 rows in 2, 2, 1."""
    grouped(tmp_path / "a.parquet", "a", 10, 4)
    grouped(tmp_path / "b.parquet", "b", 5, 2)
    return tmp_path


def corrupt_group(path: Path, group: int) -> None:
    """Overwrite bytes of the row group's data page (the file written uncompressed, with page checksums)."""
    chunk = pq.read_metadata(path).row_group(group).column(0)
    with open(path, "r+b") as f:
        f.seek((chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size - 20)
        f.write(b"\xff" * 12)


def test_row_counts_and_row_groups_come_from_the_footers_without_reading_a_row(tmp_path):
    reader = open_reader(DatasetConfig(path=str(two_files(tmp_path))))
    assert isinstance(reader, ParquetReader) and reader.seekable
    assert reader.row_groups() == [(str(tmp_path / "a.parquet"), [4, 4, 2]), (str(tmp_path / "b.parquet"), [2, 2, 1])]
    assert reader.count_rows() == 15 and reader.rows_read == 0
    assert open_reader(DatasetConfig(path=str(tmp_path), limit=12)).count_rows() == 12
    assert open_reader(DatasetConfig(path=str(tmp_path), limit=99)).count_rows() == 15


def test_batches_never_span_a_row_group_and_number_rows_across_files(tmp_path):
    reader = open_reader(DatasetConfig(path=str(two_files(tmp_path)), batch_rows=3))
    got = [(b.start, b.ids) for b in reader.iter_batches()]
    assert got == [(0, ["a.parquet:0", "a.parquet:1", "a.parquet:2"]), (3, ["a.parquet:3"]),
                   (4, ["a.parquet:4", "a.parquet:5", "a.parquet:6"]), (7, ["a.parquet:7"]),
                   (8, ["a.parquet:8", "a.parquet:9"]), (10, ["b.parquet:0", "b.parquet:1"]),
                   (12, ["b.parquet:2", "b.parquet:3"]), (14, ["b.parquet:4"])]
    assert reader.rows_read == 15


def test_a_range_reads_only_the_row_groups_that_hold_it(tmp_path):
    reader = open_reader(DatasetConfig(path=str(two_files(tmp_path)), batch_rows=3))
    got = [(b.start, b.ids, b.table.column("prompt").to_pylist()) for b in reader.iter_range(9, 13)]
    assert got == [(9, ["a.parquet:9"], ["a9"]), (10, ["b.parquet:0", "b.parquet:1"], ["b0", "b1"]),
                   (12, ["b.parquet:2"], ["b2"])]
    assert reader.rows_read == 6  # a's last row group (2) and b's first two (2 + 2): none of a's first 8 rows
    limited = open_reader(DatasetConfig(path=str(tmp_path), limit=12))
    assert [b.ids for b in limited.iter_range(9, 15)] == [["a.parquet:9"], ["b.parquet:0", "b.parquet:1"]]
    assert list(limited.iter_range(12, 15)) == []


def test_a_range_never_touches_a_corrupt_row_group_outside_it(tmp_path):
    path = grouped(tmp_path / "in.parquet", "r", 16, 4, compression="none", write_page_checksum=True)
    corrupt_group(path, 1)
    reader = open_reader(DatasetConfig(path=str(path), verify="footers"))
    (batch,) = reader.iter_range(8, 12)
    assert batch.table.column("prompt").to_pylist() == ["r8", "r9", "r10", "r11"]
    assert batch.read_errors == [None] * 4 and reader.rows_read == 4


def test_verify_pages_checks_only_the_row_groups_wanted(tmp_path):
    path = grouped(tmp_path / "in.parquet", "r", 16, 4, compression="none", write_page_checksum=True)
    corrupt_group(path, 1)
    reader = open_reader(DatasetConfig(path=str(path)))
    seen = []
    reader.verify_pages(wanted=lambda first, end: seen.append((first, end)) or first >= 8)  # rows 8..15: no error
    assert seen == [(0, 4), (4, 8), (8, 12), (12, 16)]
    with pytest.raises(InputError, match=r"^dataset.verify=pages: unreadable pages in .*in.parquet row group 1: "):
        reader.verify_pages(wanted=lambda first, end: first < 8)
    with pytest.raises(InputError, match=r"set dataset.verify=footers to record their rows as errors and go on$"):
        reader.verify_pages()


def test_the_files_schemas_are_unified_in_first_seen_column_order(tmp_path):
    pq.write_table(pa.table({"prompt": ["a"], "n": pa.array([1], pa.int64()), "tag": ["x"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"extra": [True], "n": pa.array([2.5]), "prompt": ["b"]}), tmp_path / "b.parquet")
    reader = open_reader(DatasetConfig(path=str(tmp_path)))
    assert reader.schema() == pa.schema([("prompt", pa.string()), ("n", pa.float64()), ("tag", pa.string()),
                                         ("extra", pa.bool_())])
    rows = [r for b in reader.iter_batches() for r in b.table.to_pylist()]
    assert rows == [{"prompt": "a", "n": 1.0, "tag": "x", "extra": None},
                    {"prompt": "b", "n": 2.5, "tag": None, "extra": True}]
    pq.write_table(pa.table({"prompt": ["c"], "n": pa.array([[1]])}), tmp_path / "c.parquet")
    with pytest.raises(InputError, match=r"column 'n' is list<\w+: int64> in .*c.parquet but double in .*a.parquet"):
        open_reader(DatasetConfig(path=str(tmp_path))).columns()  # before any row is read


def test_a_type_clash_names_the_first_file_that_has_the_column(tmp_path):
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"prompt": ["b"], "tag": ["x"]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"prompt": ["c"], "tag": pa.array([[1]])}), tmp_path / "c.parquet")
    with pytest.raises(InputError, match=r"column .tag. is list<\w+: int64> in .*c.parquet but string in .*b.parquet"):
        open_reader(DatasetConfig(path=str(tmp_path))).columns()


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
