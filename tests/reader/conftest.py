"""Helpers of the reader tests: every row of an input, read the way a job streams it."""

from __future__ import annotations

from batchgen.reader import DatasetConfig, open_reader


def read_all(cfg: DatasetConfig) -> tuple[list[str], list, list]:
    ids, rows, errors = [], [], []
    for batch in open_reader(cfg).iter_batches():
        ids += batch.ids
        rows += batch.table.to_pylist()
        errors += batch.read_errors
    return ids, rows, errors
