"""The local run: reader/planner -> engine -> committer, with parts streamed through the engine (feed.py), inside
the run's steps that every way to run a job shares (lifecycle.py). The checks before it are checks.py's and
preflight's, what it tells while it runs is progress's. Knows no Hydra.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any, Optional

from batchgen.checks import validate
from batchgen.engines.base import Engine, EngineStats
from batchgen.job import JobConfig
from batchgen.output.committer import Committer
from batchgen.output.manifest import MANIFEST, check_engine
from batchgen.output.rows.stats import PartStats
from batchgen.prompts.planner import Planner
from batchgen.prompts.render import RenderRow
from batchgen.run import lifecycle
from batchgen.run.feed import Feed, auto_lookahead, check_error_rate
from batchgen.run.lifecycle import Driven, Loaded
from batchgen.run.prepare import HeldEngine, JobInput, JobOutput, open_engine, open_input, output_place
from batchgen.run.progress import Progress, Summary
from batchgen.run.stopping import GracefulStop

log = logging.getLogger(__name__)
DEFAULT_BATCH_SLOTS = 256  # an engine that does not say how many rows it decodes together (vLLM's max_num_seqs)


def run_job(cfg: JobConfig, resolved: Optional[dict[str, Any]] = None, *,
            render_row: Optional[RenderRow] = None, held: Optional[HeldEngine] = None) -> Summary:
    """Run one job (or one shard of it) to completion; resumable at any point. The config is validated here (as
    the CLI does), so a Python job may build its JobConfig by hand; `render_row(row) -> str | messages` replaces
    the prompt column or template (render.Renderer); `held`: an engine kept loaded across runs (batchgen.Session,
    launcher=local), used instead of loading one and left open.

    1. open the input and load the tokenizer; check columns and chat template (before any model loads)
    2. lock output_dir and check or write the manifest (refuse a mismatched resume)
    3. stop here if the job is already complete
    4. write the first status, load the engine
    5. stream this shard's uncommitted parts through the engine, a bounded look-ahead of them in flight: each
       planned, its journal reused, the rest generated (each result journaled), then assembled, committed and its
       journal dropped as soon as its last sample is in (feed.Feed)
    6. write _SUCCESS once every part exists, and the summary
    SIGTERM / SIGINT raise StopRequested (exit 143 / 130) once the finished results are journaled.
    """
    cfg = validate(cfg)  # the resolved copy
    if cfg.launcher.name == "ray":
        from batchgen.run.ray_job import run_on_ray

        return run_on_ray(cfg, resolved, render_row)
    with GracefulStop() as stop:
        return _run_job(cfg, resolved, stop, render_row, held)


def _run_job(cfg: JobConfig, resolved: Optional[dict[str, Any]], stop: GracefulStop,
             render_row: Optional[RenderRow], held: Optional[HeldEngine] = None) -> Summary:
    started = time.perf_counter()
    job = open_input(cfg, output_place(cfg)[0], render_row)  # refused before anything is written
    if cfg.dataset.verify == "pages" and hasattr(job.reader, "verify_pages"):
        job.reader.verify_pages(cfg.share().holds)  # this shard's row groups only
    return lifecycle.run(cfg, job, resolved, stop, LocalDriver(cfg, job, held), started)


class LocalDriver:
    """The local run's parts: one engine in this process, this shard's parts streamed through it (feed.Feed)."""

    def __init__(self, cfg: JobConfig, job: JobInput, held: Optional[HeldEngine] = None):
        self.cfg, self.job, self.held = cfg, job, held
        self.planner = Planner(cfg, job.reader, job.renderer, job.tokenizer, job.existing)
        self.engine: Optional[Engine] = None  # loaded by drive(), closed by close()

    @functools.cached_property
    def total_rows(self) -> Optional[int]:  # read once the output is open and not complete
        return self.job.reader.count_rows()

    @functools.cached_property
    def samples_per_row(self) -> int:
        return samples_per_row(self.cfg, self.planner)

    def drive(self, out: JobOutput, summary: Summary, progress: Progress) -> Driven:
        """Load the engine, check what it resolved to against the manifest, and generate this shard's parts."""
        cfg = self.cfg
        engine = self.engine = open_engine(cfg, self.job.tokenizer, self.held)
        loaded = Loaded(engine.identity(), time.perf_counter())
        progress.loaded()
        with out.lock.layout():
            check_engine(out.output_dir, loaded.identity)  # what engine.dtype=auto resolved to, the same
            if out.remote:
                out.remote.push(MANIFEST)
        out.committer.metadata["batchgen.engine"] = json.dumps(loaded.identity)  # resolved dtype, device, version
        started = engine.stats()  # a held engine's (batchgen.Session) work so far: this run reports its own
        progress.engine_stats = lambda: engine.stats().since(started)
        try:
            return self._generate(engine, out.committer, summary, progress, loaded, started)
        finally:
            progress.duplicate_ids = self.planner.duplicate_ids

    def close(self) -> None:
        if self.engine is not None and self.held is None:  # a held engine stays loaded for the next run
            self.engine.close()
        self.engine = None

    def _generate(self, engine: Engine, committer: Committer, summary: Summary, progress: Progress,
                  loaded: Loaded, started: EngineStats) -> Driven:
        """Stream this shard's uncommitted parts through the engine (feed.Feed: a bounded look-ahead of parts in
        flight, each committed as soon as its last sample is in)."""
        cfg, planner = self.cfg, self.planner

        def on_committed(stats: PartStats, generated: int) -> None:
            summary.committed(stats, generated)
            check_error_rate(cfg, summary.totals, committer)

        lookahead = cfg.run.lookahead_parts
        if lookahead is None:
            lookahead = auto_lookahead(engine.max_batch_size or DEFAULT_BATCH_SLOTS, cfg.rows_per_part, cfg.sampling.n)
        feed = Feed(cfg, planner, committer, progress, summary, max_model_len=engine.max_model_len,
                    lookahead=lookahead, on_committed=on_committed)
        try:
            engine.stream(feed.source, feed.on_result)
            feed.finish()
        finally:
            feed.close()
        return Driven(planner.total_parts, planner.total_rows, loaded, engine.stats().since(started), lookahead,
                      feed.max_in_flight, planner.duplicate_ids, planner.reader.rows_read, planner.reader.rows_typed)



def samples_per_row(cfg: JobConfig, planner: Planner) -> int:
    """The requests a row plans: sampling.n, or for task=decide one per answer of every question."""
    if cfg.task == "decide":
        return max(sum(len(answers) for answers in planner.questions()[1]), 1)
    return cfg.sampling.n
