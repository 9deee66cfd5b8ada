"""The latest-attempt view of an output: exactly one row per row of the job's own parts, whatever `batchgen retry`
added.

An output holds the job's parts (attempt 0, `part-*.parquet`) and, after retries, each retry's parts in
`_attempts/attempt-NNN/` beside them, with an `attempt` column. Once a retry completes, batchgen.output.publish
writes this view's rows over the top-level part files (so reading the directory gives the latest), keeping each
replaced part as first committed in `_attempts/original/`: attempt 0 here is the job's parts as committed
(`own_parts`), never the published ones. Ids may repeat
(docs/output-and-resume.md, "Duplicate ids"), so a row is keyed by (id, occurrence, sample_index), occurrence being
which row of its id it is (0-based, in the job's output order): counted here for the job's parts, recorded by the
retry in its parts' hidden OCCURRENCE column (a retry written before that column existed matches by id alone). Per
key it takes the latest attempt whose row has no error; where every attempt erred, the latest attempt. Rows keep the
job's input order: a retried row stands where its original stood. Only committed parts are read; the retried rows
(few, by construction) are held in memory, the job's parts streamed batch by batch.

    from batchgen.output.view import latest
    table = latest("data/outputs/job")          # pyarrow Table; .to_pandas(); datasets.Dataset(table)
    for batch in latest_batches("data/outputs/job", columns=["id", "generation"]): ...
    duckdb.sql(duckdb_sql("data/outputs/job"))  # the same rows, as SQL over the Parquet files

Knows the output layout and Parquet, not engines or configs.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from itertools import groupby
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.output.parts import open_part, part_schema
from batchgen.output.rows.schema import PART_RE

ATTEMPT_RE = re.compile(r"^attempt-(\d{3,})$")


ATTEMPTS = "_attempts"  # '_': reading output_dir (or output_dir/*.parquet) never reads a retry's parts
ORIGINALS = "original"  # _attempts/original/part-KKKKK.parquet: a job part as committed, once a publish replaced it
# a retry's parts: which row of its id (0-based, in the job's output order) each row retries. Ids may repeat, so the
# view's key is (id, occurrence, sample_index), unique by construction; never a column of the view itself
OCCURRENCE = "_batchgen_occurrence"
Key = tuple[str, Optional[int], int]  # (id, occurrence: None in a retry written before occurrences were recorded, s)
Winner = tuple[int, bool, dict]  # (attempt, without error, its row)


def attempt_dir(output_dir: Path, attempt: int) -> Path:
    return output_dir if attempt == 0 else output_dir / ATTEMPTS / f"attempt-{attempt:03d}"


def attempts(output_dir: Path) -> list[int]:
    """Attempt numbers present: 0 (the job's own parts) and every retry's, ascending."""
    root = output_dir / ATTEMPTS
    found = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := ATTEMPT_RE.match(p.name))] \
        if root.is_dir() else []
    return [0, *sorted(found)]


def own_parts(output_dir: Path) -> list[Path]:
    """The job's own parts as it committed them (attempt 0): each top-level part, or its original where a retry's
    publish replaced it (the original is kept before its part is replaced, so it exists whenever they differ)."""
    kept = output_dir / ATTEMPTS / ORIGINALS
    return [kept / p.name if (kept / p.name).is_file() else p for p in part_files(output_dir)]


def attempt_parts(output_dir: Path, attempt: int) -> list[Path]:
    """Attempt `attempt`'s committed parts: the job's own as committed (0), or a retry's."""
    return own_parts(output_dir) if attempt == 0 else part_files(attempt_dir(output_dir, attempt))


def part_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = ((m, p) for p in directory.iterdir() if (m := PART_RE.match(p.name)))
    return [p for m, p in sorted(found, key=lambda mp: int(mp[0].group(1)))]  # part-100000 after part-99999


def view_schema(output_dir: Path, columns: Optional[list[str]] = None) -> pa.Schema:
    """Every part's columns, unified (a retry may write an optional column the job did not), plus `attempt`."""
    schemas = [part_schema(p).remove_metadata() for a in attempts(output_dir) for p in attempt_parts(output_dir, a)]
    if not schemas:
        raise FileNotFoundError(f"{output_dir} holds no committed part (part-*.parquet)")
    schema = pa.unify_schemas(schemas)
    if OCCURRENCE in schema.names:  # the view's key, not its data
        schema = schema.remove(schema.get_field_index(OCCURRENCE))
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


def _winners(output_dir: Path, schema: pa.Schema) -> dict[Key, Winner]:
    """Per (id, occurrence, sample_index) that a retry wrote: its latest attempt without error, else its latest
    attempt, with its row (a dict over `schema`). A retry written before occurrences were recorded has None there."""
    best: dict[Key, Winner] = {}
    for a in attempts(output_dir)[1:]:
        for path in part_files(attempt_dir(output_dir, a)):
            with open_part(path) as pf:
                names = pf.schema_arrow.names
                hidden = [OCCURRENCE] if OCCURRENCE in names else []
                table = pf.read(columns=[c for c in schema.names if c in names] + hidden)
            occurrences = table.column(OCCURRENCE).to_pylist() if hidden else [None] * table.num_rows
            for row, occurrence in zip(_conform(table, schema, a).to_pylist(), occurrences):
                key, ok = (row["id"], occurrence, row["sample_index"]), row["error"] is None
                if key not in best or ok or not best[key][1]:
                    best[key] = (a, ok, row)
    return best


def _view(output_dir: Path, columns: Optional[list[str]], track: Collection[str]
          ) -> Iterator[tuple[int, pa.Table, Optional[list[Optional[int]]]]]:
    """The view's tables, each with the position of the job's part it comes from (in part order) and its rows'
    occurrences where a row's id was retried or is in `track` (None for a table with no such row). Occurrences are
    counted for those ids only: memory stays with the retried rows."""
    schema = view_schema(output_dir, columns)
    wide = _with_keys(schema)
    winners = _winners(output_dir, wide)
    keyed = {k[0] for k in winners} | set(track)
    value_set = pa.array(sorted(keyed), pa.string())
    seen: dict[str, int] = {}
    for k, path in enumerate(own_parts(output_dir)):
        pf = open_part(path)
        for g in range(pf.num_row_groups):
            table = _read(lambda cols, g=g, pf=pf: pf.read_row_group(g, columns=cols), pf.schema_arrow.names, wide, 0)
            occurrences = None
            if keyed and pc.any(pc.is_in(table.column("id"), value_set=value_set)).as_py():
                occurrences = _occurrences(table, keyed, seen)
                table = _replace(table, winners, occurrences)
            yield k, table.select(schema.names), occurrences


def latest_batches(output_dir: str | Path, columns: Optional[list[str]] = None) -> Iterator[pa.Table]:
    """The latest-attempt view, one table per row group of the job's parts, in the job's output order. `columns`:
    the columns to read (default all; `attempt` is always available)."""
    for _, table, _ in _view(Path(output_dir), columns, ()):
        yield table


def part_views(output_dir: Path) -> Iterator[tuple[Path, pa.Table]]:
    """The view part by part: each of the job's parts as committed (own_parts) with its rows in the view, every
    column and `attempt`. What a retry's publish writes over the top-level part."""
    parts = own_parts(output_dir)
    for k, group in groupby(_view(output_dir, None, ()), key=lambda item: item[0]):
        yield parts[k], pa.concat_tables([table for _, table, _ in group])


def keyed_batches(output_dir: str | Path, columns: list[str], ids: Collection[str]) -> Iterator[pa.Table]:
    """latest_batches with an OCCURRENCE column last: which row of its id each row is (0-based, in the job's output
    order) where its id is in `ids`, else null. What `batchgen retry` records of the rows it retries."""
    for _, table, occurrences in _view(Path(output_dir), columns, ids):
        values = pa.array(occurrences or [None] * table.num_rows, pa.int64())
        yield table.append_column(pa.field(OCCURRENCE, pa.int64()), values)


def _occurrences(table: pa.Table, keyed: set[str], seen: dict[str, int]) -> list[Optional[int]]:
    """Each row's occurrence where its id is in `keyed`, else None. A row's samples are consecutive and start at
    sample_index 0, so a sample 0 starts the id's next row; `seen` carries the last occurrence per id across tables."""
    out: list[Optional[int]] = []
    for row_id, s in zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()):
        if row_id not in keyed:
            out.append(None)
            continue
        if s == 0:
            seen[row_id] = seen.get(row_id, -1) + 1
        out.append(seen.get(row_id, 0))
    return out


