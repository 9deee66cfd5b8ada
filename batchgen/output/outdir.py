"""The output directory's bookkeeping around the job loop: the manifest check on start (resume rules,
docs/contract.md section 6), the parts' file metadata, the totals of what is committed, each shard's share of
the rows. Knows files, the manifest and the committer, not engines."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional

from batchgen.errors import ConfigError
from batchgen.fsutil import write_json_atomic
from batchgen.job import JobConfig, owns
from batchgen.output.committer import Committer
from batchgen.output.manifest import build_manifest, check_or_write, config_hash, job_id, model_identity, record_layout
from batchgen.output.rows.stats import PartStats
from batchgen.output.trust import refuse_strays
from batchgen.reader import Reader

log = logging.getLogger(__name__)


def prepare_output_dir(cfg: JobConfig, output_dir: Path, reader: Reader, resolved: dict[str, Any],
                       passthrough: Optional[list[str]] = None) -> None:
    """Check the manifest of a resume, or write a new output's (`passthrough`: the input columns its parts carry)."""
    started = (output_dir / "_manifest.json").exists()
    if not started:
        refuse_strays(output_dir)  # a _SUCCESS or part without this job's manifest is nobody's to trust
    if started and not cfg.run.resume:
        raise ConfigError([f"run.resume=false but {output_dir} already holds a run; set run.resume=true to "
                           f"continue it, or choose a new output_dir"])
    if not resolved:  # a job built in Python: its own config, so that `batchgen retry` can rebuild it
        resolved = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    check_or_write(output_dir, build_manifest(cfg, resolved, reader.fingerprint(), reader.count_rows(), passthrough))
    record_layout(output_dir, cfg.run.num_shards)
    job_id(output_dir)  # made once: what a table output names this output's transactions by
    save_input_index(output_dir, reader)


INPUT_INDEX = "_input_index.json"  # a JSONL input's column types and part marks, made once (reader/jsonl.py)


def load_input_index(cfg: JobConfig, output_dir: Path, reader: Reader) -> None:
    """A JSONL input: marks at every part start (the part size as the stride), and the pass over every line taken
    from output_dir's saved index where one was made from the same input by a reader of the same shape (format,
    part size, dataset.limit: reader.shape()), so a shard or a resume reads only its own parts. Another input's or
    shape's index is not used (the reader makes its own pass). Other inputs: nothing to do."""
    if not hasattr(reader, "use_index"):
        return
    reader.stride = cfg.rows_per_part
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


def file_metadata(cfg: JobConfig) -> dict[str, str]:
    from batchgen.version import __version__

    return {"batchgen.config_hash": config_hash(cfg), "batchgen.model": json.dumps(model_identity(cfg.engine.model)),
            "batchgen.version": __version__}


def committed_totals(committer: Committer, cfg: JobConfig) -> PartStats:
    """What is committed so far: every part, or for a shard its own parts (so shards' totals add up)."""
    totals = PartStats()
    for k in sorted(committer.committed()):
        if cfg.run.owns(k):
            totals.add(committer.read_stats(k))
    return totals


def shard_rows(total_rows: int, rows_per_part: int, shard: int, num_shards: int) -> int:
    """Rows of the parts a shard owns (index % num_shards == shard) out of total_rows: full parts, and the last
    part's remainder if it is the shard's."""
    parts = -(-total_rows // rows_per_part)
    owned = len(range(shard, parts, num_shards))
    if owned and owns(parts - 1, shard, num_shards):
        return (owned - 1) * rows_per_part + total_rows - (parts - 1) * rows_per_part
    return owned * rows_per_part
