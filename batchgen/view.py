"""The latest-attempt view of an output: exactly one row per (id, sample_index), whatever `batchgen retry` added.

An output holds the job's parts (attempt 0, `part-*.parquet`) and, after retries, each retry's parts in
`_attempts/attempt-NNN/` beside them, with an `attempt` column. Reading the directory itself still gives the job's
own rows (its `_` names are skipped by every Parquet reader); this view is how to read the latest. It takes, per
(id, sample_index), the latest attempt whose row has no error; where every attempt erred, the latest attempt.
Rows keep the job's input order: a retried row stands where its original stood. Only committed parts are read;
the retried rows (few, by construction) are held in memory, the job's parts streamed batch by batch.

    from batchgen.view import latest
    table = latest("data/outputs/job")          # pyarrow Table; .to_pandas(); datasets.Dataset(table)
    for batch in latest_batches("data/outputs/job", columns=["id", "generation"]): ...
    duckdb.sql(duckdb_sql("data/outputs/job"))  # the same rows, as SQL over the Parquet files

Knows the output layout and Parquet, not engines or configs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.committer import PART_RE

ATTEMPT_RE = re.compile(r"^attempt-(\d{3,})$")


ATTEMPTS = "_attempts"  # '_': reading output_dir (or output_dir/*.parquet) gives the job's own rows, as before


def attempt_dir(output_dir: Path, attempt: int) -> Path:
    return output_dir if attempt == 0 else output_dir / ATTEMPTS / f"attempt-{attempt:03d}"


def attempts(output_dir: Path) -> list[int]:
    """Attempt numbers present: 0 (the job's own parts) and every retry's, ascending."""
    root = output_dir / ATTEMPTS
    found = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := ATTEMPT_RE.match(p.name))] \
        if root.is_dir() else []
    return [0, *sorted(found)]


def part_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if PART_RE.match(p.name)), key=lambda p: p.name)


def _schema(output_dir: Path, columns: Optional[list[str]]) -> pa.Schema:
    """Every part's columns, unified (a retry may write an optional column the job did not), plus `attempt`."""
    schemas = [pq.read_schema(p).remove_metadata() for a in attempts(output_dir)
               for p in part_files(attempt_dir(output_dir, a))]
    if not schemas:
        raise FileNotFoundError(f"{output_dir} holds no committed part (part-*.parquet)")
    schema = pa.unify_schemas(schemas)
    if "attempt" not in schema.names:
        schema = schema.append(pa.field("attempt", pa.int32()))
    if columns is not None:
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise KeyError(f"{output_dir}: no column {', '.join(missing)} (columns: {', '.join(schema.names)})")
        schema = pa.schema([schema.field(c) for c in columns])
    return schema


def _conform(table: pa.Table, schema: pa.Schema, attempt: int) -> pa.Table:
    """`table` with exactly `schema`'s columns: missing ones null, `attempt` filled in for the job's own parts."""
    arrays = []
    for f in schema:
        if f.name in table.column_names:
            arrays.append(table.column(f.name).cast(f.type))
        elif f.name == "attempt":
            arrays.append(pa.array([attempt] * table.num_rows, pa.int32()))
        else:
            arrays.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


KEY_FIELDS = (pa.field("id", pa.string()), pa.field("sample_index", pa.int32()), pa.field("error", pa.string()))


def _with_keys(schema: pa.Schema) -> pa.Schema:
    """`schema` plus the columns the view decides by, where the caller did not ask for them."""
    return pa.schema([*schema, *(f for f in KEY_FIELDS if f.name not in schema.names)])


def _read(table_of, names: list[str], schema: pa.Schema, attempt: int) -> pa.Table:
    """Read the columns of `schema` that the file has (`table_of(columns)`), conformed to `schema`."""
    return _conform(table_of([c for c in schema.names if c in names]), schema, attempt)


def _winners(output_dir: Path, schema: pa.Schema) -> dict[tuple[str, int], tuple[int, dict]]:
    """Per retried (id, sample_index): the winning attempt and its row (a dict over `schema`). A later attempt
    replaces an earlier row unless it erred where that one had not; the job's own row (attempt 0) wins where it had
    no error and every retry erred."""
    best: dict[tuple[str, int], tuple[int, bool, dict]] = {}
    for a in attempts(output_dir)[1:]:
        for path in part_files(attempt_dir(output_dir, a)):
            names = pq.read_schema(path).names
            for row in _read(lambda cols, p=path: pq.read_table(p, columns=cols), names, schema, a).to_pylist():
                key, ok = (row["id"], row["sample_index"]), row["error"] is None
                if key not in best or ok or not best[key][1]:
                    best[key] = (a, ok, row)
    if best:
        ids = pa.array(sorted({k[0] for k in best}), pa.string())
        for path in part_files(output_dir):  # the job's own rows of the retried ids: did they succeed?
            table = pq.read_table(path, columns=["id", "sample_index", "error"], filters=pc.field("id").isin(ids))
            for row_id, s, error in zip(*(table.column(c).to_pylist() for c in ("id", "sample_index", "error"))):
                if error is None and (row_id, s) in best and not best[(row_id, s)][1]:
                    best[(row_id, s)] = (0, True, {})
    return {k: (a, row) for k, (a, _, row) in best.items()}


def latest_batches(output_dir: str | Path, columns: Optional[list[str]] = None) -> Iterator[pa.Table]:
    """The latest-attempt view, one table per row group of the job's parts, in the job's output order. `columns`:
    the columns to read (default all; `attempt` is always available)."""
    output_dir = Path(output_dir)
    schema = _schema(output_dir, columns)
    wide = _with_keys(schema)
    winners = _winners(output_dir, wide)
    retried = pa.array(sorted({k[0] for k, (a, _) in winners.items() if a != 0}), pa.string())
    for path in part_files(output_dir):
        pf = pq.ParquetFile(path)
        for g in range(pf.num_row_groups):
            table = _read(lambda cols, g=g, pf=pf: pf.read_row_group(g, columns=cols), pf.schema_arrow.names, wide, 0)
            if len(retried) and pc.any(pc.is_in(table.column("id"), value_set=retried)).as_py():
                table = _replace(table, winners)
            yield table.select(schema.names)


def _replace(table: pa.Table, winners: dict[tuple[str, int], tuple[int, dict]]) -> pa.Table:
    """`table` with each retried row replaced, in place, by its winning attempt's row."""
    order, extra = list(range(table.num_rows)), []
    keys = zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist())
    for i, key in enumerate(keys):
        won = winners.get(key)
        if won is not None and won[0] != 0:
            order[i] = table.num_rows + len(extra)
            extra.append(won[1])
    replacement = pa.Table.from_pylist(extra, schema=table.schema)
    return pa.concat_tables([table, replacement]).take(pa.array(order, pa.int64()))


def latest(output_dir: str | Path, columns: Optional[list[str]] = None) -> pa.Table:
    """The latest-attempt view as one pyarrow Table (`.to_pandas()`; `datasets.Dataset(table)`)."""
    output_dir = Path(output_dir)
    return pa.concat_tables(list(latest_batches(output_dir, columns)) or [_schema(output_dir, columns).empty_table()])


def duckdb_sql(output_dir: str | Path) -> str:
    """A duckdb query giving the latest-attempt view straight from the Parquet files (the same rows as `latest`;
    order by your own key, SQL keeps none): `duckdb.sql(duckdb_sql(path)).df()`."""
    output_dir = Path(output_dir)
    files = [str(p) for a in attempts(output_dir) for p in part_files(attempt_dir(output_dir, a))]
    listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    return ("SELECT * EXCLUDE (batchgen_rank) REPLACE (coalesce(attempt, 0)::INTEGER AS attempt) FROM ("
            "SELECT *, row_number() OVER (PARTITION BY id, sample_index ORDER BY (error IS NULL) DESC, "
            f"coalesce(attempt, 0) DESC) AS batchgen_rank FROM read_parquet([{listed}], union_by_name = true)) "
            "WHERE batchgen_rank = 1")
