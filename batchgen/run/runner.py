"""The job loop: reader/planner -> engine -> committer, with parts streamed through the engine (feed.py). The
checks before it are preflight's and outdir's, what it tells while it runs is progress's. Knows no Hydra.
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any, Optional

from batchgen.checks import validate
from batchgen.engines import build_engine, task_engine
from batchgen.engines.base import Engine
from batchgen.errors import BatchgenError
from batchgen.job import JobConfig
from batchgen.output.committer import Committer
from batchgen.output.heartbeat import status_name
from batchgen.output.manifest import MANIFEST, check_engine, model_identity
from batchgen.output.openai_out import RESULTS, write_if_wanted
from batchgen.output.outdir import committed_totals
from batchgen.output.remote import is_remote
from batchgen.output.rows.schema import SUCCESS
from batchgen.output.rows.stats import PartStats
from batchgen.prompts.planner import Planner, shard_holds
from batchgen.prompts.render import RenderRow
from batchgen.run import respcache
from batchgen.run.feed import Feed, auto_lookahead, check_error_rate
from batchgen.run.prepare import JobInput, JobOutput, open_input, open_output, output_place
from batchgen.run.progress import Progress, Summary, find_resumed, numerics_said, tokens_said
from batchgen.run.stopping import GracefulStop

log = logging.getLogger(__name__)
DEFAULT_BATCH_SLOTS = 256  # an engine that does not say how many rows it decodes together (vLLM's max_num_seqs)


def run_job(cfg: JobConfig, resolved: Optional[dict[str, Any]] = None, *,
            render_row: Optional[RenderRow] = None) -> Summary:
    """Run one job (or one shard of it) to completion; resumable at any point. The config is validated here (as
    the CLI does), so a Python job may build its JobConfig by hand; `render_row(row) -> str | messages` replaces
    the prompt column or template (render.Renderer).

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
    validate(cfg)
    if cfg.launcher.name == "ray":
        from batchgen.run.ray_job import run_on_ray

        return run_on_ray(cfg, resolved, render_row)
    with GracefulStop() as stop:
        return _run_job(cfg, resolved, stop, render_row)


def _run_job(cfg: JobConfig, resolved: Optional[dict[str, Any]], stop: GracefulStop,
             render_row: Optional[RenderRow]) -> Summary:
    started = time.perf_counter()
    job = open_input(cfg, output_place(cfg)[0], render_row)  # refused before anything is written
    if cfg.dataset.verify == "pages" and hasattr(job.reader, "verify_pages"):
        job.reader.verify_pages(partial(shard_holds, cfg))  # this shard's row groups only
    with open_output(cfg, job, resolved) as out:
        summary = Summary(out.shown, "partial", committed_totals(out.committer, cfg))
        if (out.output_dir / SUCCESS).exists():
            log.info("%s is already complete; nothing to do", out.output_dir)
            if cfg.output.format == "openai_batch" and not out.remote and not (out.output_dir / RESULTS).exists():
                write_derived(cfg, out.output_dir)  # written by a batchgen that wrote it after _SUCCESS, then killed
            summary.state = "already_done"
            return summary
        planner = Planner(cfg, job.reader, job.renderer, job.tokenizer, job.existing)
        summary.rows_already_committed = summary.totals.rows
        resumed = find_resumed(cfg, out.committer, out.shown, summary.totals, samples_per_row(cfg, planner))
        progress = Progress(cfg, out.committer, job.reader.count_rows(), summary.totals, stop, resumed=resumed)
        try:
            _load_and_generate(cfg, job, out, planner, summary, progress, started)
        except BaseException as exc:
            summary.state = "failed" if isinstance(exc, Exception) else "stopped"
            progress.duplicate_ids = planner.duplicate_ids
            progress.close(summary.state, None, error=str(exc))
            raise
        finally:
            if out.remote:
                out.remote.push(status_name(cfg.run.shard, cfg.run.num_shards))
        summary.wall_s = time.perf_counter() - started
        return summary


def _load_and_generate(cfg: JobConfig, job: JobInput, out: JobOutput, planner: Planner, summary: Summary,
                       progress: Progress, started: float) -> None:
    """Load the engine, check what it resolved to against the manifest, and generate this shard's parts."""
    engine = respcache.wrap(build_engine(task_engine(cfg), job.tokenizer), cfg,
                            model_identity(cfg.engine.model))
    summary.load_s = time.perf_counter() - started
    progress.loaded()
    with out.lock.layout():
        check_engine(out.output_dir, engine.identity())  # what engine.dtype=auto resolved to, the same
        if out.remote:
            out.remote.push(MANIFEST)
    out.committer.metadata["batchgen.engine"] = json.dumps(engine.identity())  # resolved dtype, device, version
    summary.numerics = numerics_said(engine.identity())
    summary.token_source = tokens_said(cfg.engine)
    progress.engine = engine
    try:
        _generate_parts(cfg, planner, engine, out.committer, summary, progress)
    finally:
        engine.close()


