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
from batchgen.records import InputBatch

log = logging.getLogger(__name__)

PARQUET_EXTS = (".parquet", ".pq")
JSONL_EXTS = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz")
FORMATS = ("auto", "parquet", "jsonl", "hf")
SCHEMA_SAMPLE_ROWS = 1000  # JSONL rows read to infer column types


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

    def problems(self) -> list[str]:
        out = []
        if self.path in ("???", "", None):
            out.append("dataset.path is required (a file, directory, glob or URL)")
        if self.format not in FORMATS:
            out.append(f"dataset.format must be one of {', '.join(FORMATS)} (got {self.format!r})")
        if self.limit is not None and self.limit < 0:
            out.append(f"dataset.limit must be >= 0 or null (got {self.limit})")
        if self.batch_rows < 1:
            out.append(f"dataset.batch_rows must be >= 1 (got {self.batch_rows})")
        if self.template is not None and self.messages_column is not None:
            out.append("dataset.template and dataset.messages_column are exclusive: set one of them")
        return out


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
        out = []
        for f in self.files:
            info = self.fs.info(f)
            mtime = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
            out.append({"path": f, "size": info.get("size"), "mtime": str(mtime), "etag": info.get("ETag")})
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
        values = table.column(col).to_pylist() if col else [None] * table.num_rows
        return [f"{label}:{first_row + i}" if v is None else str(v) for i, v in enumerate(values)]


class ParquetReader(Reader):
    def _open(self, path: str) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(self.fs.open(path, "rb"))
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"cannot read Parquet file {path}: {exc}") from exc

    def columns(self) -> list[str]:
        names: dict[str, None] = {}
        for path in self.files:
            names.update(dict.fromkeys(self._open(path).schema_arrow.names))
        return list(names)

    def count_rows(self) -> Optional[int]:
        total = sum(self._open(p).metadata.num_rows for p in self.files)
        return total if self.cfg.limit is None else min(total, self.cfg.limit)

    def _file_batches(self, path: str) -> Iterator[tuple[pa.Table, list[str | None]]]:
        pf = self._open(path)
        try:
            for batch in pf.iter_batches(batch_size=self.cfg.batch_rows):
                yield pa.Table.from_batches([batch]), [None] * batch.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"cannot read Parquet file {path}: {exc}") from exc


class JsonlReader(Reader):
    """Line by line, so that one malformed line costs one row (an error row carrying its line number)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._schema: Optional[pa.Schema] = None

    def columns(self) -> Optional[list[str]]:
        """None for an input without a single readable record: nothing to check."""
        names = self.schema().names
        return names if names else None

    def count_rows(self) -> Optional[int]:
        if any(self.fs.protocol not in ("file", ("file", "local")) or p.endswith((".gz", ".zst", ".bz2", ".xz"))
               for p in self.files):
            return None
        total = 0
        for path in self.files:
            with self.fs.open(path, "rb") as f:
                for line in iter(lambda: f.readline(), b""):
                    total += bool(line.strip())
        return total if self.cfg.limit is None else min(total, self.cfg.limit)

    def schema(self) -> pa.Schema:
        """Column types inferred from the first rows; later rows are converted to them."""
        if self._schema is None:
            sample: list[dict] = []
            for path in self.files:
                for _, record, _ in self._records(path):
                    if record is not None:
                        sample.append(record)
                    if len(sample) >= SCHEMA_SAMPLE_ROWS:
                        break
                if len(sample) >= SCHEMA_SAMPLE_ROWS:
                    break
            self._schema = _infer_schema(sample)
        return self._schema

    def _records(self, path: str) -> Iterator[tuple[int, Optional[dict], Optional[str]]]:
        """(line number from 1, record or None, error or None) for every non-blank line."""
        try:
            f = self.fs.open(path, "rb", compression="infer")
        except OSError as exc:
            raise InputError(f"cannot open JSONL file {path}: {exc}") from exc
        with f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                yield (lineno, *_parse_line(raw, lineno))

    def _file_batches(self, path: str) -> Iterator[tuple[pa.Table, list[str | None]]]:
        schema = self.schema()
        rows: list[dict] = []
        errors: list[str | None] = []
        prompt = self.cfg.prompt_column if self.cfg.template is None and not self.cfg.messages_column else None
        for _, record, error in self._records(path):
            rows.append(record or {})
            value = record.get(prompt) if record and prompt else None
            if error is None and value is not None and not isinstance(value, str):
                error = f"non_string_prompt: got {type(value).__name__}"  # before a mixed column becomes text
            errors.append(error)
            if len(rows) >= self.cfg.batch_rows:
                yield _to_table(rows, schema), errors
                rows, errors = [], []
        if rows:
            yield _to_table(rows, schema), errors


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
    if not isinstance(record, dict):
        return None, f"malformed_json: line {lineno}: expected an object, got {type(record).__name__}"
    return record, None


def _infer_schema(sample: list[dict]) -> pa.Schema:
    names: dict[str, None] = {}
    for record in sample:
        names.update(dict.fromkeys(record))
    fields = []
    for name in names:
        try:
            typ = pa.array([r.get(name) for r in sample]).type
        except (pa.ArrowException, TypeError, ValueError):
            typ = pa.string()  # mixed types: kept as JSON text
        fields.append(pa.field(name, pa.string() if pa.types.is_null(typ) else typ))
    return pa.schema(fields)


def _to_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    arrays = [_to_array([r.get(f.name) for r in rows], f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def _to_array(values: list, typ: pa.DataType) -> pa.Array:
    """Convert to the inferred type; a value that does not fit becomes JSON text (string) or null."""
    try:
        return pa.array(values, type=typ)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    out = []
    for v in values:
        try:
            pa.array([v], type=typ)
            out.append(v)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            out.append(json.dumps(v) if pa.types.is_string(typ) else None)
    return pa.array(out, type=typ)


def resolve_files(cfg: DatasetConfig) -> tuple[str, list[str], fsspec.AbstractFileSystem, str]:
    """(format, sorted files, filesystem, root for ids). Raises InputError naming dataset.path."""
    if cfg.format == "hf" or (cfg.format == "auto" and _is_saved_hf_dataset(cfg.path)):
        return "hf", [cfg.path], fsspec.filesystem("file"), ""
    fs, path = fsspec.core.url_to_fs(cfg.path)
    if any(ch in path for ch in "*?["):
        files, root = sorted(fs.glob(path)), _glob_root(path)
    elif fs.isdir(path):
        files = sorted(p for p in fs.find(path) if p.endswith(PARQUET_EXTS + JSONL_EXTS))
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
