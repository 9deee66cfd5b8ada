"""A JSONL input's index beside the output: its column types and part marks from the one pass over every line
(reader/jsonl.py), saved once and taken by the other shards and the resumes of the same input and reader shape, so
that each reads only its own parts. Only a cache: one that cannot be read, or was made from another input or by a
reader of another shape, is made again."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from batchgen.fsutil import write_json_atomic
from batchgen.reader import Reader

log = logging.getLogger(__name__)

INPUT_INDEX = "_input_index.json"  # a JSONL input's column types and part marks, made once (reader/jsonl.py)


def load_input_index(output_dir: Path, reader: Reader) -> None:
    """A JSONL input (opened with the job's part size): the pass over every line taken from output_dir's saved index
    where one was made from the same input by a reader of the same shape (format, part size, dataset.limit:
    reader.shape()), so a shard or a resume reads only its own parts. Another input's or shape's index is not used
    (the reader makes its own pass). Other inputs: nothing to do."""
    if not hasattr(reader, "use_index"):
        return
    path = output_dir / INPUT_INDEX
    saved = _saved_index(path)
    if saved is None:
        return
    if _made_by(saved, reader) and reader.use_index(saved):
        log.info("input types and part marks from %s", path)
    else:
        log.info("%s was made from another input or by another reader (%s); reading the input again", path,
                 saved.get("shape"))


def save_input_index(output_dir: Path, reader: Reader) -> None:
    """Keep a JSONL input's pass for the other shards and the resumes (call with the layout lock held). An index
    saved from another input or by a reader of another shape is overwritten: the latest job's is the one kept."""
    if not hasattr(reader, "index"):
        return
    path = output_dir / INPUT_INDEX
    saved = _saved_index(path)
    if saved is None or not _made_by(saved, reader):
        write_json_atomic(path, reader.index() | {"input": reader.fingerprint()})  # index() holds the shape


def _saved_index(path: Path) -> dict[str, Any] | None:
    """The saved index, or None where there is none or it cannot be read (it is only a cache: made again)."""
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s); the input is read again and the index saved anew", path, exc)
        return None
    return saved if isinstance(saved, dict) else None


def _made_by(saved: dict[str, Any], reader: Any) -> bool:
    """Whether a saved index was made from this reader's input (its bytes) by a reader of its shape; compared as
    JSON text, since the saved one was read back through JSON."""
    def key(fingerprint: Any, shape: Any) -> str:
        return json.dumps({"input": fingerprint, "shape": shape}, sort_keys=True, default=str)

    return key(saved.get("input"), saved.get("shape")) == key(reader.fingerprint(), reader.shape())
