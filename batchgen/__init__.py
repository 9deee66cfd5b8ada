"""batchgen: offline batch generation for LLMs, streamed from datasets into resumable Parquet parts.

The public API for Python jobs (see jobs/): build a JobConfig (plain dataclasses, validated by run_job as the
CLI validates its config) and call run_job, optionally with a row-rendering function:

    from batchgen import JobConfig, run_job
    cfg = JobConfig(name="sentiment")
    cfg.dataset.path, cfg.engine.model = "reviews.parquet", "models/my-llama"
    summary = run_job(cfg, render_row=lambda row: f"Review: {row['text']}\nSentiment:")

or load a preset with overrides and run rows held in memory, getting the output back as a pyarrow Table:

    from batchgen import generate, load_job
    cfg = load_job("classify", ["engine.model=models/my-llama"])
    table = generate([{"ticket_id": 1, "messages": [...]}], cfg)             # a temporary output, removed
    table = generate(rows, cfg, output_dir="data/outputs/tickets")           # resumable, as a job from a file

or keep the model loaded across calls (a notebook):

    from batchgen import Session
    with Session(job="classify", overrides=["engine.model=models/my-llama"]) as s:
        df = s.generate(reviews_df)                                           # a DataFrame in, a DataFrame out

The contract (config keys, output, resume, exit codes) is docs/contract.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchgen.version import __version__

__all__ = ["BatchgenError", "JobConfig", "Session", "Summary", "generate", "load_job", "run_job", "__version__"]

if TYPE_CHECKING:
    from batchgen.commands.compose import load_job
    from batchgen.commands.session import Session
    from batchgen.errors import BatchgenError
    from batchgen.job import JobConfig
    from batchgen.run.api import generate
    from batchgen.run.runner import Summary, run_job


def __getattr__(name: str) -> Any:  # lazy: `import batchgen` stays cheap (no torch, no pyarrow) until used
    if name == "run_job" or name == "Summary":
        import batchgen.run.runner as runner

        return getattr(runner, name)
    if name == "generate":
        from batchgen.run.api import generate

        return generate
    if name == "Session":
        from batchgen.commands.session import Session

        return Session
    if name == "load_job":
        from batchgen.commands.compose import load_job

        return load_job
    if name == "JobConfig":
        from batchgen.job import JobConfig

        return JobConfig
    if name == "BatchgenError":
        from batchgen.errors import BatchgenError

        return BatchgenError
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
