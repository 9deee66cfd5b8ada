"""The reader's base: numbers rows across files, applies `dataset.limit`, makes row ids, fingerprints the input."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Optional

import fsspec
import pyarrow as pa

from batchgen.fsutil import content_digest
from batchgen.reader.config import DatasetConfig
from batchgen.reader.values import column_values
from batchgen.records import InputBatch


class Reader:
    """Base: resolves files, numbers rows across files, applies `limit`, makes ids."""

    seekable = False  # True: iter_range reads rows [start, stop) without reading the rows before them (Parquet:
    # before their row group)

    def __init__(self, cfg: DatasetConfig, files: list[str], fs: fsspec.AbstractFileSystem, root: str,
                 part_size: Optional[int] = None):
        self.cfg = cfg
        self.part_size = part_size  # the job's rows per part, where the opener knows it (a JSONL input marks them)
        self.files = files
        self.fs = fs
        self.root = root
        self.rows_read = 0  # input rows decoded so far (a sharded worker reads its own parts' only)
        self.rows_typed = 0  # lines parsed by a JSONL input's typing pass (types and part marks), apart from the rows
        self._fingerprint: Optional[list[dict[str, Any]]] = None

    def columns(self) -> Optional[list[str]]:
        """Column names, or None where the input has no readable record to tell them from."""
        raise NotImplementedError

    def count_rows(self) -> Optional[int]:
        """Total rows (after limit) if cheaply known, else None."""
        return None

    def fingerprint(self) -> list[dict[str, Any]]:
        """Each input file by path, size and content digest (fsutil.content_digest): a resume refuses changed
        bytes, and accepts a file touched or rewritten with the same bytes (its mtime is not compared). Computed
        once per reader."""
        if self._fingerprint is None:
            self._fingerprint = self._fingerprint_files()
        return self._fingerprint

    def _fingerprint_files(self) -> list[dict[str, Any]]:
        out = []
        for f in self.files:
            size = self.fs.info(f).get("size")
            with self.fs.open(f, "rb") as stream:
                digest = content_digest(stream, size)
            local = self.fs.protocol in ("file", ("file", "local"))
            out.append({"path": os.path.abspath(f) if local else f, "size": size, "digest": digest})
        return out

    def _file_batches(self, path: str) -> Iterator[tuple[pa.Table, list[str | None]]]:
        raise NotImplementedError

    def iter_range(self, start: int, stop: int) -> Iterator[InputBatch]:
        """Rows [start, stop) of the input, where `seekable`."""
        raise NotImplementedError

    def iter_batches(self) -> Iterator[InputBatch]:
        start = 0
        remaining = self.cfg.limit
        for path in self.files:
            label = self._label(path)
            row_in_file = 0
            for table, errors in self._file_batches(path):
                self.rows_read += table.num_rows
                if remaining is not None:
                    if remaining <= 0:
                        return
                    table, errors = table.slice(0, remaining), errors[:remaining]
                    remaining -= table.num_rows
                ids = self._ids(table, label, row_in_file)
                yield InputBatch(start=start, table=table, ids=ids, read_errors=errors)
                start += table.num_rows
                row_in_file += table.num_rows

    def _label(self, path: str) -> str:
        rel = os.path.relpath(path, self.root) if self.root else os.path.basename(path)
        return rel if not rel.startswith("..") else os.path.basename(path)

    def _ids(self, table: pa.Table, label: str, first_row: int) -> list[str]:
        col = self.cfg.id_column
        values = column_values(table, col) if col else [None] * table.num_rows  # mixed-type ids: as written
        return [f"{label}:{first_row + i}" if v is None else str(v) for i, v in enumerate(values)]
