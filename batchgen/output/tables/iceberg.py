"""output.sink=iceberg: an Iceberg table through pyiceberg, in the catalog output.catalog names (pyiceberg's catalog
properties: `type: sql` with a SQLite `uri` and a `warehouse` for local use, `rest` or `glue` by configuration).
A part's commit is one catalog transaction (schema change, upsert's delete and append together) whose snapshots
carry the summary property `batchgen.txn` with the part's name and `batchgen.stats` with its counts; the table's
snapshot list answers whether a part is in it (expiring those snapshots forgets it: a resume would then commit
the part again). A commit that loses the catalog's race (CommitFailedException) is retried (TableSink.commit).

pyiceberg 0.12 writes a null list of structs as an empty list (apache/iceberg-python#3833): in an Iceberg table a
`choice_scores` or `top_logprobs` that is null in the part reads as []; the row's `error` tells the two apart."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.output.tables.sink import KEYS, STATS_KEY, TXN_KEY, TableSink, aligned

log = logging.getLogger(__name__)


class IcebergSink(TableSink):
    format = "Iceberg"

    def __init__(self, output: Any, job_id: str):
        super().__init__(output, job_id)
        self.identifier = output.table
        self._catalog: Any = None

    @property
    def catalog(self) -> Any:
        if self._catalog is None:
            props = {k: str(v) for k, v in self.output.catalog.items()}
            if props.get("uri", "").startswith("sqlite:///"):  # a local SQLite catalog: its directory made here
                Path(props["uri"][len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
            if props.get("warehouse") and "://" not in props["warehouse"]:  # a local directory, as pyiceberg's URI
                props["warehouse"] = Path(props["warehouse"]).resolve().as_uri()
            self._catalog = self._load_catalog(props.pop("name", "default"), props)
        return self._catalog

    @staticmethod
    def _load_catalog(name: str, props: dict[str, str]) -> Any:
        """The catalog, loaded once more where the first load failed: the SQL catalog's first use creates its own
        tables, checking first, and two writers' first uses at once can both pass the check; the second's CREATE
        TABLE fails, and the tables exist then. A second failure is raised."""
        from pyiceberg.catalog import load_catalog

        try:
            return load_catalog(name, **props)
        except Exception as exc:  # noqa: BLE001 - the catalog's own error class for the lost race (sqlalchemy's)
            log.info("loading the Iceberg catalog failed (%s); loading it again", exc)
            return load_catalog(name, **props)

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

    def _create(self, schema: pa.Schema) -> Any:
        """create_table, not create_table_if_not_exists: the catalog refuses a second creation (the SQL catalog on
        its unique key), and the loser writes to the winner's table (TableSink._created)."""
        self._create_namespace()
        return self.catalog.create_table(self.identifier, schema=schema)

    def _write(self, table: Any, rows: pa.Table, meta: dict[str, str], added: list[str]) -> None:
        kept = self._kept(table, rows) if self.upsert else None
        with table.transaction() as tx:
            if added:
                with tx.update_schema() as update:
                    update.union_by_name(rows.schema)
            if self.upsert:
                self._delete_ids(tx, rows, meta)
            tx.append(rows if kept is None else pa.concat_tables([kept.select(rows.column_names), rows]),
                      snapshot_properties=meta)

    @staticmethod
    def _delete_ids(tx: Any, rows: pa.Table, meta: dict[str, str]) -> None:
        """The upsert's delete by the part's ids, issued even where the table holds none of them: pyiceberg retries a
        commit that lost the catalog's race on the table as it then is, and a plain append would be retried as it is
        (the other writer's rows of these ids kept beside ours); a delete's filter is checked against the files the
        other writer added (ValidationException, retried here: TableSink.commit)."""
        from pyiceberg.expressions import In

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Delete operation did not match any records")
            tx.delete(In(KEYS[0], pc.unique(rows.column(KEYS[0])).to_pylist()), snapshot_properties=meta)

    def _create_namespace(self) -> None:
        """The table's namespace, unless it exists. The SQL catalog checks, then inserts: two shards' first commits
        at once can both pass the check, and the second insert fails on the catalog's unique key. The namespace
        exists then, which is all this asks; any other failure is raised."""
        namespace = self.identifier.rsplit(".", 1)[0]
        try:
            self.catalog.create_namespace_if_not_exists(namespace)
        except Exception:  # noqa: BLE001 - the catalog's own error class for the lost race (sqlalchemy's, for SQL)
            if not self.catalog.namespace_exists(namespace):
                raise

    def _kept(self, table: Any, rows: pa.Table) -> Optional[pa.Table]:
        """output.mode=upsert as a delete by id and an append, in one transaction: the table's rows of the part's ids
        that the part does not replace (another sample of the id), appended again; None where it holds none.
        pyiceberg's own upsert matches (id, sample_index) pairs with one predicate per row, which costs about 0.25 s a
        part of 256 rows; a single `In` on the id column costs a fraction of that."""
        from pyiceberg.expressions import In

        ids = pc.unique(rows.column(KEYS[0])).to_pylist()
        held = table.scan(row_filter=In(KEYS[0], ids)).to_arrow()
        if held.num_rows == 0:
            return None
        others = aligned(held, rows.schema)  # large types to plain
        return others.join(rows.select(list(KEYS)), keys=list(KEYS), join_type="left anti")

    def _conflict(self, exc: Exception) -> bool:
        from pyiceberg.exceptions import CommitFailedException, ValidationException

        return isinstance(exc, (CommitFailedException, ValidationException))
