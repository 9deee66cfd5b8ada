"""Opening a committed part for reading, checked: every reader of an output's parts (the latest-attempt view, so
`batchgen view`, `batchgen retry` and run.skip_existing; retry's passthrough columns) goes through `open_part`, so a
truncated file, a file that is not Parquet, or a foreign Parquet file under a part's name is one BadPartError naming
its path and why (the CLI's exit 2), never a pyarrow traceback nor a silent read that drops or invents rows."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BadPartError
from batchgen.output.rows.schema import OUTPUT_COLUMNS

FIX = "move it out of the output directory (or delete it and rerun the job to write that part again)"


def open_part(path: Path | str, source: Optional[BinaryIO] = None) -> pq.ParquetFile:
    """`path` (or `source`, an open file of the part that `path` names, as on object storage) opened as a Parquet file
    whose schema holds every column the committer writes (committer.OUTPUT_FIELDS: id, sample_index, ... error).
    Checked here because pyarrow reads a foreign file happily and the view then keys rows by a missing `id`; and a
    truncated file fails deep inside a read with no path in its message."""
    try:
        part = pq.ParquetFile(path if source is None else source)
        names = part.schema_arrow.names
    except (pa.ArrowException, OSError) as exc:
        said = " ".join(str(exc).split())
        raise BadPartError(f"{path}: not a readable Parquet file (truncated, or not Parquet: {said}); {FIX}") from None
    missing = [c for c in OUTPUT_COLUMNS if c not in names]
    if missing:
        part.close()
        raise BadPartError(f"{path}: not a batchgen part: no column {', '.join(missing)} (it has "
                           f"{', '.join(names) or 'no column'}); {FIX}")
    return part


def part_schema(path: Path) -> pa.Schema:
    """A checked part's Arrow schema (open_part), the file closed again."""
    part = open_part(path)
    try:
        return part.schema_arrow
    finally:
        part.close()
