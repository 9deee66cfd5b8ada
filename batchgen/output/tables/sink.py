"""The table sink's format-independent half: exactly-once commits by transaction name, the rows as the table holds
them, schema checks. Its formats: delta.py, iceberg.py; what the sink is and does: the package's docstring."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Optional

import pyarrow as pa

from batchgen.errors import BatchgenError, ConfigError
from batchgen.output.view import OCCURRENCE

log = logging.getLogger(__name__)
TXN_KEY = "batchgen.txn"  # the commit's name, in Delta's commitInfo and Iceberg's snapshot summary
STATS_KEY = "batchgen.stats"  # the part's counts, as in its file metadata
KEYS = ("id", "sample_index")  # what output.mode=upsert merges on
COMMIT_TRIES = 8


class TableSink:
    """One table, written by one output (its job id). Subclasses know their format: `_load`, `_create`, `_schema`,
    `_holds`, `_stats_of`, `_write`, `_conflict`."""

    format = ""

    def __init__(self, output: Any, job_id: str):
        self.output = output
        self.job_id = job_id
        self.evolve = output.schema_evolution == "add_columns"
        self.upsert = output.mode == "upsert"
        self.known: set[int] = set()  # parts of this output in the table: read by refresh(), then our own commits
        self.commits = 0  # parts this process committed to the table
        self.commit_s = 0.0  # the time those commits took (the summary's, the benchmark's)

    def txn(self, index: int) -> str:
        return f"batchgen-{self.job_id}-part-{index:05d}"

    def describe(self) -> str:
        return f"{self.format} table {self.output.table}"

    def refresh(self, indices: Iterable[int]) -> set[int]:
        """Which of these parts the table holds (its transactions' names), remembered in `known`."""
        indices = list(indices)
        table = self._load()
        names = self._holds(table, [self.txn(k) for k in indices]) if table is not None else set()
        self.known = {k for k in indices if self.txn(k) in names}
        return self.known

    def stats(self, index: int) -> Optional[dict[str, Any]]:
        """A part's counts as its commit recorded them (a part in the table whose file output_dir lost)."""
        table = self._load()
        raw = self._stats_of(table, self.txn(index)) if table is not None else None
        return json.loads(raw) if raw else None

    def reconcile(self, parts: Iterable[int], read: Callable[[int], pa.Table], attempt: int) -> None:
        """Commit the parts committed in output_dir that the table lacked when `refresh` read it (a run killed
        between the two); commit() asks the table again, so a part another process committed since is not doubled."""
        for k in sorted(parts):
            log.info("part %d is in output_dir but not in the %s: committing it now", k, self.describe())
            self.commit(k, read(k), attempt)

    def commit(self, index: int, part: pa.Table, attempt: int) -> None:
        """Part `index` as one transaction of the table, unless the table holds it already; a conflict with another
        writer's commit is retried against the table as it then is."""
        started = time.perf_counter()
        rows = table_rows(part, attempt)
        if self.upsert:
            refuse_repeated_keys(rows, index)
        stats = (part.schema.metadata or {}).get(b"batchgen.stats", b"{}").decode()
        meta = {TXN_KEY: self.txn(index), STATS_KEY: stats}
        for tries in range(1, COMMIT_TRIES + 1):
            table = self._load()
            if table is None:
                table = self._created(rows.schema)
            if self._holds(table, [meta[TXN_KEY]]):
                log.info("part %d is in the %s already (%s)", index, self.describe(), meta[TXN_KEY])
                break
            have = self._schema(table)
            added = check_schema(have, rows.schema, self.evolve, self.describe())
            try:
                self._write(table, aligned(rows, have), meta, added)
                self.commits += 1
                break
            except Exception as exc:  # noqa: BLE001 - each format's conflict is its own class (_conflict)
                if not self._conflict(exc) or tries == COMMIT_TRIES:
                    raise
                log.info("part %d: commit to the %s lost a race (%s); retrying", index, self.describe(), exc)
                time.sleep(min(0.05 * 2 ** tries, 2.0))
        self.known.add(index)
        self.commit_s += time.perf_counter() - started

    def _created(self, schema: pa.Schema) -> Any:
        """The table, created empty with these columns as a create-only step: where another writer's creation landed
        first, this one fails and the table it made is loaded instead (its columns are then checked as any table's).
        Every part, the first included, is then written by the same path (`_write`)."""
        try:
            return self._create(schema)
        except Exception as exc:  # noqa: BLE001 - each format's "exists already" is its own class; the table decides
            table = self._load()
            if table is None:
                raise
            log.info("the %s was created by another writer first (%s); writing to it", self.describe(), exc)
            return table

    def batches(self, columns: Optional[list[str]] = None) -> Iterable[pa.RecordBatch]:
        """The table's rows as they are now (`batchgen view --table`), batch by batch."""
        table = self._load()
        if table is None:
            raise FileNotFoundError(f"the {self.describe()} does not exist (yet)")
        return self._batches(table, columns)

    def _batches(self, table: Any, columns: Optional[list[str]]) -> Iterable[pa.RecordBatch]:
        raise NotImplementedError

    def _schema(self, table: Any) -> pa.Schema:
        raise NotImplementedError

    def _load(self) -> Any:
        raise NotImplementedError

    def _create(self, schema: pa.Schema) -> Any:
        """The table created empty with these columns, raising where it exists (never writing over another's)."""
        raise NotImplementedError

    def _holds(self, table: Any, names: list[str]) -> set[str]:
        """Which of these transaction names the table holds."""
        raise NotImplementedError

    def _stats_of(self, table: Any, txn: str) -> Optional[str]:
        raise NotImplementedError

    def _write(self, table: Any, rows: pa.Table, meta: dict[str, str], added: list[str]) -> None:
        raise NotImplementedError

    def _conflict(self, exc: Exception) -> bool:
        raise NotImplementedError


def table_rows(part: pa.Table, attempt: int) -> pa.Table:
    """A part's rows as the table holds them: batchgen's hidden columns dropped, `attempt` set (the job's own parts
    have none: 0), every field nullable and without metadata (a JSONL passthrough's encoding note is the file's)."""
    part = part.drop_columns([OCCURRENCE] if OCCURRENCE in part.column_names else [])  # a retry's key, not data
    if "attempt" not in part.column_names:
        part = part.append_column(pa.field("attempt", pa.int32()), pa.array([attempt] * part.num_rows, pa.int32()))
    schema = pa.schema([pa.field(f.name, f.type, nullable=True) for f in part.schema])
    return pa.Table.from_arrays(part.columns, schema=schema)


def refuse_repeated_keys(rows: pa.Table, index: int) -> None:
    """output.mode=upsert keys rows by (id, sample_index): a part holding a key twice (ids repeat in the input)
    would merge one row over the other."""
    keys = rows.group_by(list(KEYS)).aggregate([([], "count_all")])
    repeated = keys.filter(pa.compute.greater(keys.column("count_all"), 1))
    if repeated.num_rows:
        raise BatchgenError(f"part {index}: output.mode=upsert merges on (id, sample_index), and id "
                            f"{repeated.column('id')[0].as_py()!r} appears more than once: make the ids unique "
                            f"(dataset.id_column) or use output.mode=append. The part is committed in output_dir; "
                            f"the table was not changed")


def _norm(t: pa.DataType) -> Any:
    """A type as the table formats keep it: large and plain strings and lists alike, a list's item name ignored."""
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return ("list", _norm(t.value_type))
    if pa.types.is_struct(t):
        return tuple((t.field(i).name, _norm(t.field(i).type)) for i in range(t.num_fields))
    return str(t)


def check_schema(have: pa.Schema, rows: pa.Schema, evolve: bool, where: str) -> list[str]:
    """The rows' columns against the table's: a column of another type is refused; a new column is refused unless
    output.schema_evolution=add_columns (then returned: to be added). A column only the table has is written null."""
    types = {f.name: f.type for f in have}
    changed = [f"{f.name} ({f.type} here, {types[f.name]} in the table)" for f in rows
               if f.name in types and _norm(f.type) != _norm(types[f.name])]
    new = [f.name for f in rows if f.name not in types]
    problems = [f"the {where} has other types for columns: {', '.join(changed)}"] * bool(changed)
    if new and not evolve:
        problems.append(f"the {where} has no columns {', '.join(new)}: set output.schema_evolution=add_columns to "
                        f"add them, or write to another output.table")
    if problems:
        raise ConfigError(problems + ["the part is committed in output_dir; rerun once the config fits the table"])
    return new


def aligned(rows: pa.Table, have: Optional[pa.Schema]) -> pa.Table:
    """The rows with the table's columns in the table's order (a column they lack: null), cast to the table's types
    where they only differ in representation (string and large_string), then their new columns."""
    if have is None:
        return rows
    columns, fields = [], []
    for f in have:
        column = rows.column(f.name) if f.name in rows.column_names else pa.nulls(rows.num_rows, f.type)
        if column.type != f.type:
            column = column.cast(f.type)
        columns.append(column)
        fields.append(pa.field(f.name, f.type, nullable=True))
    for f in rows.schema:
        if f.name not in have.names:
            columns.append(rows.column(f.name))
            fields.append(f)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))
