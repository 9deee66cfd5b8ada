"""JSONL input: line by line (one bad line costs one row), column types decided over every line."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any, Optional

import pyarrow as pa

from batchgen.errors import InputError
from batchgen.reader.base import Reader
from batchgen.reader.config import BOM, MAX_DEPTH
from batchgen.reader.values import JSON_TEXT, is_json_text
from batchgen.records import InputBatch

log = logging.getLogger(__name__)


class JsonlReader(Reader):
    """Line by line, so that one malformed line costs one row (an error row carrying its line number).

    Column types are decided over every line of the input, in one streaming pass before any row is planned
    (`schema()`): a column keeps a native type (string, integer, float, bool, list, struct) only where every value
    of it has that type; integers and floats together are floats. A column whose values mix types anywhere, at
    any depth, is kept as JSON text (every value `json.dumps`ed, its field marked `batchgen.encoding=json`), so
    no value is ever changed by inference and no row's shape decides another row's fate. The same pass counts
    the rows, and (with `stride`, the part size) marks where every `stride`-th row starts, so that a shard or a
    resume reads only its own parts (`iter_range`). Both can be saved and loaded (`index`, `use_index`), so that the
    pass over every line runs once per input, not once per shard.
    """

    format = "jsonl"  # dataset.format: part of the saved pass's shape

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._schema: Optional[pa.Schema] = None
        self._rows: Optional[int] = None
        self.stride: Optional[int] = self.part_size  # a mark every `stride` rows (the part size), if given
        self._marks: list[tuple[int, int, int, int]] = []  # file index, byte offset, line number, row in the file

    @property
    def seekable(self) -> bool:  # type: ignore[override]
        """Marks at every part start, and every file plain (a compressed stream cannot seek)."""
        compressed = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".zip")
        return self.stride is not None and self._schema is not None and not any(
            f.endswith(compressed) for f in self.files)

    def shape(self) -> dict[str, Any]:
        """Everything besides the input's bytes that decides what the pass finds: the reader (openai_batch turns
        each line into other columns), the part size (where marks fall), dataset.limit (rows and types stop there),
        dataset.max_line_bytes and MAX_DEPTH (which lines are error rows, left out of the types). A saved pass of
        another shape is not used. Not in it: dataset.id_column and the prompt and passthrough columns, which are
        taken from the rows when they are read (the pass types every column of every line)."""
        return {"format": self.format, "stride": self.stride, "limit": self.cfg.limit,
                "max_line_bytes": self.cfg.max_line_bytes, "max_depth": MAX_DEPTH}

    def index(self) -> dict[str, Any]:
        """The pass's result and its shape, to be saved beside the output (see use_index)."""
        import base64

        self.schema()
        return {"shape": self.shape(), "rows": self._rows, "marks": self._marks,
                "schema": base64.b64encode(self._schema.serialize().to_pybytes()).decode()}

    def use_index(self, saved: dict[str, Any]) -> bool:
        """Take a saved pass (same input, checked by the caller; same shape) instead of reading every line again."""
        import base64

        if saved.get("shape") != self.shape():
            return False
        self._schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(saved["schema"])))
        self._rows = saved["rows"]
        self._marks = [tuple(m) for m in saved["marks"]]
        return True

    def columns(self) -> Optional[list[str]]:
        """None for an input without a single readable record: nothing to check."""
        names = self.schema().names
        return names if names else None

    def count_rows(self) -> Optional[int]:
        self.schema()
        assert self._rows is not None
        return self._rows if self.cfg.limit is None else min(self._rows, self.cfg.limit)

    def schema(self) -> pa.Schema:
        """Column types over every record of the input (one pass, computed once)."""
        if self._schema is None:
            kinds: dict[str, Any] = {}
            rows = 0
            self._marks = []
            for file_index, path in enumerate(self.files):
                row_in_file = 0
                for lineno, record, _, offset in self._records(path):
                    if self.stride and rows % self.stride == 0:
                        self._marks.append((file_index, offset, lineno - 1, row_in_file))
                    rows += 1
                    row_in_file += 1
                    self.rows_typed += 1
                    if record is None:
                        continue
                    for name, value in record.items():
                        kinds[name] = _merge(kinds.get(name, _NULL), _kind(value))
                    if self.cfg.limit is not None and rows >= self.cfg.limit:
                        break
                if self.cfg.limit is not None and rows >= self.cfg.limit:
                    break
            self._schema = pa.schema([_field(name, kind) for name, kind in kinds.items()])
            self._rows = rows
        return self._schema

    def _records(self, path: str, offset: int = 0, lineno: int = 0, row: int = 0
                 ) -> Iterator[tuple[int, Optional[dict], Optional[str], int]]:
        """(line number from 1, record or None, error or None, the line's byte offset) for every non-blank line,
        from byte `offset` (line `lineno` + 1, the file's row `row`) on. A line over dataset.max_line_bytes is
        skipped unread past the limit (memory stays bounded) and errs as too_large; one nested deeper than MAX_DEPTH
        errs as too_deep. A UTF-8 byte order mark opening the file is dropped. An error names the line (from 1, as
        an editor counts) and the row's generated id (`<file>:<row>`, rows from 0, blank lines not counted)."""
        limit, label = self.cfg.max_line_bytes, self._label(path)
        try:
            f = self.fs.open(path, "rb", compression="infer")
            if offset:
                f.seek(offset)
        except OSError as exc:
            raise InputError(f"cannot open JSONL file {path}: {exc}") from exc
        with f:
            while True:
                start = f.tell() if self.stride else 0
                raw = f.readline(limit + 1)
                if not raw:
                    return
                lineno += 1
                where = f"line {lineno} ({label}:{row})"
                if lineno == 1 and raw.startswith(BOM):
                    raw = raw[len(BOM):]
                if len(raw) > limit and not raw.endswith(b"\n"):
                    size = len(raw) + _skip_line(f)
                    row += 1
                    yield lineno, None, (f"too_large: {where} is {size} bytes, over dataset.max_line_bytes="
                                         f"{limit}; raise it to read such lines"), start
                    continue
                if not raw.strip():
                    continue
                row += 1
                yield (lineno, *_parse_line(raw, where), start)

    def _file_batches(self, path: str) -> Iterator[tuple[pa.Table, list[str | None]]]:
        schema = self.schema()
        rows: list[dict] = []
        errors: list[str | None] = []
        for _, record, error, _ in self._records(path):
            rows.append(record or {})
            errors.append(error)
            if len(rows) >= self.cfg.batch_rows:
                yield _to_table(rows, schema, errors), errors
                rows, errors = [], []
        if rows:
            yield _to_table(rows, schema, errors), errors

    def iter_range(self, start: int, stop: int) -> Iterator[InputBatch]:
        """Input rows [start, stop), read from the mark at `start` (a part's first row) on: the lines before it are
        never read."""
        schema = self.schema()
        stop = min(stop, self.count_rows() or 0)
        if start >= stop:
            return
        file_index, offset, lineno, row_in_file = self._marks[start // self.stride]  # type: ignore[operator]
        row, rows, errors, first = start, [], [], start
        for path in self.files[file_index:]:
            label = self._label(path)
            for _, record, error, _ in self._records(path, offset, lineno, row_in_file):
                rows.append(record or {})
                errors.append(error)
                row += 1
                if len(rows) >= self.cfg.batch_rows or row == stop:
                    yield self._batch(rows, errors, schema, first, label, row_in_file)
                    row_in_file += len(rows)
                    first, rows, errors = row, [], []
                if row == stop:
                    return
            if rows:
                yield self._batch(rows, errors, schema, first, label, row_in_file)
                first, rows, errors = row, [], []
            offset, lineno, row_in_file = 0, 0, 0

    def _batch(self, rows: list[dict], errors: list[Optional[str]], schema: pa.Schema, first: int, label: str,
               row_in_file: int) -> InputBatch:
        self.rows_read += len(rows)
        table = _to_table(rows, schema, errors)
        return InputBatch(start=first, table=table, ids=self._ids(table, label, row_in_file), read_errors=errors)


def _parse_line(raw: bytes, where: str) -> tuple[Optional[dict], Optional[str]]:
    """The line's record, or its error; `where` names the line in the error ("line 6 (in.jsonl:5)")."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid_utf8: {where}: {exc.reason} at byte {exc.start}"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"malformed_json: {where}: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return None, f"too_deep: {where}: nested deeper than the JSON parser allows (limit {MAX_DEPTH})"
    if not isinstance(record, dict):
        return None, f"malformed_json: {where}: expected an object, got {type(record).__name__}"
    if _too_deep(record, MAX_DEPTH):
        return None, f"too_deep: {where}: a value nested more than {MAX_DEPTH} levels deep"
    return record, None


def _skip_line(f: Any) -> int:
    """Read past the rest of an over-long line in 1 MiB pieces; returns the bytes skipped."""
    skipped = 0
    while True:
        chunk = f.readline(1 << 20)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def _too_deep(value: Any, limit: int) -> bool:
    """True where lists or objects nest more than `limit` levels below `value` (iterative: no recursion limit)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


# Kinds of JSON values, merged over a column to decide its type: scalars by name, ("list", element kind),
# ("struct", {key: kind}), _NULL (no value seen yet) and _MIXED (types that no single Arrow type holds exactly).
_NULL, _MIXED = "null", "mixed"
INT64_MAX, EXACT_FLOAT_INT = 2**63 - 1, 2**53


def _kind(value: Any) -> Any:
    if value is None:
        return _NULL
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if abs(value) <= EXACT_FLOAT_INT else "bigint" if -INT64_MAX - 1 <= value <= INT64_MAX else _MIXED
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        element: Any = _NULL
        for item in value:
            element = _merge(element, _kind(item))
            if element == _MIXED:
                break
        return ("list", element)
    if not value:
        return _MIXED  # {}: a struct without fields has no Parquet type; kept as JSON text
    return ("struct", {k: _kind(v) for k, v in value.items()})


def _merge(a: Any, b: Any) -> Any:
    if a == _NULL:
        return b
    if b == _NULL or a == b:
        return a
    if isinstance(a, str) and isinstance(b, str):  # two different scalar kinds
        pair = {a, b}
        if pair == {"int", "float"}:
            return "float"  # an integer up to 2**53 is exactly a float
        return "bigint" if pair == {"int", "bigint"} else _MIXED
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0]:
        if a[0] == "list":
            element = _merge(a[1], b[1])
            return _MIXED if element == _MIXED else ("list", element)
        fields = dict(a[1])
        for key, kind in b[1].items():
            fields[key] = _merge(fields.get(key, _NULL), kind)
            if fields[key] == _MIXED:
                return _MIXED
        return ("struct", fields)
    return _MIXED