def _best(winners: dict[Key, Winner], row_id: str, occurrence: int, s: int) -> Optional[Winner]:
    """The retries' winner for this row of the job's: its occurrence's, or (a retry written before occurrences were
    recorded: matched by id alone) its id's, whichever is better by the view's rule."""
    found = [w for w in (winners.get((row_id, occurrence, s)), winners.get((row_id, None, s))) if w is not None]
    return max(found, key=lambda w: (w[1], w[0]), default=None)


def _replace(table: pa.Table, winners: dict[Key, Winner], occurrences: list[Optional[int]]) -> pa.Table:
    """`table` with each retried row replaced, in place, by its winning attempt's row; the job's own row stays where
    it had no error and every retry of it erred."""
    order, extra = list(range(table.num_rows)), []
    keys = zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist(),
               table.column("error").to_pylist(), occurrences)
    for i, (row_id, s, error, occurrence) in enumerate(keys):
        won = None if occurrence is None else _best(winners, row_id, occurrence, s)
        if won is not None and (won[1] or error is not None):
            order[i] = table.num_rows + len(extra)
            extra.append(won[2])
    replacement = pa.Table.from_pylist(extra, schema=table.schema)
    return pa.concat_tables([table, replacement]).take(pa.array(order, pa.int64()))


def latest(output_dir: str | Path, columns: Optional[list[str]] = None) -> pa.Table:
    """The latest-attempt view as one pyarrow Table (`.to_pandas()`; `datasets.Dataset(table)`)."""
    output_dir = Path(output_dir)
    batches = list(latest_batches(output_dir, columns))
    return pa.concat_tables(batches or [view_schema(output_dir, columns).empty_table()])


