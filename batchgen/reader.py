"""Streaming readers: Parquet, JSONL and Hugging Face datasets, in a deterministic row order.

The reader owns file discovery, format detection, row ids and per-row read errors (malformed JSONL
lines). It never holds more than one batch of rows; it knows nothing about prompts or models.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import InputError
from batchgen.fsutil import content_digest
from batchgen.records import InputBatch

log = logging.getLogger(__name__)

PARQUET_EXTS = (".parquet", ".pq")
JSONL_EXTS = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz")
FORMATS = ("auto", "parquet", "jsonl", "hf")
VERIFY = ("footers", "pages")
MAX_DEPTH = 32  # nesting of a JSONL value beyond which its row is a too_deep error (Parquet readers choke deeper)
BOM = b"\xef\xbb\xbf"
JSON_TEXT = {b"batchgen.encoding": b"json"}  # field metadata of a column kept as JSON text (its types mix)


@dataclass
class DatasetConfig:
    path: str = "???"  # file, directory, glob or fsspec URL; or a `datasets` dir / hub id for format=hf
    format: str = "auto"  # auto | parquet | jsonl | hf
    id_column: Optional[str] = None  # unique row id column; null = `<file>:<row>`
    prompt_column: str = "prompt"
    template: Optional[str] = None  # "Summarize:\n{text}", rendered with the row's columns
    messages_column: Optional[str] = None  # list of {role, content}, rendered with the chat template
    system_prompt: Optional[str] = None  # system message for chat rendering
    passthrough_columns: Optional[list[str]] = None  # null = all non-prompt columns
    limit: Optional[int] = None  # first N rows only
    max_new_tokens_column: Optional[str] = None  # per-row cap on generated tokens
    split: Optional[str] = None  # format=hf: split of a DatasetDict or hub dataset
    batch_rows: int = 2048  # rows per read batch (memory bound of the reader)
    max_line_bytes: int = 8 * 1024 * 1024  # JSONL: a longer line is a too_large error row, never parsed
    verify: str = "pages"  # Parquet, before generation: pages (every page read once, checksums) | footers only

    def problems(self) -> list[str]:
        out = []
        if self.path in ("???", "", None):
            out.append("dataset.path is required (a file, directory, glob or URL)")
        else:
            out += _path_problems(self.path, self.format)
        if self.format not in FORMATS:
            out.append(f"dataset.format must be one of {', '.join(FORMATS)} (got {self.format!r})")
        if self.limit is not None and self.limit < 0:
            out.append(f"dataset.limit must be >= 0 or null (got {self.limit})")
        if self.batch_rows < 1:
            out.append(f"dataset.batch_rows must be >= 1 (got {self.batch_rows})")
        if self.verify not in VERIFY:
            out.append(f"dataset.verify must be one of {', '.join(VERIFY)} (got {self.verify!r})")
        if self.max_line_bytes < 1:
            out.append(f"dataset.max_line_bytes must be >= 1 (got {self.max_line_bytes})")
        if self.template is not None and self.messages_column is not None:
            out.append("dataset.template and dataset.messages_column are exclusive: set one of them")
        return out


def _path_problems(path: str, fmt: str) -> list[str]:
    """A URL whose filesystem is not installed, or a local path that does not exist (no glob, not a hub id)."""
    if "://" in path:
        protocol = path.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            return [f"dataset.path: {protocol}:// needs a package that is not installed: {exc}"]
        except ValueError:
            return [f"dataset.path: unknown URL scheme {protocol}:// (fsspec knows no such filesystem)"]
        return []
    if any(ch in path for ch in "*?[") or os.path.exists(path) or fmt == "hf":
        return []
    return [f"dataset.path: no such file or directory: {path}"]


class Reader:
    """Base: resolves files, numbers rows across files, applies `limit`, makes ids."""

    def __init__(self, cfg: DatasetConfig, files: list[str], fs: fsspec.AbstractFileSystem, root: str):
        self.cfg = cfg
        self.files = files
        self.fs = fs
        self.root = root

    def columns(self) -> Optional[list[str]]:
        """Column names, or None where the input has no readable record to tell them from."""
        raise NotImplementedError

    def count_rows(self) -> Optional[int]:
        """Total rows (after limit) if cheaply known, else None."""
        return None

    def fingerprint(self) -> list[dict[str, Any]]:
        """Each input file by path, size and content digest (fsutil.content_digest): a resume refuses changed
        bytes, and accepts a file touched or rewritten with the same bytes (its mtime is not compared)."""
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

    def iter_batches(self) -> Iterator[InputBatch]:
        start = 0
        remaining = self.cfg.limit
        for path in self.files:
            label = self._label(path)
            row_in_file = 0
            for table, errors in self._file_batches(path):
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


class ParquetReader(Reader):
    """Parquet files under one schema: the files' schemas unified up front (a column missing from a file reads as
    nulls there; integer and float widths promote), or the job refused before any generation naming the file and
    the column. Read row group by row group: a row group that fails mid-job (a corrupt page) costs its unread
    rows, which become `unreadable` error rows naming the file and row group; the rest of the input goes on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._schema: Optional[pa.Schema] = None

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

    def verify_pages(self) -> None:
        """dataset.verify=pages: read every page once (checksums verified where the file has them), batch by
        batch, before generation; every row group that fails is named in one InputError."""
        bad = []
        for path in self.files:
            pf = self._open(path)
            for group in range(pf.metadata.num_row_groups):
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
        schema = self.schema()
        pf = self._open(path)
        for group in range(pf.metadata.num_row_groups):
            size, done = pf.metadata.row_group(group).num_rows, 0
            try:
                for batch in pf.iter_batches(batch_size=self.cfg.batch_rows, row_groups=[group]):
                    done += batch.num_rows
                    yield _conform(pa.Table.from_batches([batch]), schema), [None] * batch.num_rows
            except (pa.ArrowException, OSError) as exc:
                if size == done:
                    continue
                log.error("%s row group %d: %s; its %d unread rows become error rows", path, group, exc, size - done)
                error = f"unreadable: {path} row group {group}: {_one_line(exc)}"
                yield _nulls(schema, size - done), [error] * (size - done)


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


