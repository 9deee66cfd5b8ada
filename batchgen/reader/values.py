"""Column values as a program reads them: a column kept as JSON text (its JSONL values mix types) is decoded
back to each row's own value. Ids, per-row caps and rendering all read columns through here."""

from __future__ import annotations

import json

import pyarrow as pa

JSON_TEXT = {b"batchgen.encoding": b"json"}  # field metadata of a column kept as JSON text (its types mix)


def is_json_text(field: pa.Field) -> bool:
    return (field.metadata or {}).get(b"batchgen.encoding") == b"json"


def column_values(table: pa.Table, name: str) -> list:
    """A column's values as Python objects, as the input wrote them: a JSON-text column (mixed types) decoded."""
    values = table.column(name).to_pylist()
    if is_json_text(table.schema.field(name)):
        values = [None if v is None else json.loads(v) for v in values]
    return values