def duckdb_sql(output_dir: str | Path) -> str:
    """A duckdb query giving the latest-attempt view straight from the Parquet files (the same rows as `latest`;
    order by your own key, SQL keeps none): `duckdb.sql(duckdb_sql(path)).df()`."""
    output_dir = Path(output_dir)
    files = [(a, i, p) for a in attempts(output_dir) for i, p in enumerate(attempt_parts(output_dir, a))]
    if not files:
        raise FileNotFoundError(f"{output_dir} holds no committed part (part-*.parquet)")
    listed = ", ".join(_quoted(str(p)) for _, _, p in files)
    if not any(a for a, _, _ in files):  # never retried: the job's own rows
        return f"SELECT *, 0::INTEGER AS attempt FROM read_parquet([{listed}], union_by_name = true)"
    recorded = any(OCCURRENCE in part_schema(p).names for a, _, p in files if a)
    table = ", ".join(f"({_quoted(str(p))}, {a}, {i})" for a, i, p in files)
    matched = f"(r.{OCCURRENCE} IS NULL OR r.{OCCURRENCE} = o.batchgen_occurrence)" if recorded else "true"
    internal = "batchgen_rank, batchgen_occurrence, batchgen_file, batchgen_attempt, batchgen_order, file_row_number"
    return (
        f"WITH batchgen_files (batchgen_file, batchgen_attempt, batchgen_order) AS (VALUES {table}), "
        f"src AS (SELECT * FROM read_parquet([{listed}], union_by_name = true, filename = 'batchgen_file', "
        "file_row_number = true) JOIN batchgen_files USING (batchgen_file)), "
        # the job's own rows, each with its occurrence: a row's samples start at sample_index 0
        "own AS (SELECT *, sum((sample_index = 0)::BIGINT) OVER (PARTITION BY id ORDER BY batchgen_order, "
        "file_row_number ROWS UNBOUNDED PRECEDING) - 1 AS batchgen_occurrence FROM src WHERE batchgen_attempt = 0), "
        # a retry's rows, each at the row it retries (by id alone where it recorded no occurrence)
        "retried AS (SELECT r.*, o.batchgen_occurrence FROM src AS r JOIN own AS o ON r.id = o.id AND "
        f"r.sample_index = o.sample_index AND {matched} WHERE r.batchgen_attempt > 0), "
        "ranked AS (SELECT *, row_number() OVER (PARTITION BY id, batchgen_occurrence, sample_index ORDER BY "
        "(error IS NULL) DESC, batchgen_attempt DESC, batchgen_order DESC, file_row_number DESC) AS batchgen_rank "
        "FROM (SELECT * FROM own UNION ALL BY NAME SELECT * FROM retried)) "
        f"SELECT * EXCLUDE ({internal}{', ' + OCCURRENCE if recorded else ''}) "
        "REPLACE (coalesce(attempt, 0)::INTEGER AS attempt) FROM ranked WHERE batchgen_rank = 1")


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
