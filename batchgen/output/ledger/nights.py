"""The nights of a `batchgen increment` root (ROOT/YYYY-MM-DD, one output per night) as one ledger: which nights there
are, which finished (`_SUCCESS`), which a live writer holds, and the union of their rows with each id once.

The union takes, per id, the latest night (by its folder's date) where the id has rows and none of them erred, else
the latest night that has it; within a night a row is its latest-attempt view's (output/view.py: `batchgen retry`'s
attempts under `_attempts/` included, an answered retry winning over its error row). Its rows come night by night,
each night's in its output order; only committed parts are read, and per id one 8-byte hash and a night's number are
kept in memory (about 60 bytes an id). `batchgen view ROOT` prints or exports it.

Knows the nights' folder layout, the output lock and the view; not configs or engines.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pyarrow as pa

from batchgen.output.lock import live_writers
from batchgen.output.manifest import MANIFEST
from batchgen.output.rows.schema import SUCCESS
from batchgen.output.view import latest_batches, view_schema

DATE = re.compile(r"\d{4}-\d{2}-\d{2}")  # a night's folder name: its date, ISO, so that names sort as dates


def id_hash(row_id: str) -> int:
    """A row id as the ledger keeps it: 8 bytes of its blake2b (run.skip_existing's set, the union's choice)."""
    return int.from_bytes(hashlib.blake2b(row_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def nights(root: Path) -> list[Path]:
    """The dated night folders under `root`, oldest first; none when `root` is not a folder (yet)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if DATE.fullmatch(p.name) and p.is_dir())


def finished(night: Path) -> bool:
    return (night / SUCCESS).is_file()


def is_root(path: Path) -> bool:
    """Whether `path` is a root of nights: a folder that is no output itself and holds a night with a manifest."""
    return not (path / MANIFEST).is_file() and any((night / MANIFEST).is_file() for night in nights(path))


def writers(root: Path, but: Optional[Path] = None) -> list[str]:
    """The nights under `root` (but `but`) that a live process writes now, each as `NIGHT (pid P on HOST)`."""
    out = []
    for night in nights(root):
        if but is not None and night.name == but.name:
            continue
        for note in live_writers(night):  # a lock without its holder's note (another tool's) names the night only
            who = f" (pid {note['pid']} on {note.get('host', '?')}, since {note.get('since', '?')})" \
                if "pid" in note else ""
            out.append(f"{night}{who}")
    return out


def _with_parts(root: Path) -> list[Path]:
    """The nights that hold a committed part (a night of an empty input holds none)."""
    out = []
    for night in nights(root):
        try:
            view_schema(night, ["id"])
        except FileNotFoundError:
            continue
        out.append(night)
    return out


def union_counts(root: Path) -> tuple[int, int]:
    """The union's ids, and how many of them erred in the night it takes them from (erred in every night)."""
    ranks = _ranks(_with_parts(root))
    return len(ranks), sum(not ok for ok, _ in ranks.values())


def _chosen(held: list[Path]) -> dict[int, int]:
    """Per id (hashed): the index in `held` of the night its union row comes from (module doc)."""
    return {h: i for h, (_, i) in _ranks(held).items()}


def _ranks(held: list[Path]) -> dict[int, tuple[bool, int]]:
    """Per id (hashed): whether its union night's rows have no error, and that night's index in `held`."""
    best: dict[int, tuple[bool, int]] = {}
    for i, night in enumerate(held):
        seen: set[int] = set()
        erred: set[int] = set()
        for batch in latest_batches(night, columns=["id", "error"]):
            for row_id, error in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                (erred if error is not None else seen).add(id_hash(row_id))
        for h in seen | erred:
            rank = (h not in erred, i)
            if h not in best or rank > best[h]:
                best[h] = rank
    return best


def union_batches(root: Path, columns: Optional[list[str]] = None) -> Iterator[pa.Table]:
    """The union of the nights under `root`, each id once (module doc), one table per row group of each night.
    `columns`: the columns to read (default all; `attempt` is always available)."""
    held = _with_parts(root)
    if not held:
        raise FileNotFoundError(f"{root} holds no night with a committed part (YYYY-MM-DD/part-*.parquet)")
    schema = pa.unify_schemas([view_schema(night) for night in held])
    if columns is not None:
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise KeyError(f"{root}: no column {', '.join(missing)} in its nights (columns: "
                           f"{', '.join(schema.names)})")
        schema = pa.schema([schema.field(c) for c in columns])
    chosen = _chosen(held)
    wide = schema.names if "id" in schema.names else [*schema.names, "id"]
    for i, night in enumerate(held):
        for table in latest_batches(night, columns=[c for c in wide if c in view_schema(night).names]):
            keep = [chosen[id_hash(row_id)] == i for row_id in table.column("id").to_pylist()]
            yield _conformed(table.filter(pa.array(keep, pa.bool_())), schema)


def _conformed(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with exactly `schema`'s columns, in its order: a column a night lacks is null."""
    return pa.Table.from_arrays([table.column(f.name).cast(f.type) if f.name in table.column_names
                                 else pa.nulls(table.num_rows, f.type) for f in schema], schema=schema)
