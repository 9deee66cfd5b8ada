"""One run of a job, written once for every way to run one (runner.py's local run, ray_job.py's driver): open the
output (locked, manifest checked), stop if it is complete, count what earlier runs committed, let the caller's
`Driver` load its engine and generate the parts, then finish: the empty part of an empty input, the check that every
part of this shard is in, the derived files and _SUCCESS, the final status, the summary. A failure or a stop is
written to the status, then raised. The drivers know how parts are generated; this module knows the order of a
run's steps and is the one place that fills the Summary."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional, Protocol

from batchgen.engines.base import EngineStats
from batchgen.errors import BatchgenError
from batchgen.job import JobConfig
from batchgen.output.committer import Committer
from batchgen.output.heartbeat import status_name
from batchgen.output.openai_out import RESULTS, write_if_wanted
from batchgen.output.remote import is_remote
from batchgen.output.rows.schema import SUCCESS
from batchgen.output.throughput import RunWork
from batchgen.run.prepare import JobInput, JobOutput, open_output
from batchgen.run.progress import Progress, Summary, find_resumed, numerics_said, tokens_said
from batchgen.run.stopping import GracefulStop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    """The engine a driver loaded: what it resolved to (its identity) and when it was ready."""

    identity: dict[str, Any]
    at: float  # time.perf_counter()


@dataclass(frozen=True)
class Driven:
    """What a driver did, for the finish and the summary."""

    parts: int  # the input's parts (all shards'): known once a streamed input was read to its end
    rows: int  # the input's rows
    loaded: Loaded
    engine: EngineStats = field(default_factory=EngineStats)
    lookahead_parts: int = 0  # parts in flight beyond the oldest, at most
    max_parts_in_flight: int = 0
    duplicate_ids: int = 0
    rows_read: int = 0  # input rows this run decoded
    rows_typed: int = 0  # lines a JSONL input's typing pass parsed


class Driver(Protocol):
    """How a run generates its shard's parts: load the engine, generate each uncommitted part and commit it
    (`summary.committed` and `progress.committed` as each comes in), and say what it did."""

    total_rows: Optional[int]  # the input's rows where counted before the run (None: a streamed input)
    samples_per_row: int  # the requests a row plans (sampling.n; task=decide: every answer of every question)

    def drive(self, out: JobOutput, summary: Summary, progress: Progress) -> Driven: ...

    def close(self) -> None:
        """Release what drive() opened (the engine), once the final status is written or the run failed."""


def run(cfg: JobConfig, job: JobInput, resolved: Optional[dict[str, Any]], stop: GracefulStop, driver: Driver,
        started: float) -> Summary:
    """The run's steps in order (the module docstring); `started`: time.perf_counter() when the run began."""
    with open_output(cfg, job, resolved) as out:
        summary = Summary(out.shown, "partial", out.committer.totals(cfg.share().owns), work=RunWork(cfg.task))
        if (out.output_dir / SUCCESS).exists():
            return _already_done(cfg, out, summary)
        summary.rows_already_committed = summary.totals.rows
        resumed = find_resumed(cfg, out.committer, out.shown, summary.totals, driver.samples_per_row)
        progress = Progress(cfg, out.committer, driver.total_rows, summary.totals, stop, resumed=resumed)
        try:
            driven = driver.drive(out, summary, progress)
            _fill(summary, cfg, driven, out.committer, started)
            summary.state = _finish(cfg, out.committer, driven)
            progress.close(summary.state, driven.rows)
            summary.work = progress.last_work  # the figure the final status recorded
        except BaseException as exc:
            summary.state = "failed" if isinstance(exc, Exception) else "stopped"
            progress.close(summary.state, None, error=str(exc))
            raise
        finally:
            driver.close()
            if out.remote:
                out.remote.push(status_name(cfg.run.shard, cfg.run.num_shards))
        summary.wall_s = time.perf_counter() - started
        return summary


def _already_done(cfg: JobConfig, out: JobOutput, summary: Summary) -> Summary:
    log.info("%s is already complete; nothing to do", out.output_dir)
    if cfg.output.format == "openai_batch" and not out.remote and not (out.output_dir / RESULTS).exists():
        write_derived(cfg, out.output_dir)  # written by a batchgen that wrote it after _SUCCESS, then killed
    summary.state = "already_done"
    return summary


def _fill(summary: Summary, cfg: JobConfig, driven: Driven, committer: Committer, started: float) -> None:
    """The summary's figures from what the driver, its engine and the table output report."""
    summary.load_s = driven.loaded.at - started
    summary.numerics = numerics_said(driven.loaded.identity)
    summary.token_source = tokens_said(cfg.engine)
    summary.lookahead_parts, summary.max_parts_in_flight = driven.lookahead_parts, driven.max_parts_in_flight
    summary.duplicate_ids = driven.duplicate_ids
    summary.rows_read, summary.rows_typed = driven.rows_read, driven.rows_typed
    summary.prefix_tokens_reused = driven.engine.prefix_tokens_reused
    summary.kv_cache = kv_cache_said(driven.engine)
    summary.cache = driven.engine.response_cache
    if committer.sink is not None:
        summary.table, summary.table_commits = committer.sink.describe(), committer.sink.commits
        summary.table_commit_s = committer.sink.commit_s
    summary.log_internals()


def _finish(cfg: JobConfig, committer: Committer, driven: Driven) -> str:
    """Commit an empty input's part, refuse a shard with parts missing, write the derived files and _SUCCESS once
    every part exists: the run's state (done, or partial while other shards' parts are missing)."""
    if driven.rows == 0 and cfg.run.shard in (0, None):
        committer.write_empty()
    total = max(driven.parts, 1 if driven.rows == 0 else 0)
    done = committer.committed()  # one listing (on object storage, one request), not one per part
    mine = cfg.share().owns
    missing = [k for k in range(total) if mine(k) and k not in done]
    if missing:  # the engine returned with parts of this shard unfinished: never "partial" with exit 0
        raise BatchgenError(f"parts {', '.join(map(str, missing[:10]))} of this shard were not committed although "
                            f"the engine finished; their journaled samples are kept: rerun to resume")
    complete = committer.finish(total, before_success=partial(write_derived, cfg, committer.output_dir))
    return "done" if complete else "partial"


def write_derived(cfg: JobConfig, output_dir: Path) -> None:
    """The files made from a complete output, written before its _SUCCESS (so a complete output always has them):
    the OpenAI batch results file, and for a retry's attempt its job's results file, from the latest attempts."""
    if cfg.output.format != "openai_batch" or is_remote(cfg.output_dir):
        return
    log.info("OpenAI batch results: %s", write_if_wanted(output_dir))
    if cfg.run.attempt:
        log.info("OpenAI batch results rewritten from the latest attempts: %s",
                 write_if_wanted(output_dir.parent.parent))  # _attempts/attempt-NNN/ -> the job's output_dir


def kv_cache_said(stats: EngineStats) -> str:
    """The engine's KV cache as the summary says it: slots, positions, bytes ("" where there is none)."""
    if not stats.kv_slots:
        return ""
    return (f"{stats.kv_slots} slots x {stats.kv_positions} positions, {stats.kv_cache_bytes / 1e9:.2f} GB "
            f"(keys and values)")
