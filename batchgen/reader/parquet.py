"""Parquet input: schemas unified up front, read row group by row group with page checksums verified."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import InputError
from batchgen.reader.base import Reader
from batchgen.records import InputBatch

log = logging.getLogger(__name__)


class ParquetReader(Reader):
    """Parquet files under one schema: the files' schemas unified up front (a column missing from a file reads as
    nulls there; integer and float widths promote), or the job refused before any generation naming the file and
    the column. Read row group by row group: a row group that fails mid-job (a corrupt page) costs its unread
    rows, which become `unreadable` error rows naming the file and row group; the rest of the input goes on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._schema: Optional[pa.Schema] = None
        self._groups: Optional[list[tuple[str, list[int]]]] = None

    def _open(self, path: str) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(self.fs.open(path, "rb"), page_checksum_verification=True)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"cannot read Parquet file {path}: {exc}") from exc

    def schema(self) -> pa.Schema:
        """Every file's footer read (a corrupt one stops the job here, before the model loads) and their schemas
        unified."""
        if self._schema is None:
            unified: Optional[pa.Schema] = None
            first = None
            for path in self.files:
                schema = self._open(path).schema_arrow.remove_metadata()
                if unified is None:
                    unified, first = schema, path
                    continue
                try:
                    unified = pa.unify_schemas([unified, schema], promote_options="permissive")
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    column = next(f.name for f in schema if f.name in unified.names
                                  and unified.field(f.name).type != f.type)
                    raise InputError(
                        f"dataset.path: column {column!r} is {schema.field(column).type} in {path} but "
                        f"{unified.field(column).type} in {first}; make the files agree (cast the column), or point "
                        f"dataset.path at one kind") from None
            self._schema = unified if unified is not None else pa.schema([])
        return self._schema

    def columns(self) -> list[str]:
        return self.schema().names

    def verify_pages(self, wanted: Optional[Callable[[int, int], bool]] = None) -> None:
        """dataset.verify=pages: read every page once (checksums verified where the file has them), batch by
        batch, before generation; every row group that fails is named in one InputError. `wanted(first, end)`:
        only the row groups holding input rows [first, end) that this worker will read (its shard's parts)."""
        bad = []
        offset = 0
        for path, sizes in self.row_groups():
            pf = self._open(path)
            for group, size in enumerate(sizes):
                offset += size
                if wanted is not None and not wanted(offset - size, offset):
                    continue
                try:
                    for _ in pf.iter_batches(batch_size=self.cfg.batch_rows, row_groups=[group]):
                        pass
                except (pa.ArrowException, OSError) as exc:
                    bad.append(f"{path} row group {group}: {_one_line(exc)}")
        if bad:
            raise InputError("dataset.verify=pages: unreadable pages in " + "; ".join(bad) + ". Repair or drop "
                             "these files, or set dataset.verify=footers to record their rows as errors and go on")

    def count_rows(self) -> Optional[int]:
        total = sum(self._open(p).metadata.num_rows for p in self.files)
        return total if self.cfg.limit is None else min(total, self.cfg.limit)

    def _file_batches(self, path: str) -> Iterator[tuple[pa.Table, list[str | None]]]:
        pf = self._open(path)
        for group in range(pf.metadata.num_row_groups):
            yield from self._group_batches(pf, path, group)

    def _group_batches(self, pf: pq.ParquetFile, path: str, group: int) -> Iterator[tuple[pa.Table, list[str | None]]]:
        schema = self.schema()
        size, done = pf.metadata.row_group(group).num_rows, 0
        try:
            for batch in pf.iter_batches(batch_size=self.cfg.batch_rows, row_groups=[group]):
                done += batch.num_rows
                yield _conform(pa.Table.from_batches([batch]), schema), [None] * batch.num_rows
        except (pa.ArrowException, OSError) as exc:
            if size == done:
                return
            log.error("%s row group %d: %s; its %d unread rows become error rows", path, group, exc, size - done)
            error = f"unreadable: {path} row group {group}: {_one_line(exc)}"
            yield _nulls(schema, size - done), [error] * (size - done)

    # -- seeking: parts from footers, a worker reads only its own row groups --------------------------------------

    seekable = True

    def row_groups(self) -> list[tuple[str, list[int]]]:
        """Each file's row-group sizes, from its footer (read once)."""
        if self._groups is None:
            self._groups = []
            for path in self.files:
                meta = self._open(path).metadata
                self._groups.append((path, [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]))
        return self._groups

    def iter_range(self, start: int, stop: int) -> Iterator[InputBatch]:
        """Input rows [start, stop) (numbered across files in order, after dataset.limit), opening only the files
        and row groups that hold them; a row group straddling the range is read whole and sliced."""
        stop = min(stop, self.count_rows() or 0)
        offset = 0  # the current file's first row in the input
        for path, sizes in self.row_groups():
            n = sum(sizes)
            if offset >= stop:
                return
            if offset + n > start:
                yield from self._range_in_file(path, sizes, offset, start, stop)
            offset += n

    def _range_in_file(self, path: str, sizes: list[int], offset: int, start: int, stop: int) -> Iterator[InputBatch]:
        pf, label, group_start = self._open(path), self._label(path), offset
        for group, size in enumerate(sizes):
            lo, hi = max(start, group_start), min(stop, group_start + size)
            pos = group_start
            if lo < hi:
                for table, errors in self._group_batches(pf, path, group):
                    self.rows_read += table.num_rows
                    a, b = max(lo, pos), min(hi, pos + table.num_rows)
                    if a < b:
                        piece = table.slice(a - pos, b - a)
                        yield InputBatch(start=a, table=piece, ids=self._ids(piece, label, a - offset),
                                         read_errors=errors[a - pos:b - pos])
                    pos += table.num_rows
                    if pos >= hi:
                        break
            group_start += size


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A file's table in the unified schema: its columns in order, promoted, and nulls for those it lacks."""
    if table.schema.equals(schema):
        return table
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
               for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def _nulls(schema: pa.Schema, rows: int) -> pa.Table:
    return pa.Table.from_arrays([pa.nulls(rows, f.type) for f in schema], schema=schema)
