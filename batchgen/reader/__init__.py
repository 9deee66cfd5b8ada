"""Streaming readers: Parquet, JSONL and Hugging Face datasets, in a deterministic row order.

The reader owns file discovery, format detection, row ids and per-row read errors (malformed JSONL
lines, unreadable Parquet row groups). It never holds more than one batch of rows; it knows nothing
about prompts or models. config.py: `dataset.*`; files.py: which files; base.py: rows, ids,
fingerprint; parquet.py, jsonl.py, hfds.py: one reader per format; values.py: column values as written.
"""

from __future__ import annotations

from typing import Optional

from batchgen.reader.base import Reader
from batchgen.reader.config import DatasetConfig
from batchgen.reader.files import resolve_files
from batchgen.reader.hfds import HFReader
from batchgen.reader.jsonl import JsonlReader
from batchgen.reader.openai_batch import OpenAIBatchReader
from batchgen.reader.parquet import ParquetReader
from batchgen.reader.values import column_values, is_json_text

__all__ = ["DatasetConfig", "Reader", "column_values", "is_json_text", "open_reader", "resolve_files"]

READERS: dict[str, type[Reader]] = {"parquet": ParquetReader, "jsonl": JsonlReader, "hf": HFReader,
                                    "openai_batch": OpenAIBatchReader}


def open_reader(cfg: DatasetConfig, part_size: Optional[int] = None) -> Reader:
    """The input's reader; `part_size` (the job's rows per part) lets a JSONL input mark every part's start in its
    one pass, so that a shard or a resume reads only its own parts."""
    fmt, files, fs, root = resolve_files(cfg)
    return READERS[fmt](cfg, files, fs, root, part_size=part_size)
