"""Hugging Face `datasets` input: a saved dataset memory-mapped, or a hub/builder id streamed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Optional

import pyarrow as pa

from batchgen.errors import InputError
from batchgen.reader.base import Reader
from batchgen.reader.config import DatasetConfig


class HFReader(Reader):
    """A `datasets` dataset saved with save_to_disk (memory-mapped), or a hub/builder id streamed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ds = None

    def dataset(self):
        if self._ds is None:
            self._ds = _load_hf(self.cfg)
        return self._ds

    def columns(self) -> list[str]:
        ds = self.dataset()
        names = ds.column_names or list((ds.features or {}).keys())
        return list(names)

    def count_rows(self) -> Optional[int]:
        ds = self.dataset()
        if not hasattr(ds, "__len__"):
            return None
        return len(ds) if self.cfg.limit is None else min(len(ds), self.cfg.limit)

    def fingerprint(self) -> list[dict[str, Any]]:
        ds = self.dataset()
        return [{"path": self.cfg.path, "split": self.cfg.split, "fingerprint": getattr(ds, "_fingerprint", None)}]

    def _file_batches(self, path: str) -> Iterator[tuple[pa.Table, list[str | None]]]:
        ds = self.dataset()
        if hasattr(ds, "decode"):  # a streamed dataset: an Image/Audio value's `path` is data, never a file to open
            ds = ds.decode(False)
        if hasattr(ds, "with_format") and hasattr(ds, "__len__"):
            for table in ds.with_format("arrow").iter(batch_size=self.cfg.batch_rows):
                yield table, [None] * table.num_rows
            return
        for batch in ds.iter(batch_size=self.cfg.batch_rows):
            table = pa.Table.from_pydict(batch)
            yield table, [None] * table.num_rows


def _load_hf(cfg: DatasetConfig):
    import datasets

    local = os.path.isdir(cfg.path)
    try:
        if local:
            ds = datasets.load_from_disk(cfg.path)
        else:
            ds = datasets.load_dataset(cfg.path, split=cfg.split or "train", streaming=True)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise InputError(f"dataset.path: cannot load HF dataset {cfg.path!r}: {exc}") from exc
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        split = cfg.split or ("train" if "train" in ds else None)
        if split not in ds:
            raise InputError(f"dataset.split: choose one of {sorted(ds)} for {cfg.path}")
        ds = ds[split]
    return ds
