"""output.sink=delta: a Delta Lake table through delta-rs (the `deltalake` package), on a local path or object
storage (output.storage_options: delta-rs's, e.g. the S3 endpoint). A part's commit carries an application
transaction (app id `batchgen-<job_id>-part-KKKKK`, version 1), which Delta keeps in the table's state, checkpoints
included: `transaction_version(app id)` answers whether the part is in the table. Its counts go in the commit's
custom metadata. The table is created empty first (TableSink._created: one creator wins, the other writes to its
table), then every part is appended or merged into it. Appends retry version conflicts inside delta-rs; a merge
(output.mode=upsert) that conflicts with another writer's commit is retried here (TableSink.commit)."""

from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa

from batchgen.output.tables.sink import KEYS, STATS_KEY, TXN_KEY, TableSink

MERGE_ON = " AND ".join(f"t.{k} = s.{k}" for k in KEYS)


class DeltaSink(TableSink):
    format = "Delta"

    def __init__(self, output: Any, job_id: str):
        super().__init__(output, job_id)
        self.uri = output.table
        self.options = dict(output.storage_options) or None

    def _load(self) -> Any:
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return DeltaTable(self.uri, storage_options=self.options)
        except TableNotFoundError:
            return None

    def _create(self, schema: pa.Schema) -> Any:
        """Version 0 with no retry: delta-rs retries a commit that lost its version, and a creation retried lands as
        version 1 over the winner's (both creators "succeed"); refused here, the loser's error sends it to the
        table."""
        from deltalake import CommitProperties, DeltaTable

        return DeltaTable.create(self.uri, schema, mode="error", storage_options=self.options,
                                 commit_properties=CommitProperties(max_commit_retries=0))

    def _batches(self, table: Any, columns: Optional[list[str]]) -> Any:
        return table.to_pyarrow_dataset().to_batches(columns=columns)

    def _schema(self, table: Any) -> pa.Schema:
        return pa.schema(table.schema().to_arrow())

    def _holds(self, table: Any, names: list[str]) -> set[str]:
        return {n for n in names if table.transaction_version(n) is not None}

    def _stats_of(self, table: Any, txn: str) -> Optional[str]:
        return next((c.get(STATS_KEY) for c in table.history() if c.get(TXN_KEY) == txn), None)

    def _write(self, table: Any, rows: pa.Table, meta: dict[str, str], added: list[str]) -> None:
        from deltalake import CommitProperties, Transaction, write_deltalake

        commit = CommitProperties(custom_metadata=meta, app_transactions=[Transaction(meta[TXN_KEY], 1)])
        if not self.upsert:
            write_deltalake(table, rows, mode="append", schema_mode="merge" if added else None,
                            storage_options=self.options, commit_properties=commit)
            return
        (table.merge(rows, predicate=MERGE_ON, source_alias="s", target_alias="t", merge_schema=bool(added),
                     commit_properties=commit)
         .when_matched_update_all().when_not_matched_insert_all().execute())

    def _conflict(self, exc: Exception) -> bool:
        from deltalake.exceptions import CommitFailedError

        return isinstance(exc, CommitFailedError) or "already exists" in str(exc).lower()
