"""batchgen.Session: a job composed once (as load_job composes a preset) whose engine is loaded once and serves many
batchgen.generate calls (run/api.py), each with the job's guarantees. A front end like the command line: it knows the
config's composition (commands/compose.py) and hands the run its held engine (run/prepare.py's HeldEngine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from batchgen.commands.compose import load_job
from batchgen.job import JobConfig
from batchgen.prompts.render import RenderRow
from batchgen.run.api import generate
from batchgen.run.prepare import HeldEngine


class Session:
    """batchgen.Session: a job whose engine is loaded once and serves many generate calls (a notebook's, say), each
    with the job's guarantees (ids, error rows, constraints, carried columns; resumable given an output_dir):

        with batchgen.Session(job="classify", overrides=["engine.model=..."]) as s:
            df = s.generate(reviews)            # the model loads here, once
            more = s.generate(other_reviews)    # the same engine

    `job` and `overrides` as for load_job (no job: the overrides alone), or a JobConfig as `cfg`. The engine loads on
    the first call (launcher=local) and is closed by close() or the end of the `with` block."""

    def __init__(self, job: Optional[str] = None, overrides: Optional[list[str]] = None, *,
                 config_dir: Optional[str] = None, cfg: Optional[JobConfig] = None):
        if cfg is None:
            cfg = load_job(job, overrides, config_dir)
        elif job is not None or overrides:
            raise TypeError("Session: give job and overrides, or cfg, not both")
        self.cfg = cfg  # as given: each call validates its own copy, with its rows and output_dir
        self.held = HeldEngine()

    def generate(self, rows: Any, output_dir: Optional[str | Path] = None, render_row: Optional[RenderRow] = None,
                 *, overwrite: bool = False, to: str = "auto") -> Any:
        """batchgen.generate(rows, <the session's job>, ...) on the session's engine."""
        return generate(rows, self.cfg, output_dir, render_row, overwrite=overwrite, to=to, held=self.held)

    def close(self) -> None:
        """Release the engine (its memory); a later generate loads it again."""
        self.held.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
