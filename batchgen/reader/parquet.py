"""Parquet input: schemas unified up front, read row group by row group with page checksums verified."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import NamedTuple, Optional

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
    rows, which become `unreadable` error rows naming the file and row group; the rest of the input goes on.

    Memory: one decoded batch (dataset.batch_rows rows) at a time, however large a row group is (pyarrow writes one
    row group per file up to about a million rows). A row group is never held whole; a seeking run (iter_range)
    instead keeps its place in the row group between parts (_Cursor), so parts asked for in order read each row group
    once. The price: a cursor moves forward only, and Parquet cannot start mid row group, so the rows between this
    worker's parts inside one row group (other shards' parts, committed parts) are decoded and dropped, each once.
    All columns are read: the job passes through every column unless dataset.passthrough_columns narrows it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._schema: Optional[pa.Schema] = None
        self._groups: Optional[list[tuple[str, list[int]]]] = None
        self._span_list: Optional[list[_Span]] = None  # every row group's place in the input (iter_range)
        self._cursor: Optional[_Cursor] = None  # where the last iter_range stopped reading

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
            first: dict[str, str] = {}  # column -> the first file that has it (named when a later file disagrees)
            for path in self.files:
                schema = self._open(path).schema_arrow.remove_metadata()
                for name in schema.names:
                    first.setdefault(name, path)
                if unified is None:
                    unified = schema
                    continue
                try:
                    unified = pa.unify_schemas([unified, schema], promote_options="permissive")
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    column = next(f.name for f in schema if f.name in unified.names
                                  and unified.field(f.name).type != f.type)
                    raise InputError(
                        f"dataset.path: column {column!r} is {schema.field(column).type} in {path} but "
                        f"{unified.field(column).type} in {first[column]}; make the files agree (cast the column), or "
                        f"point dataset.path at one kind") from None
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
        total = sum(sum(sizes) for _, sizes in self.row_groups())  # footers read once, not once per part
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

    # -- seeking: parts from footers, a worker reads only its own row groups, each once --------------------------

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
        and row groups that hold them. A row group is read through a forward cursor (_Cursor) kept between calls,
        so that parts asked for in order (the planner's) read each row group once, however many parts it holds."""
        stop = min(stop, self.count_rows() or 0)
        for span in self._spans():
            if span.first >= stop:
                return
            if span.first + span.size > start:
                yield from self._range_in_group(span, max(start, span.first), min(stop, span.first + span.size))

    def _spans(self) -> list[_Span]:
        """Every row group with its first input row and its file's first input row."""
        if self._span_list is None:
            self._span_list, offset = [], 0
            for path, sizes in self.row_groups():
                first = offset
                for group, size in enumerate(sizes):
                    self._span_list.append(_Span(path, group, offset, size, first))
                    offset += size
        return self._span_list

    def _range_in_group(self, span: _Span, lo: int, hi: int) -> Iterator[InputBatch]:
        cursor = self._cursor
        if cursor is None or cursor.span != span or cursor.pos > lo:  # another row group, or behind: start it over
            if cursor is not None:
                cursor.batches.close()
            pf = self._open(span.path)
            cursor = self._cursor = _Cursor(span, span.first, self._group_batches(pf, span.path, span.group))
        label = self._label(span.path)
        while cursor.pos < hi:
            pos, (table, errors) = cursor.pos, cursor.next_batch(self)
            cursor.advance(table, errors, hi)  # before handing rows out: a consumer may stop at any yield
            a, b = max(lo, pos), min(hi, pos + table.num_rows)
            if a < b:
                piece = table.slice(a - pos, b - a)
                yield InputBatch(start=a, table=piece, ids=self._ids(piece, label, a - span.file_first),
                                 read_errors=errors[a - pos:b - pos])


class _Span(NamedTuple):
    path: str
    group: int  # the row group's number in its file
    first: int  # its first row's number in the input
    size: int
    file_first: int  # its file's first row's number in the input (generated ids count from there)


class _Cursor:
    """Where reading stopped inside one row group: its batches still to decode, and the decoded rows of the last
    batch that a part ending mid-batch left over (`held`, starting at input row `pos`). It holds at most one
    decoded batch (dataset.batch_rows rows) and only moves forward."""

    def __init__(self, span: _Span, pos: int, batches: Iterator[tuple[pa.Table, list[str | None]]]):
        self.span, self.pos, self.batches = span, pos, batches
        self.held: Optional[tuple[pa.Table, list[str | None]]] = None

    def next_batch(self, reader: Reader) -> tuple[pa.Table, list[str | None]]:
        """The rows from `pos` on: what is held, else the next batch decoded (counted in reader.rows_read)."""
        if self.held is not None:
            return self.held
        try:
            table, errors = next(self.batches)
        except StopIteration:  # fewer rows than the footer says: never hand out a short part as if whole
            raise InputError(f"{self.span.path} row group {self.span.group}: its footer says {self.span.size} rows "
                             f"but it ended after {self.pos - self.span.first}; the file is damaged: rewrite it "
                             f"or drop it from dataset.path") from None
        reader.rows_read += table.num_rows
        return table, errors

    def advance(self, table: pa.Table, errors: list[str | None], hi: int) -> None:
        """Past `table` (which starts at `pos`), or only up to input row `hi`, holding the rest for the next part."""
        if self.pos + table.num_rows <= hi:
            self.pos, self.held = self.pos + table.num_rows, None
        else:
            k = hi - self.pos
            self.pos, self.held = hi, (table.slice(k), errors[k:])


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
