"""`batchgen head OUTPUT_DIR [-n N] [--expect-rows M]`: the first N rows of an output's latest-attempt view
(output/view.py: a retried row's latest attempt without error stands in its place), one line each: id, finish reason,
prompt and generated tokens, and the start of the generation (an error row's: its error). A header line first: the
rows the view holds (counted from the committed parts' footers, none of them read) and its columns.
`--expect-rows M` exits 1 where the view holds another number of rows (`make demo` checks its output so). Reads
committed parts only; nothing in OUTPUT_DIR changes. Exit codes: 0 shown, 1 not the expected rows, 2 not an output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchgen.commands.terminal import one_line
from batchgen.errors import BatchgenError
from batchgen.output.manifest import MANIFEST
from batchgen.output.parts import open_part, part_schema
from batchgen.output.view import latest_batches, part_files

DEFAULT_ROWS = 10
TEXT_CHARS = 70  # of each row's generation (or error) shown, its newlines as spaces


def view_rows(output_dir: Path) -> int:
    """The rows of the view: one per row of the job's own committed parts (a retry replaces rows, never adds)."""
    total = 0
    for path in part_files(output_dir):
        part = open_part(path)
        try:
            total += part.metadata.num_rows
        finally:
            part.close()
    return total


def first_rows(output_dir: Path, n: int) -> tuple[list[str], list[dict[str, Any]]]:
    """The view's columns and its first `n` rows; only the row groups holding them are read."""
    columns: Optional[list[str]] = None
    rows: list[dict[str, Any]] = []
    for table in latest_batches(output_dir):
        columns = columns or table.column_names
        if len(rows) >= n:
            break
        rows += table.slice(0, n - len(rows)).to_pylist()
    if columns is None:  # no row at all (an empty input's part): the columns of the part's schema
        files = part_files(output_dir)
        columns = [*part_schema(files[0]).names, "attempt"] if files else []
    return columns, rows


def row_line(row: dict[str, Any]) -> str:
    """One row as make demo prints it; a retried row's attempt added where it is not the job's own. Row data
    escaped for the terminal (commands/terminal.py); the text as Python quotes it, which escapes them too. A row
    with an error shows it in place of the text: an input error's, or a constrained sample's invalid_output (whose
    text is kept in the output, its finish reason the engine's)."""
    text = row["error"] or row["generation"] or ""
    retried = f" attempt={row['attempt']}" if row.get("attempt") else ""
    return (f"  {one_line(row['id']):<12} {one_line(row['finish_reason']):<7} "
            f"prompt={str(row['num_prompt_tokens']):<4} gen={str(row['num_generated_tokens']):<4}{retried} "
            f"{text.replace(chr(10), ' ')[:TEXT_CHARS]!r}")


def show(output_dir: Path, n: int) -> int:
    """Print the header and the first `n` rows; the rows the view holds."""
    total = view_rows(output_dir)
    columns, rows = first_rows(output_dir, n)
    print(f"{output_dir}: {total} rows, columns: {', '.join(map(one_line, columns))}")
    for row in rows:
        print(row_line(row))
    return total


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchgen head", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("-n", "--rows", type=int, default=DEFAULT_ROWS, help=f"rows to show (default {DEFAULT_ROWS})")
    parser.add_argument("--expect-rows", type=int, help="exit 1 unless the view holds exactly this many rows")
    args = parser.parse_args(argv)
    if args.rows < 0:
        print(f"batchgen head: error: -n {args.rows}: how many rows to show, 0 or more", file=sys.stderr)
        return 2
    if not (args.output_dir / MANIFEST).is_file():
        print(f"batchgen head: error: {args.output_dir}: no {MANIFEST}; point it at a job's output_dir",
              file=sys.stderr)
        return 2
    try:
        total = show(args.output_dir, args.rows)
    except (FileNotFoundError, pa.ArrowInvalid, BatchgenError) as exc:  # no part yet, a part that is not batchgen's
        print(f"batchgen head: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 2)
    if args.expect_rows is not None and total != args.expect_rows:
        print(f"batchgen head: expected {args.expect_rows} rows, found {total}", file=sys.stderr)
        return 1
    return 0
