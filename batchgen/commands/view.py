"""`batchgen view OUTPUT_DIR [--to FILE.parquet|FILE.jsonl] [--columns a,b] [--limit N]`: the latest-attempt view
of an output (output/view.py: one row per row of the job, a retried row's latest attempt without error in its
place), streamed batch by batch: into one Parquet or JSONL file with --to (written under a temporary name and
renamed when complete), else as JSON lines on stdout (control characters and bidi overrides in values written as
`\\uXXXX`, so that none reaches the terminal). Only committed parts are read; nothing in OUTPUT_DIR changes.
With --table: the rows of the job's table output (output.sink=delta|iceberg) as the table holds them now (with
output.mode=upsert, the latest attempt per row; other jobs' rows of the same table included).
`batchgen view ROOT`, ROOT a `batchgen increment` root (ROOT/YYYY-MM-DD nights): the union of its nights, each id
once, retried answers included (output/ledger/nights.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.commands.terminal import json_line
from batchgen.errors import BatchgenError
from batchgen.output.ledger.nights import is_root, union_batches
from batchgen.output.manifest import MANIFEST, read_manifest
from batchgen.output.tables import recorded_sink
from batchgen.output.view import latest_batches

FORMATS = (".parquet", ".jsonl")


def _jsonable(value: Any) -> Any:
    """A value as JSON takes it: bytes as text where they decode, else their hex; everything else as pyarrow gives."""
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value.hex()
    return value


def _lines(table: pa.Table, *, shown: bool) -> list[str]:
    """The rows as JSON lines; `shown` (stdout, a terminal's or a pipe's): controls and bidi overrides as `\\uXXXX`
    (commands/terminal.py), the same JSON values; in a --to file: as the rows hold them."""
    said = [json.dumps({k: _jsonable(v) for k, v in row.items()}, ensure_ascii=False, default=str)
            for row in table.to_pylist()]
    return [(json_line(line) if shown else line) + "\n" for line in said]


class _Sink:
    """Where the view goes: stdout as JSON lines, or a .parquet / .jsonl file written under a temporary name and
    renamed once complete (an interrupted export leaves no file that looks whole)."""

    def __init__(self, to: Optional[Path]):
        self.to = to
        self.temp = None if to is None else to.with_name(f".{to.name}.tmp-{os.getpid()}")
        self.parquet: Optional[pq.ParquetWriter] = None
        self.text = sys.stdout if to is None else (open(self.temp, "w", encoding="utf-8") if to.suffix == ".jsonl"
                                                   else None)

    def write(self, table: pa.Table) -> None:
        if self.text is not None:
            self.text.writelines(_lines(table, shown=self.to is None))
            return
        self.parquet = self.parquet or pq.ParquetWriter(self.temp, table.schema)
        self.parquet.write_table(table)

    def close(self, complete: bool) -> None:
        if self.to is None:
            return
        if self.parquet is not None:
            self.parquet.close()
        elif self.text is None and complete:  # no rows at all: an empty table
            pq.write_table(pa.table({}), self.temp)
        if self.text is not None:
            self.text.close()
        if complete:
            os.replace(self.temp, self.to)
        else:
            self.temp.unlink(missing_ok=True)


def _batches(output_dir: Path, columns: Optional[list[str]], table_output: bool) -> Iterator[pa.Table]:
    if table_output:
        return _table_batches(output_dir, columns)
    if is_root(output_dir):
        return union_batches(output_dir, columns)
    return latest_batches(output_dir, columns)


def export(output_dir: Path, to: Optional[Path], columns: Optional[list[str]], limit: Optional[int],
           table_output: bool = False) -> int:
    """Write the view (or, `table_output`, the rows of the table output the manifest records; for a root of nights,
    their union); the number of rows written."""
    rows, sink, complete = 0, _Sink(to), False
    try:
        for table in _batches(output_dir, columns, table_output):
            table = table if limit is None else table.slice(0, max(limit - rows, 0))
            sink.write(table)
            rows += table.num_rows
            if limit is not None and rows >= limit:
                break
        complete = True
    finally:
        sink.close(complete)
    return rows


def _table_batches(output_dir: Path, columns: Optional[list[str]]) -> Iterator[pa.Table]:
    sink = recorded_sink(read_manifest(output_dir) or {})
    if sink is None:
        raise ValueError(f"{output_dir} has no table output (output.sink is parquet): drop --table")
    for batch in sink.batches(columns):
        yield pa.Table.from_batches([batch])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchgen view", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--to", type=Path, help="a .parquet or .jsonl file (default: JSON lines on stdout)")
    parser.add_argument("--columns", help="comma-separated columns (default: all)")
    parser.add_argument("--limit", type=int, help="the first N rows only")
    parser.add_argument("--table", action="store_true",
                        help="the rows of the job's table output (output.sink=delta|iceberg) as the table holds them")
    args = parser.parse_args(argv)
    root = not (args.output_dir / MANIFEST).is_file() and is_root(args.output_dir)
    if not (args.output_dir / MANIFEST).is_file() and not root:
        print(f"batchgen view: error: {args.output_dir}: no {MANIFEST}; point it at a job's output_dir, or at a "
              f"batchgen increment root (its YYYY-MM-DD nights)", file=sys.stderr)
        return 2
    if root and args.table:
        print(f"batchgen view: error: {args.output_dir} is a root of nights: --table reads one night's table "
              f"output; drop --table, or name a night", file=sys.stderr)
        return 2
    if args.to is not None and args.to.suffix not in FORMATS:
        print(f"batchgen view: error: --to {args.to}: write a {' or '.join(FORMATS)} file", file=sys.stderr)
        return 2
    columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
    try:
        rows = export(args.output_dir, args.to, columns, args.limit, args.table)
    except (KeyError, ValueError, FileNotFoundError, pa.ArrowInvalid) as exc:  # an unknown column, an unreadable row
        print(f"batchgen view: error: {exc}", file=sys.stderr)
        return 2
    except BatchgenError as exc:  # a part that is not batchgen's (BadPartError), a torn manifest: named, exit 2
        print(f"batchgen view: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.to is not None:
        print(f"{rows} rows written to {args.to}", file=sys.stderr)
    return 0
