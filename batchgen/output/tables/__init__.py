"""Table outputs (output.sink=delta|iceberg): each committed part also made exactly one transaction of a table.

output_dir stays what it is (the staging area: parts, journal, manifest, status; what `batchgen retry`, `view`,
`report` and run.skip_existing read); the table is what consumers query. A part is written to output_dir first, then
committed to the table as one transaction named after the output's job id (the manifest's `job_id`) and the part
number, `batchgen-<job_id>-part-KKKKK`: Delta's application transaction (a `txn` action, app id and version),
Iceberg's snapshot summary property `batchgen.txn`. Before committing, the table is asked whether that name is in it
already: a part is never appended twice, whichever process crashed where, and a resume first commits the parts its
output_dir holds that the table lacks (`TableSink.reconcile`). A commit that loses a race with another writer (a
shard, a Ray worker) is retried on the table as it then is.

Rows as the table holds them (`table_rows`): the part's columns without batchgen's hidden ones, plus `attempt`
(0: the job's own rows, N: retry N's), every column nullable. output.mode=upsert merges each part on
(id, sample_index): a retried or re-generated row replaces the row it retries, a new one is appended. A table whose
columns differ from the rows' is refused with the columns named (output.schema_evolution=add_columns: the rows'
new columns are added); a column the rows lack is written null.

Knows pyarrow and the table formats' Python packages (imported where used), not engines or configs' Hydra.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from batchgen.output.tables.sink import TableSink

__all__ = ["TableSink", "open_sink", "recorded_sink", "table_line"]


def open_sink(output: Any, job_id: str) -> Optional[TableSink]:
    """output.sink's table, or None for the plain Parquet output."""
    if output.sink == "delta":
        from batchgen.output.tables.delta import DeltaSink

        return DeltaSink(output, job_id)
    if output.sink == "iceberg":
        from batchgen.output.tables.iceberg import IcebergSink

        return IcebergSink(output, job_id)
    return None


def recorded_sink(manifest: dict[str, Any]) -> Optional[TableSink]:
    """The table output an output's manifest records (its resolved config's output.*), or None. A manifest is data
    (`view --table`, `status` and `report` read output dirs that others wrote): a catalog property that names code
    for pyiceberg to import (`py-catalog-impl`, `py-io-impl`, any `*-impl`) is refused with ValueError, never
    loaded; a job's own config may name one."""
    from batchgen.job import OutputConfig

    recorded = (manifest.get("config") or {}).get("output") or {}
    catalog = recorded.get("catalog") or {}
    if not isinstance(catalog, dict):
        raise ValueError(f"the manifest's output.catalog is {str(catalog)[:80]!r}, not a catalog's properties")
    named = sorted(k for k in catalog if str(k).endswith("impl"))
    if named:
        raise ValueError(f"the manifest's output.catalog.{named[0]} names code to import "
                         f"({str(catalog[named[0]])[:80]!r}); batchgen never imports what an output's manifest "
                         "names: read the table with your own catalog config (pyiceberg's load_catalog)")
    keys = {f.name for f in dataclasses.fields(OutputConfig)} - {"prices"}
    output = OutputConfig(**{k: v for k, v in recorded.items() if k in keys})
    return open_sink(output, manifest.get("job_id", "")) if output.sink != "parquet" else None


def table_line(manifest: dict[str, Any]) -> Optional[str]:
    """`batchgen status`'s and `report`'s line on a table output: how many of the output's parts the table holds,
    read from the table (a table that cannot be read is said, not raised: both commands only read)."""
    try:
        sink = recorded_sink(manifest)
    except ValueError as exc:
        return f"cannot open it ({exc})"
    if sink is None:
        return None
    parts = manifest.get("parts") or 0
    try:
        held = len(sink.refresh(range(parts)))
    except Exception as exc:  # noqa: BLE001 - any reader's failure is reported, not raised
        return f"{sink.output.sink} {sink.output.table}: cannot read it ({type(exc).__name__}: {exc})"
    return f"{sink.output.sink} {sink.output.table}, {held} of {parts or '?'} parts committed"