def _generate_parts(cfg: JobConfig, planner: Planner, engine: Engine, committer: Committer, summary: Summary,
                    progress: Progress) -> None:
    """Stream this shard's uncommitted parts through the engine (feed.Feed: a bounded look-ahead of parts in
    flight, each committed as soon as its last sample is in), then write _SUCCESS if every part exists."""
    def on_committed(stats: PartStats, generated: int) -> None:
        summary.totals.add(stats)
        summary.generated_tokens += generated
        check_error_rate(cfg, summary.totals)

    lookahead = cfg.run.lookahead_parts
    if lookahead is None:
        lookahead = auto_lookahead(engine.max_batch_size or DEFAULT_BATCH_SLOTS, cfg.rows_per_part, cfg.sampling.n)
    feed = Feed(cfg, planner, committer, progress, summary, max_model_len=engine.max_model_len, lookahead=lookahead,
                on_committed=on_committed)
    try:
        engine.stream(feed.source, feed.on_result)
        feed.finish()
    finally:
        feed.close()
        summary.lookahead_parts, summary.max_parts_in_flight = lookahead, feed.max_in_flight
        _note_engine(summary, engine, committer)
    summary.duplicate_ids = progress.duplicate_ids = planner.duplicate_ids
    summary.rows_read, summary.rows_typed = planner.reader.rows_read, planner.reader.rows_typed
    summary.log_internals()
    if planner.total_rows == 0 and cfg.run.shard == 0:
        committer.write_empty()
    total = max(planner.total_parts, 1 if planner.total_rows == 0 else 0)
    done = committer.committed()  # one listing (on object storage, one request), not one per part
    missing = [k for k in range(total) if cfg.run.owns(k) and k not in done]
    if missing:  # the engine returned with parts of this shard unfinished: never "partial" with exit 0
        raise BatchgenError(f"parts {', '.join(map(str, missing[:10]))} of this shard were not committed although "
                            f"the engine finished; their journaled samples are kept: rerun to resume")
    complete = committer.finish(total, before_success=partial(write_derived, cfg, committer.output_dir))
    summary.state = "done" if complete else "partial"
    progress.close(summary.state, planner.total_rows)
    summary.work = progress.last_work  # the figure the final status recorded


def _note_engine(summary: Summary, engine: Any, committer: Committer) -> None:
    """What the engine, its response cache and the table output report, into the summary."""
    summary.prefix_tokens_reused = getattr(getattr(engine, "stats", None), "prefix_tokens_reused", 0)
    summary.kv_cache = kv_cache_said(getattr(engine, "stats", None))
    summary.cache = getattr(engine, "cache_stats", None)
    if committer.sink is not None:
        summary.table, summary.table_commits = committer.sink.describe(), committer.sink.commits
        summary.table_commit_s = committer.sink.commit_s


def samples_per_row(cfg: JobConfig, planner: Planner) -> int:
    """The requests a row plans: sampling.n, or for task=decide one per answer of every question."""
    if cfg.task == "decide":
        return max(sum(len(answers) for answers in planner.questions()[1]), 1)
    return cfg.sampling.n


def write_derived(cfg: JobConfig, output_dir: Path) -> None:
    """The files made from a complete output, written before its _SUCCESS (so a complete output always has them):
    the OpenAI batch results file, and for a retry's attempt its job's results file, from the latest attempts."""
    if cfg.output.format != "openai_batch" or is_remote(cfg.output_dir):
        return
    log.info("OpenAI batch results: %s", write_if_wanted(output_dir))
    if cfg.run.attempt:
        log.info("OpenAI batch results rewritten from the latest attempts: %s",
                 write_if_wanted(output_dir.parent.parent))  # _attempts/attempt-NNN/ -> the job's output_dir


def kv_cache_said(stats: Any) -> str:
    """The hf engine's KV cache as the summary says it: slots, positions, bytes ("" where there is none)."""
    slots = getattr(stats, "kv_slots", 0)
    if not slots:
        return ""
    return f"{slots} slots x {stats.kv_positions} positions, {stats.kv_cache_bytes / 1e9:.2f} GB (keys and values)"
