"""The Python API for rows held in memory: batchgen.generate (one job over the rows, its engine loaded for the call,
or handed in held by a batchgen.Session: commands/session.py). The rows (a pandas DataFrame, a
pyarrow Table, a datasets.Dataset or a list of dicts) become the job's input file, `_input.parquet` in its
output_dir, so a given output_dir resumes, refuses other rows and records errors exactly as a job from a file does;
without one, the job runs in a temporary directory removed afterwards. Rows without an id get `row:N`, their
position in the rows handed in. Every call runs the job's one set-up and run (run_job); a Session only hands it
the engine it keeps (prepare.HeldEngine)."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import ResumeMismatchError
from batchgen.job import JobConfig
from batchgen.output.manifest import MANIFEST
from batchgen.output.view import latest
from batchgen.prompts.render import RenderRow
from batchgen.run.prepare import HeldEngine
from batchgen.run.runner import run_job

INPUT = "_input.parquet"  # in output_dir: the rows handed in
RETURNS = ("auto", "pandas", "arrow")  # generate(to=...): auto is a DataFrame for a DataFrame, else a Table


def as_table(rows: Any) -> pa.Table:
    """rows as a pyarrow Table: a Table as is, a pandas DataFrame (its columns, not its index), a datasets.Dataset
    (its selection and order), a list of dicts."""
    if isinstance(rows, pa.Table):
        return rows
    if _is_pandas(rows):
        return pa.Table.from_pandas(rows, preserve_index=False)
    if hasattr(rows, "with_format") and hasattr(rows, "features"):  # datasets.Dataset
        return rows.with_format("arrow")[:]
    if isinstance(rows, list) and all(isinstance(row, dict) for row in rows):
        return pa.Table.from_pylist(rows)
    raise TypeError(f"rows: a pandas DataFrame, a list of dicts, a pyarrow.Table or a datasets.Dataset (got "
                    f"{type(rows).__name__})")


def _is_pandas(rows: Any) -> bool:
    return type(rows).__module__.split(".")[0] == "pandas" and hasattr(rows, "columns")


def with_ids(table: pa.Table, column: str) -> pa.Table:
    """`table` with its id column: `row:N` (N its position, from 0) for a row without one, or for every row where
    the rows have no such column; ids given are kept as written."""
    if column in table.column_names and table.column(column).null_count == 0:
        return table
    given = table.column(column).to_pylist() if column in table.column_names else [None] * table.num_rows
    ids = pa.array([f"row:{i}" if v is None else str(v) for i, v in enumerate(given)], pa.string())
    if column in table.column_names:
        return table.set_column(table.column_names.index(column), column, ids)
    return table.append_column(column, ids)


def _write_input(table: pa.Table, path: Path) -> None:
    """The rows as the job's input, written once: a resume hands in the same rows and leaves the file as it is (a
    different table is written, and the manifest's input check refuses the resume)."""
    if path.exists() and pq.read_table(path).equals(table):
        return
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, temp)
    os.replace(temp, path)


def _returned(table: pa.Table, rows: Any, to: str) -> Any:
    if to not in RETURNS:
        raise ValueError(f"to={to!r}: one of {', '.join(map(repr, RETURNS))}")
    return table.to_pandas() if to == "pandas" or (to == "auto" and _is_pandas(rows)) else table


def generate(rows: Any, cfg: JobConfig, output_dir: Optional[str | Path] = None,
             render_row: Optional[RenderRow] = None, *, overwrite: bool = False, to: str = "auto",
             held: Optional[HeldEngine] = None) -> Any:
    """Run `cfg` over `rows`; the latest-attempt view of its output (one row per row and sample, in input order,
    with the contract's columns: id, generation, finish_reason, error...), as a pandas DataFrame (to="pandas", or
    "auto" for a DataFrame handed in) or a pyarrow Table. `output_dir`: kept and resumable; one holding the output
    of other rows or another config is refused, or replaced where `overwrite`. `held`: a Session's engine. `cfg`
    is not changed."""
    job = copy.deepcopy(cfg)
    job.dataset.id_column = job.dataset.id_column or "id"
    table = with_ids(as_table(rows), job.dataset.id_column)
    with tempfile.TemporaryDirectory(prefix="batchgen-") as scratch:
        out = Path(output_dir) if output_dir is not None else Path(scratch) / "out"
        if overwrite and (out / MANIFEST).exists():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        _write_input(table, out / INPUT)
        job.dataset.path, job.dataset.format, job.output_dir = str(out / INPUT), "parquet", str(out)
        try:
            run_job(job, render_row=render_row, held=held)
        except ResumeMismatchError as exc:
            raise ResumeMismatchError(
                f"output_dir={str(out)!r} holds the output of other rows or another config ("
                f"{'; '.join(exc.changes[:3]) or 'see its _manifest.json'}): pass a new output_dir=..., or "
                f"overwrite=True to replace that output", exc.changes) from None
        return _returned(latest(out), rows, to)
