"""The output directory's preparation on start: the manifest checked on a resume (resume rules, docs/contract.md
section 6) or written for a new output, the shard layout recorded, the job id made, a JSONL input's index saved.
Knows files and the manifest, not engines."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from batchgen.errors import ConfigError, ResumeMismatchError
from batchgen.job import JobConfig
from batchgen.output.input_index import save_input_index
from batchgen.output.manifest import build_manifest, check_or_write, job_id, record_layout
from batchgen.output.trust import refuse_strays
from batchgen.reader import Reader


def prepare_output_dir(cfg: JobConfig, output_dir: Path, reader: Reader, resolved: dict[str, Any],
                       passthrough: Optional[list[str]] = None) -> None:
    """Check the manifest of a resume, or write a new output's (`passthrough`: the input columns its parts carry)."""
    started = (output_dir / "_manifest.json").exists()
    if not started:
        refuse_strays(output_dir)  # a _SUCCESS or part without this job's manifest is nobody's to trust
    if started and not cfg.run.resume:
        raise ConfigError([f"run.resume=false but {output_dir} already holds a run; set run.resume=true to "
                           f"continue it, or choose a new output_dir"])
    if not resolved:  # a job built in Python: its own config as written (texts.py), so that `batchgen retry` can
        resolved = json.loads(json.dumps(dataclasses.asdict(cfg.escaped()), default=str))  # rebuild it
    try:
        check_or_write(output_dir, build_manifest(cfg, resolved, reader.fingerprint(), reader.count_rows(),
                                                  passthrough))
    except ResumeMismatchError as exc:
        exc.output_dir = cfg.output_dir  # as the job names it (an object-storage URL, not its staging directory)
        raise
    record_layout(output_dir, cfg.run.num_shards)
    job_id(output_dir)  # made once: what a table output names this output's transactions by
    save_input_index(output_dir, reader)