class JsonlReader(Reader):
    """Line by line, so that one malformed line costs one row (an error row carrying its line number).

    Column types are decided over every line of the input, in one streaming pass before any row is planned
    (`schema()`): a column keeps a native type (string, integer, float, bool, list, struct) only where every value
    of it has that type; integers and floats together are floats. A column whose values mix types anywhere, at
    any depth, is kept as JSON text (every value `json.dumps`ed, its field marked `batchgen.encoding=json`), so
    no value is ever changed by inference and no row's shape decides another row's fate. The same pass counts
    the rows.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._schema: Optional[pa.Schema] = None
        self._rows: Optional[int] = None

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
            for path in self.files:
                for _, record, _ in self._records(path):
                    rows += 1
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

    def _records(self, path: str) -> Iterator[tuple[int, Optional[dict], Optional[str]]]:
        """(line number from 1, record or None, error or None) for every non-blank line. A line over
        dataset.max_line_bytes is skipped unread past the limit (memory stays bounded) and errs as too_large; one
        nested deeper than MAX_DEPTH errs as too_deep. A UTF-8 byte order mark opening the file is dropped."""
        limit = self.cfg.max_line_bytes
        try:
            f = self.fs.open(path, "rb", compression="infer")
        except OSError as exc:
            raise InputError(f"cannot open JSONL file {path}: {exc}") from exc
        with f:
            lineno = 0
            while True:
                raw = f.readline(limit + 1)
                if not raw:
                    return
                lineno += 1
                if lineno == 1 and raw.startswith(BOM):
                    raw = raw[len(BOM):]
                if len(raw) > limit and not raw.endswith(b"\n"):
                    size = len(raw) + _skip_line(f)
                    yield lineno, None, (f"too_large: line {lineno} is {size} bytes, over dataset.max_line_bytes="
                                         f"{limit}; raise it to read such lines")
                    continue
                if not raw.strip():
                    continue
                yield (lineno, *_parse_line(raw, lineno))

    def _file_batches(self, path: str) -> Iterator[tuple[pa.Table, list[str | None]]]:
        schema = self.schema()
        rows: list[dict] = []
        errors: list[str | None] = []
        for _, record, error in self._records(path):
            rows.append(record or {})
            errors.append(error)
            if len(rows) >= self.cfg.batch_rows:
                yield _to_table(rows, schema, errors), errors
                rows, errors = [], []
        if rows:
            yield _to_table(rows, schema, errors), errors


class HFReader(Reader):
    """A `datasets` dataset saved with save_to_disk (memory-mapped), or a hub/builder id streamed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ds = None

    def dataset(self):
        if self._ds is None:
            self._ds = _load_hf(self.cfg)
        return self._ds

    def columns(self) -> list[str]:
        ds = self.dataset()
        names = ds.column_names or list((ds.features or {}).keys())
        return list(names)

    def count_rows(self) -> Optional[int]:
        ds = self.dataset()
        if not hasattr(ds, "__len__"):
            return None
        return len(ds) if self.cfg.limit is None else min(len(ds), self.cfg.limit)

    def fingerprint(self) -> list[dict[str, Any]]:
        ds = self.dataset()
        return [{"path": self.cfg.path, "split": self.cfg.split, "fingerprint": getattr(ds, "_fingerprint", None)}]

    def _file_batches(self, path: str) -> Iterator[tuple[pa.Table, list[str | None]]]:
        ds = self.dataset()
        if hasattr(ds, "with_format") and hasattr(ds, "__len__"):
            for table in ds.with_format("arrow").iter(batch_size=self.cfg.batch_rows):
                yield table, [None] * table.num_rows
            return
        for batch in ds.iter(batch_size=self.cfg.batch_rows):
            table = pa.Table.from_pydict(batch)
            yield table, [None] * table.num_rows


