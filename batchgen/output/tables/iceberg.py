"""output.sink=iceberg: an Iceberg table through pyiceberg, in the catalog output.catalog names (pyiceberg's catalog
properties: `type: sql` with a SQLite `uri` and a `warehouse` for local use, `rest` or `glue` by configuration).
A part's commit is one catalog transaction (schema change, upsert's delete and append together) whose snapshots
carry the summary property `batchgen.txn` with the part's name and `batchgen.stats` with its counts; the table's
snapshot list answers whether a part is in it (expiring those snapshots forgets it: a resume would then commit
the part again). A commit that loses the catalog's race (CommitFailedException) is retried (TableSink.commit).

pyiceberg 0.12 writes a null list of structs as an empty list (apache/iceberg-python#3833): in an Iceberg table a
`choice_scores` or `top_logprobs` that is null in the part reads as []; the row's `error` tells the two apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchgen.output.tables.sink import KEYS, STATS_KEY, TXN_KEY, TableSink


class IcebergSink(TableSink):
    format = "Iceberg"

    def __init__(self, output: Any, job_id: str):
        super().__init__(output, job_id)
        self.identifier = output.table
        self._catalog: Any = None

    @property
    def catalog(self) -> Any:
        if self._catalog is None:
            from pyiceberg.catalog import load_catalog

            props = {k: str(v) for k, v in self.output.catalog.items()}
            if props.get("uri", "").startswith("sqlite:///"):  # a local SQLite catalog: its directory made here
                Path(props["uri"][len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
            if props.get("warehouse") and "://" not in props["warehouse"]:  # a local directory, as pyiceberg's URI
                props["warehouse"] = Path(props["warehouse"]).resolve().as_uri()
            self._catalog = load_catalog(props.pop("name", "default"), **props)
        return self._catalog

    def _load(self) -> Any:
        from pyiceberg.exceptions import NoSuchTableError

        try:
            return self.catalog.load_table(self.identifier)
        except NoSuchTableError:
            return None

    def _batches(self, table: Any, columns: Optional[list[str]]) -> Any:
        return table.scan(selected_fields=tuple(columns or ("*",))).to_arrow_batch_reader()

    def _schema(self, table: Any) -> pa.Schema:
        return table.schema().as_arrow()

    def _summaries(self, table: Any) -> list[dict[str, str]]:
        return [s.summary.additional_properties for s in table.metadata.snapshots if s.summary is not None]

    def _holds(self, table: Any, names: list[str]) -> set[str]:
        return set(names) & {s.get(TXN_KEY) for s in self._summaries(table)}

    def _stats_of(self, table: Any, txn: str) -> Optional[str]:
        return next((s.get(STATS_KEY) for s in self._summaries(table) if s.get(TXN_KEY) == txn), None)

    def _write(self, table: Any, rows: pa.Table, meta: dict[str, str], added: list[str]) -> None:
        if table is None:
            self.catalog.create_namespace_if_not_exists(self.identifier.rsplit(".", 1)[0])
            table = self.catalog.create_table_if_not_exists(self.identifier, schema=rows.schema)
        with table.transaction() as tx:
            if added:
                with tx.update_schema() as update:
                    update.union_by_name(rows.schema)
            if self.upsert:  # unchanged rows make no snapshot; a part of only such rows is not recorded (harmless)
                tx.upsert(rows, join_cols=list(KEYS), snapshot_properties=meta)
            else:
                tx.append(rows, snapshot_properties=meta)

    def _conflict(self, exc: Exception) -> bool:
        from pyiceberg.exceptions import CommitFailedException

        return isinstance(exc, CommitFailedException)
