"""Parts in flight: the job's side of the streaming seam between the planner, the engine and the committer.

A part is the unit of commit, not of scheduling. The engine pulls requests through `Feed.source` whenever it
has room; a part is opened (planned, its journal reopened and the samples it holds reused) while fewer than
1 + `lookahead` parts are in flight, and its requests go to the engine under keys unique across parts. Each
result is routed back to its part and journaled at once; a part is assembled and committed the moment its
last sample is in, in whatever order parts finish, and its journal then removed. So the engine's batch stays
full across part boundaries while every part keeps the exactly-once rules of docs/contract.md section 6.

Memory: at most 1 + lookahead parts are held (their input rows, token ids and results), beside the reader's
one batch. Knows parts, journals and requests; not models, files' formats or Hydra.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

from batchgen.constraints import INVALID
from batchgen.errors import BatchgenError, ErrorRateExceeded
from batchgen.job import JobConfig
from batchgen.output.committer import Committer, writing
from batchgen.output.journal import Journal, crash_window, journal_key, journal_path, kill_point
from batchgen.output.rows.assemble import assemble
from batchgen.output.rows.stats import PartStats, error_kind
from batchgen.prompts.planner import Planner
from batchgen.records import Part, PlannedPart, Request, Result
from batchgen.redact import redact_text, remember_secrets
from batchgen.run.progress import Summary
from batchgen.run.stopping import GracefulStop

MAX_LOOKAHEAD = 64  # parts; an automatic look-ahead never exceeds it
# An automatic look-ahead holds this many engine batches of samples beyond the oldest part in flight. The oldest part
# can only commit once its last rows have run their whole max_new_tokens, and until it does no further part opens:
# the other parts in flight must keep every slot busy through that tail. Measured with benchmarks/parts.py (hf, 64
# slots, parts of 32 rows, per-row caps 16-128): 2 batches kept 72% of the slots busy against 87% for the whole input
# as one part, 4 batches 84%, 8 batches 87%.
LOOKAHEAD_BATCHES = 8


def auto_lookahead(batch_slots: int, rows_per_part: int, n: int) -> int:
    """Parts beyond the oldest in flight that together hold LOOKAHEAD_BATCHES of the engine's batches."""
    return max(1, min(MAX_LOOKAHEAD, math.ceil(LOOKAHEAD_BATCHES * batch_slots / (rows_per_part * n))))


class PartProgress(Protocol):
    """What the feed tells about parts (run.progress.Progress: the bar, the status file, the history)."""

    stop: GracefulStop  # its shielded() keeps a stop signal out of a journal append or a commit

    def start_part(self, index: int, planned: int, reused: int, rows: int = 0) -> None: ...

    def journaled(self, index: int, count: int, tokens: int = 0, prompt_tokens: int = 0,
                  made: Optional[int] = None) -> None: ...

    def committed(self, index: int, stats: PartStats, generated_tokens: int) -> None: ...


@dataclass
class Unreported:
    """A PartProgress that reports nothing: a Ray worker's, whose driver keeps the job's status from the parts'
    stats the worker returns."""

    stop: GracefulStop

    def start_part(self, index: int, planned: int, reused: int, rows: int = 0) -> None:
        pass

    def journaled(self, index: int, count: int, tokens: int = 0, prompt_tokens: int = 0,
                  made: Optional[int] = None) -> None:
        pass

    def committed(self, index: int, stats: PartStats, generated_tokens: int) -> None:
        pass


@dataclass
class OpenPart:
    planned: PlannedPart
    journal: Journal
    path: Path
    results: list[Result]  # journaled by an earlier run or by this one, keys local to the part
    left: int  # samples not yet finished
    generated_tokens: int = 0  # by this run
    beams: dict[int, list[Result]] = field(default_factory=dict)  # beam search: a row's hypotheses until all are in


