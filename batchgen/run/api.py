"""batchgen.generate: rows in memory (a list of dicts, a pyarrow Table, a datasets.Dataset) through a job, the
latest-attempt view back as a pyarrow Table. The rows become the job's input file, `_input.parquet` in its
output_dir, so a given output_dir resumes, refuses another input and records errors exactly as a job from a file
does; without one, the job runs in a temporary directory removed afterwards."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.job import JobConfig
from batchgen.output.view import latest
from batchgen.prompts.render import RenderRow
from batchgen.run.runner import run_job

INPUT = "_input.parquet"  # in output_dir: the rows handed in


def as_table(rows: Any) -> pa.Table:
    """rows as a pyarrow Table: a Table as is, a datasets.Dataset (its selection and order), a list of dicts."""
    if isinstance(rows, pa.Table):
        return rows
    if hasattr(rows, "with_format") and hasattr(rows, "features"):  # datasets.Dataset
        return rows.with_format("arrow")[:]
    if isinstance(rows, list) and all(isinstance(row, dict) for row in rows):
        return pa.Table.from_pylist(rows)
    raise TypeError(f"rows: a list of dicts, a pyarrow.Table or a datasets.Dataset (got {type(rows).__name__})")


def _write_input(table: pa.Table, path: Path) -> None:
    """The rows as the job's input, written once: a resume hands in the same rows and leaves the file as it is (a
    different table is written, and the manifest's input check refuses the resume)."""
    if path.exists() and pq.read_table(path).equals(table):
        return
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, temp)
    os.replace(temp, path)


def generate(rows: Any, cfg: JobConfig, output_dir: Optional[str | Path] = None,
             render_row: Optional[RenderRow] = None) -> pa.Table:
    """Run `cfg` over `rows`; the latest-attempt view of its output (one row per row and sample, in input order,
    with the contract's columns: id, generation, finish_reason, error...). `cfg` is not changed."""
    job = copy.deepcopy(cfg)
    with tempfile.TemporaryDirectory(prefix="batchgen-") as scratch:
        out = Path(output_dir) if output_dir is not None else Path(scratch) / "out"
        out.mkdir(parents=True, exist_ok=True)
        _write_input(as_table(rows), out / INPUT)
        job.dataset.path, job.dataset.format, job.output_dir = str(out / INPUT), "parquet", str(out)
        run_job(job, render_row=render_row)
        return latest(out)