def _load_hf(cfg: DatasetConfig):
    import datasets

    local = os.path.isdir(cfg.path)
    try:
        if local:
            ds = datasets.load_from_disk(cfg.path)
        else:
            ds = datasets.load_dataset(cfg.path, split=cfg.split or "train", streaming=True)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise InputError(f"dataset.path: cannot load HF dataset {cfg.path!r}: {exc}") from exc
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        split = cfg.split or ("train" if "train" in ds else None)
        if split not in ds:
            raise InputError(f"dataset.split: choose one of {sorted(ds)} for {cfg.path}")
        ds = ds[split]
    return ds


def _parse_line(raw: bytes, lineno: int) -> tuple[Optional[dict], Optional[str]]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid_utf8: line {lineno}: {exc.reason} at byte {exc.start}"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"malformed_json: line {lineno}: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return None, f"too_deep: line {lineno}: nested deeper than the JSON parser allows (limit {MAX_DEPTH})"
    if not isinstance(record, dict):
        return None, f"malformed_json: line {lineno}: expected an object, got {type(record).__name__}"
    if _too_deep(record, MAX_DEPTH):
        return None, f"too_deep: line {lineno}: a value nested more than {MAX_DEPTH} levels deep"
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


def is_json_text(field: pa.Field) -> bool:
    return (field.metadata or {}).get(b"batchgen.encoding") == b"json"


def column_values(table: pa.Table, name: str) -> list:
    """A column's values as Python objects, as the input wrote them: a JSON-text column (mixed types) decoded."""
    values = table.column(name).to_pylist()
    if is_json_text(table.schema.field(name)):
        values = [None if v is None else json.loads(v) for v in values]
    return values


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


def resolve_files(cfg: DatasetConfig) -> tuple[str, list[str], fsspec.AbstractFileSystem, str]:
    """(format, sorted files, filesystem, root for ids). Raises InputError naming dataset.path."""
    if cfg.format == "hf" or (cfg.format == "auto" and _is_saved_hf_dataset(cfg.path)):
        return "hf", [cfg.path], fsspec.filesystem("file"), ""
    fs, path = fsspec.core.url_to_fs(cfg.path)
    if any(ch in path for ch in "*?["):
        root = _glob_root(path)
        files = sorted(p for p in fs.glob(path) if not _hidden(p, root))
    elif fs.isdir(path):
        files = sorted(p for p in fs.find(path) if p.endswith(PARQUET_EXTS + JSONL_EXTS) and not _hidden(p, path))
        root = path
    elif fs.exists(path):
        files, root = [path], ""
    else:
        raise InputError(f"dataset.path: no such file or directory: {cfg.path}")
    files = [f for f in files if not fs.isdir(f)]
    if not files:
        raise InputError(f"dataset.path: no Parquet or JSONL files match {cfg.path}")
    fmt = cfg.format if cfg.format != "auto" else _format_of(files)
    files = [fs.unstrip_protocol(f) if fs.protocol not in ("file", ("file", "local")) else f for f in files]
    return fmt, files, fs, root


def _hidden(path: str, root: str) -> bool:
    """A file or folder under `root` whose name starts with `_` or `.` (pyarrow's rule): a batchgen output's
    _manifest.json, _status.json, _SUCCESS and journals, temp parts, .ipynb_checkpoints. A directory of parts
    from an earlier job is then an input like any other."""
    rel = path[len(root):] if root and path.startswith(root) else os.path.basename(path)
    return any(name.startswith(("_", ".")) for name in rel.split("/") if name)


def _is_saved_hf_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, name)) for name in ("dataset_dict.json", "state.json")
    )


def _glob_root(pattern: str) -> str:
    parts = pattern.split("/")
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if any(c in p for c in "*?["))]]
    return "/".join(fixed)


def _format_of(files: list[str]) -> str:
    kinds = {"parquet" if f.endswith(PARQUET_EXTS) else "jsonl" if f.endswith(JSONL_EXTS) else None for f in files}
    if None in kinds:
        bad = next(f for f in files if not f.endswith(PARQUET_EXTS + JSONL_EXTS))
        raise InputError(f"dataset.format: cannot tell the format of {bad}; set dataset.format=parquet|jsonl|hf")
    if len(kinds) > 1:
        raise InputError("dataset.path mixes Parquet and JSONL files; point it at one format")
    return kinds.pop()


READERS: dict[str, type[Reader]] = {"parquet": ParquetReader, "jsonl": JsonlReader, "hf": HFReader}


def open_reader(cfg: DatasetConfig) -> Reader:
    fmt, files, fs, root = resolve_files(cfg)
    return READERS[fmt](cfg, files, fs, root)