class Feed:
    def __init__(self, cfg: JobConfig, planner: Planner, committer: Committer, progress: PartProgress,
                 summary: Summary, *, max_model_len: int, lookahead: int,
                 on_committed: Callable[[PartStats, int], None]):
        self.cfg = cfg
        self.planner = planner
        self.committer = committer
        self.progress = progress
        self.summary = summary
        self.max_model_len = max_model_len
        if cfg.task == "decide":
            planner.check_answers(max_model_len)  # an answer too long for any row: exit 2 now, not every row too_long
        self.lookahead = lookahead
        self.on_committed = on_committed  # (part stats, tokens this run generated for it): totals, error rate
        self.config_hash = committer.metadata["batchgen.config_hash"]  # the journals' key: the parts' own
        self.parts = planner.parts(skip=committer.committed())
        self.open: dict[int, OpenPart] = {}  # part index -> in flight
        self.routes: dict[int, tuple[OpenPart, int, int]] = {}  # engine key -> (part, key within it, beam count)
        remember_secrets(dataclasses.asdict(cfg))  # a Ray worker's too: its rows' errors masked with the job's secrets
        self.keys = itertools.count()
        self.exhausted = False
        self.max_in_flight = 0  # the most parts held at once, for the look-ahead's memory figure
        self.failure: Optional[Exception] = None  # what stopped the supply early (see source)

    def source(self) -> Optional[list[Request]]:
        """The engine's supply (engines.base.Source): the next part's requests, [] while the look-ahead is full,
        None once every part has been given. A part that cannot be read or planned (run.on_bad_row=fail,
        run.too_long=fail, an input error) ends the supply: the parts before it still finish and commit, then
        `finish` raises. A failing commit (a full disk, the error rate exceeded) raises at once."""
        while not self.exhausted:
            if len(self.open) > self.lookahead:
                return []
            try:
                part = next(self.parts, None)
                planned = self._plan(part) if part is not None else None
            except Exception as exc:  # noqa: BLE001 - raised again by finish(), once the parts in flight are in
                self.failure = exc
                part = planned = None
            if part is None or planned is None:
                self.exhausted = True
                break
            todo = self._open(planned)  # a commit here (nothing left to generate) raises as any commit does
            if todo:
                return todo
        return None

    def finish(self) -> None:
        """After the engine has returned: raise what stopped the supply, if anything did."""
        if self.failure is not None:
            raise self.failure

    def on_result(self, result: Result) -> None:
        """Journal the result in its part; commit the part once its last sample is in. A beam search row's
        hypotheses are journaled together, once the last of them is in: a row is in the journal whole or not at
        all, so a resume never asks the engine for part of a row's beams."""
        op, key, beams = self.routes.pop(result.key)
        error = None if result.error is None else redact_text(result.error)  # a server's text may echo a credential
        result = dataclasses.replace(result, key=key, error=error)
        done = [result]
        if beams > 1:
            row = op.beams.setdefault(key // op.planned.n, [])
            row.append(result)
            if len(row) < beams:
                return
            done = op.beams.pop(key // op.planned.n)
        with self.progress.stop.shielded(), writing(op.path):
            op.journal.append_all(done)
            kill_point("samples journaled")
        made = [r for r in done if r.answered is None]  # not a duplicate's or run.cache_dir's answer: the engine's
        tokens = sum(r.num_generated_tokens for r in made)
        self.progress.journaled(op.planned.part.index, len(done), tokens, sum(r.num_prompt_tokens for r in made),
                                made=len(made))
        self.summary.took_samples(generated=len(made))
        op.results += done
        op.generated_tokens += tokens
        op.left -= len(done)
        if op.left == 0:
            self._commit(op)

    def close(self) -> None:
        """Close the journals of parts still in flight (a stop or a failure): they stay on disk for the resume."""
        for op in self.open.values():
            op.journal.close()
        self.open.clear()

    def _plan(self, part: Part) -> PlannedPart:
        planned = self.planner.plan(part, self.max_model_len)
        _check_bad_rows(self.cfg, planned.errors, part.ids)
        return planned

    def _open(self, planned: PlannedPart) -> list[Request]:
        part = planned.part
        key = journal_key(part=part.index, first_row=part.start, ids=part.ids, config_hash=self.config_hash,
                          n=self.cfg.sampling.n)
        path = journal_path(self.committer.output_dir, part.index)
        with writing(path):
            journal, results = Journal.open(path, key, valid_keys={r.key for r in planned.requests})
        results = _whole_beam_rows(planned, results)
        self.summary.took_samples(reused=len(results))
        reused = {r.key for r in results}
        todo = [r for r in planned.requests if r.key not in reused]
        op = OpenPart(planned, journal, path, results, left=len(todo))
        self.open[part.index] = op
        self.max_in_flight = max(self.max_in_flight, len(self.open))
        self.progress.start_part(part.index, len(planned.requests), len(results), len(part.ids))
        if not todo:  # every sample journaled already (or only error rows): commit now
            self._commit(op)
            return []
        given = []
        for request in todo:
            engine_key = next(self.keys)
            self.routes[engine_key] = (op, request.key, request.params.beam_count if request.params.num_beams > 1
                                       else 1)
            given.append(dataclasses.replace(request, key=engine_key))
        return given

    def _commit(self, op: OpenPart) -> None:
        """Assemble and commit the part, then drop its journal (in that order: a crash in between leaves a journal
        that the next run removes)."""
        part = op.planned.part
        rows = assemble(op.planned, op.results)
        for row in rows if op.planned.prompts is not None else ():  # output.include_prompt
            row.rendered_prompt = op.planned.prompts[row.row]
        with self.progress.stop.shielded():
            stats = self.committer.commit(part, rows)
            crash_window("part committed, journal not yet removed")
            with writing(op.path):
                op.journal.remove()
            kill_point("part committed")  # test hook: the status file not yet told (`batchgen status` reads the parts)
        del self.open[part.index]
        self.progress.committed(part.index, stats, op.generated_tokens)
        self.on_committed(stats, op.generated_tokens)


def _whole_beam_rows(planned: PlannedPart, results: list[Result]) -> list[Result]:
    """The journaled results without a beam search row's hypotheses where not all of them are there (a journal
    cut inside a row by a power loss, or written by a batchgen that journaled beams one by one): such a row is
    generated again whole, since beam search cannot produce some of a row's hypotheses alone."""
    beams = {r.key // planned.n: r.params.beam_count for r in planned.requests if r.params.num_beams > 1}
    if not beams:
        return results
    have: dict[int, int] = {}
    for r in results:
        have[r.key // planned.n] = have.get(r.key // planned.n, 0) + 1
    partial = {row for row, count in have.items() if row in beams and count < beams[row]}
    return [r for r in results if r.key // planned.n not in partial]


def _check_bad_rows(cfg: JobConfig, errors: list[Optional[str]], ids: list[str]) -> None:
    if cfg.run.on_bad_row == "fail":
        bad = next((i for i, e in enumerate(errors) if e is not None), None)
        if bad is not None:
            raise BatchgenError(f"row {ids[bad]}: {errors[bad]} (run.on_bad_row=fail; set run.on_bad_row=record "
                                "to write error rows and go on)")


RUNTIME_KINDS = ("endpoint_rejected", "endpoint_finish", "endpoint_failed", "unreadable")  # a server's or a
# file system's answer at the time, which another run may not get; every other error kind is the row's own input
# read through the job's config (its value, template, per-row setting or length), the same on every run
SHOWN_ERRORS = 5  # error rows named when the job stops on run.max_error_rate


def check_error_rate(cfg: JobConfig, totals: PartStats, committer: Committer) -> None:
    """Stop the job (after the part just committed) when more than run.max_error_rate of its rows so far erred,
    naming the first error rows committed. Where every error is the input's own, a rerun would stop the same way:
    the error says so (ErrorRateExceeded.resumable False) rather than offering the rerun."""
    if not totals.rows or totals.error_rows / totals.rows <= cfg.run.max_error_rate:
        return
    kinds = ", ".join(f"{k}={v}" for k, v in sorted(totals.errors.items()))
    first = "; ".join(f"row {row_id}: {error}" for row_id, error in first_errors(committer, SHOWN_ERRORS))
    said = (f"{totals.error_rows} of {totals.rows} rows so far recorded errors ({kinds}), more than "
            f"run.max_error_rate={cfg.run.max_error_rate}. The first: {first}")
    if any(kind in RUNTIME_KINDS for kind in totals.errors):
        raise ErrorRateExceeded(f"{said}; fix the input or template, or raise run.max_error_rate")
    raise ErrorRateExceeded(
        f"{said}. These are errors of the input rows themselves: rerunning the same command will stop the same "
        f"way. Fix these rows in the input (or the template or setting their error names), or set "
        f"run.max_error_rate=1 to keep them as error rows and go on", resumable=False)


def first_errors(committer: Committer, limit: int) -> list[tuple[str, str]]:
    """(id, error) of the first `limit` rows that erred on their input, in part order, from the committed parts
    this output directory holds (invalid outputs are the model's, not the row's: left out)."""
    import pyarrow.parquet as pq

    found: list[tuple[str, str]] = []
    for k in sorted(committer.committed()):
        path = committer.part_path(k)
        if len(found) >= limit or not path.exists() or not committer.read_stats(k).error_rows:
            continue
        for row in pq.read_table(path, columns=["id", "sample_index", "error"]).to_pylist():
            if row["error"] is not None and row["sample_index"] == 0 and error_kind(row["error"]) != INVALID:
                found.append((row["id"], row["error"]))
    return found[:limit]