def _arrow_type(kind: Any) -> Optional[pa.DataType]:
    """The Arrow type holding every value of `kind` exactly; None where there is none (JSON text then)."""
    if kind == _NULL:
        return pa.string()
    if kind == _MIXED:
        return None
    if isinstance(kind, str):
        return {"bool": pa.bool_(), "int": pa.int64(), "bigint": pa.int64(), "float": pa.float64(),
                "str": pa.string()}[kind]
    if kind[0] == "list":
        element = _arrow_type(kind[1])
        return None if element is None else pa.list_(element)
    fields = [(key, _arrow_type(child)) for key, child in kind[1].items()]
    return None if any(t is None for _, t in fields) else pa.struct(fields)


def _field(name: str, kind: Any) -> pa.Field:
    typ = _arrow_type(kind)
    if typ is None:
        log.info("JSONL column %r mixes value types; it is kept as JSON text", name)
        return pa.field(name, pa.string(), metadata=JSON_TEXT)
    return pa.field(name, typ)


def _to_table(rows: list[dict], schema: pa.Schema, errors: list[Optional[str]]) -> pa.Table:
    arrays = [_to_array([r.get(f.name) for r in rows], f, errors) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _to_array(values: list, field: pa.Field, errors: list[Optional[str]]) -> pa.Array:
    """The column's values in its type, exactly. JSON text columns get every value dumped. A value that does not
    fit (the file changed after its types were decided) is never coerced: its row becomes a bad_value error."""
    if is_json_text(field):
        return pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())
    try:
        return pa.array(values, type=field.type)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    out = []
    for row, v in enumerate(values):
        try:
            pa.array([v], type=field.type)
            out.append(v)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            out.append(None)
            if errors[row] is None:
                errors[row] = f"bad_value: column {field.name!r} holds a {type(v).__name__} where the input's " \
                              f"other rows have {field.type}"
    return pa.array(out, type=field.type)
