"""The output directory's bookkeeping around the job loop: the manifest check on start (resume rules,
docs/contract.md section 6), the parts' file metadata, the totals of what is committed, each shard's share of
the rows. Knows files, the manifest and the committer, not engines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchgen.committer import Committer, PartStats
from batchgen.errors import ConfigError
from batchgen.job import JobConfig
from batchgen.manifest import build_manifest, check_or_write, config_hash, model_identity, record_layout
from batchgen.reader import Reader


def prepare_output_dir(cfg: JobConfig, output_dir: Path, reader: Reader, resolved: dict[str, Any]) -> None:
    started = (output_dir / "_manifest.json").exists()
    if started and not cfg.run.resume:
        raise ConfigError([f"run.resume=false but {output_dir} already holds a run; set run.resume=true to "
                           f"continue it, or choose a new output_dir"])
    check_or_write(output_dir, build_manifest(cfg, resolved, reader.fingerprint(), reader.count_rows()))
    record_layout(output_dir, cfg.run.num_shards)


def file_metadata(cfg: JobConfig) -> dict[str, str]:
    from batchgen.version import __version__

    return {"batchgen.config_hash": config_hash(cfg), "batchgen.model": json.dumps(model_identity(cfg.engine.model)),
            "batchgen.version": __version__}


def committed_totals(committer: Committer, cfg: JobConfig) -> PartStats:
    """What is committed so far: every part, or for a shard its own parts (so shards' totals add up)."""
    totals = PartStats()
    for k in sorted(committer.committed()):
        if k % cfg.run.num_shards == cfg.run.shard:
            totals.add(committer.read_stats(k))
    return totals


def shard_rows(total_rows: int, rows_per_part: int, shard: int, num_shards: int) -> int:
    """Rows of the parts a shard owns (index % num_shards == shard) out of total_rows: full parts, and the last
    part's remainder if it is the shard's."""
    parts = -(-total_rows // rows_per_part)
    owned = len(range(shard, parts, num_shards))
    if owned and (parts - 1) % num_shards == shard:
        return (owned - 1) * rows_per_part + total_rows - (parts - 1) * rows_per_part
    return owned * rows_per_part
