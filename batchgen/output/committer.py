"""The committer: restores input order, writes each part atomically, keeps progress facts on disk.

A part is committed when `part-KKKKK.parquet` exists under its final name (docs/contract.md section 6); its
key-value metadata carries the config hash, the model identity and the part's own counts, so that a
resumed run can total what was done without reading the data. Knows Parquet and files, not models.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.constraints import INVALID, KINDS, Constraint, check
from batchgen.errors import BatchgenError
from batchgen.fsutil import fsync_dir, link_durably, replace_durably
from batchgen.output import decide
from batchgen.output.journal import JOURNAL_RE, crash_window, kill_point
from batchgen.output.trust import check_part
from batchgen.records import OutputRow, Part, PlannedPart, Result

log = logging.getLogger(__name__)

OUTPUT_FIELDS = [
    pa.field("id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("generation", pa.string()),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("num_prompt_tokens", pa.int32(), nullable=False),
    pa.field("num_generated_tokens", pa.int32(), nullable=False),
    pa.field("seed", pa.int64()),
    pa.field("error", pa.string()),
]
OUTPUT_COLUMNS = tuple(f.name for f in OUTPUT_FIELDS)
CHOICE_SCORE = pa.struct([pa.field("choice", pa.string()), pa.field("score", pa.float64())])
TOP_LOGPROB = pa.struct([pa.field("token", pa.string()), pa.field("token_id", pa.int32()),
                         pa.field("logprob", pa.float32())])
PROMPT_COLUMN = "rendered_prompt"  # output.include_prompt's; not `prompt`, the default dataset.prompt_column's name
# written only where the job asks for them (Committer.optional): a constraint adds `parsed`, choice_scores its own
OPTIONAL_FIELDS = {
    "parsed": pa.field("parsed", pa.string()),
    "choice_scores": pa.field("choice_scores", pa.list_(CHOICE_SCORE)),
    "token_logprobs": pa.field("token_logprobs", pa.list_(pa.float32())),
    "top_logprobs": pa.field("top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),
    "reasoning": pa.field("reasoning", pa.string()),
    # output.usage
    "cached_prompt_tokens": pa.field("cached_prompt_tokens", pa.int32()),
    "reasoning_tokens": pa.field("reasoning_tokens", pa.int32()),
    "latency_s": pa.field("latency_s", pa.float32()),
    # output.prices
    "cost": pa.field("cost", pa.float64()),
    # task=loglik
    "loglik": pa.field("loglik", pa.float64()),
    "loglik_mean": pa.field("loglik_mean", pa.float64()),
    "perplexity": pa.field("perplexity", pa.float64()),
    "scored_tokens": pa.field("scored_tokens", pa.int32()),
    # task=embed
    "embedding": pa.field("embedding", pa.list_(pa.float32())),
    PROMPT_COLUMN: pa.field(PROMPT_COLUMN, pa.string()),  # output.include_prompt
}
LOGLIK_COLUMNS = ("loglik", "loglik_mean", "perplexity", "scored_tokens")
USAGE_COLUMNS = ("cached_prompt_tokens", "reasoning_tokens", "latency_s")
ATTEMPT_FIELD = pa.field("attempt", pa.int32(), nullable=False)  # a retry's parts only (batchgen retry)
PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")
TMP_PART_RE = re.compile(r"^\.part-(\d{5,})\.parquet\.tmp-\d+$")
TMP_JOURNAL_RE = re.compile(r"^\._part-(\d{5,})\.journal\.tmp-\d+$")  # a journal header being written
SUCCESS = "_SUCCESS"


class OutputWriteError(BatchgenError):
    """A write into output_dir failed (disk full, permission, quota); committed parts are left as they are."""

    exit_code = 1

    def __init__(self, path: Path, exc: OSError):
        self.path = path
        super().__init__(
            f"cannot write {path}: {exc.strerror or exc}; the job stopped. Committed parts are intact; "
            f"free space or fix permissions on {path.parent}, then rerun the same command to resume"
        )


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an OSError while writing `path` into an OutputWriteError naming it."""
    try:
        yield
    except OSError as exc:
        raise OutputWriteError(path, exc) from exc


@dataclass(slots=True)
class PartStats:
    """A part's counts, stored in its file metadata."""

    rows: int = 0  # input rows
    samples: int = 0  # output rows
    errors: dict[str, int] = field(default_factory=dict)  # error rows by kind (`too_long`, `empty_prompt`, ...)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    invalid_outputs: int = 0  # constrained samples whose text did not parse or validate (not input errors)
    skipped: int = 0  # input rows left out: generated in run.skip_existing's output already
    cost: float = 0.0  # output.prices: the samples' prices summed
    needs_review: int = 0  # task=decide: rows whose top answer to some question fell below its abstain_below

    @property
    def error_rows(self) -> int:
        return sum(self.errors.values())

    def add(self, other: PartStats) -> None:
        self.rows += other.rows
        self.samples += other.samples
        self.errors = dict(Counter(self.errors) + Counter(other.errors))
        self.prompt_tokens += other.prompt_tokens
        self.generated_tokens += other.generated_tokens
        self.invalid_outputs += other.invalid_outputs
        self.skipped += other.skipped
        self.cost += other.cost
        self.needs_review += other.needs_review


def assemble(planned: PlannedPart, results: list[Result]) -> list[OutputRow]:
    """A part's output rows in input order, the samples of a row consecutive, from the engine's results in any
    order (journaled ones from an earlier run included); an error row gets one row per sample. Every seed is the
    planner's (planned.seeds), so a row reads the same whichever run generated it. A constrained sample's text is
    checked here, whichever engine made it (constraints.check): `parsed` when it validates, else `invalid_output`."""
    if planned.questions is not None:
        return decide.assemble(planned, results)
    by_key = {r.key: r for r in results}
    constraints = {r.key: r.params.constraint for r in planned.requests if r.params.constraint is not None}
    part, n = planned.part, planned.n
    rows: list[OutputRow] = []
    for row in range(part.num_rows):
        if row in planned.skipped:
            continue  # generated in run.skip_existing's output already
        error = planned.errors[row]
        for s in range(n if planned.counts is None else planned.counts[row]):
            seed = planned.seeds[row * n + s]
            if error is not None:
                rows.append(OutputRow(row=row, id=part.ids[row], sample_index=s, generation=None,
                                      finish_reason="error", num_prompt_tokens=0, num_generated_tokens=0,
                                      seed=seed, error=error))
                continue
            res = by_key.pop(row * n + s, None)
            if res is None:
                raise BatchgenError(f"part {part.index}: the engine returned no result for row {part.ids[row]!r} "
                                    f"sample {s}; nothing of this part was committed, rerun to resume")
            usage = {"cached_prompt_tokens": res.cached_prompt_tokens, "reasoning_tokens": res.reasoning_tokens,
                     "latency_s": res.latency_s}
            if res.error is not None or res.loglik is not None or res.embedding is not None:
                rows.append(_ungenerated(OutputRow(row=row, id=part.ids[row], sample_index=s, generation=None,
                                                   finish_reason=res.finish_reason, seed=seed, error=res.error,
                                                   num_prompt_tokens=res.num_prompt_tokens,
                                                   num_generated_tokens=res.num_generated_tokens, **usage), res))
                continue
            constraint = constraints.get(row * n + s)
            parsed, invalid = check(constraint, res.text, res.finish_reason) if constraint else (None, None)
            rows.append(OutputRow(row=row, id=part.ids[row], sample_index=s, generation=res.text,
                                  finish_reason=res.finish_reason, num_prompt_tokens=res.num_prompt_tokens,
                                  num_generated_tokens=res.num_generated_tokens, seed=seed, error=invalid,
                                  parsed=parsed, choice_scores=_labelled(constraint, res.choice_scores),
                                  token_logprobs=res.token_logprobs, top_logprobs=_top(res.top_logprobs),
                                  reasoning=res.reasoning, **usage))
    if by_key:
        raise BatchgenError(f"part {part.index}: the engine returned results for unknown requests "
                            f"{sorted(by_key)[:5]}; nothing of this part was committed, rerun to resume")
    return rows


def optional_columns(sampling: Any, dataset: Any = None, output: Any = None, task: str = "generate"
                     ) -> tuple[str, ...]:
    """The OPTIONAL_FIELDS a job with these sampling.* (dataset.* per-row constraint, output.usage, output.prices and
    output.include_prompt) settings and this task writes."""
    constrained = any(getattr(sampling, kind, None) not in (None, "", []) for kind in KINDS) or any(
        getattr(dataset, key, None) for key in ("choice_column", "schema_column", "response_format_column"))
    logprobs = getattr(sampling, "logprobs", None) is not None
    return (("parsed",) * constrained + ("choice_scores",) * bool(getattr(sampling, "choice_scores", False))
            + ("token_logprobs", "top_logprobs") * logprobs
            + ("reasoning",) * (getattr(sampling, "reasoning", "off") != "off")
            + USAGE_COLUMNS * bool(getattr(output, "usage", False))
            + ("cost",) * (output is not None and output.priced() is not None)
            + LOGLIK_COLUMNS * (task == "loglik") + ("embedding",) * (task == "embed")
            + (PROMPT_COLUMN,) * bool(getattr(output, "include_prompt", False)))


def _top(top: Optional[list[list[list]]]) -> Optional[list[list[dict[str, Any]]]]:
    if top is None:
        return None
    return [[{"token": t, "token_id": i, "logprob": lp} for i, t, lp in position] for position in top]


def _labelled(constraint: Optional[Constraint], scores: Optional[list[float]]) -> Optional[list[dict[str, Any]]]:
    if constraint is None or scores is None:
        return None
    return [{"choice": c, "score": p} for c, p in zip(constraint.choices, scores, strict=True)]


def _ungenerated(row: OutputRow, res: Result) -> OutputRow:
    """A row the engine answered without a generation: its own error (an endpoint's refusal: finish_reason error),
    or a task=loglik or task=embed score (finish_reason scored)."""
    if res.error is not None:
        row.finish_reason = "error"
        return row
    row.seed = None
    row.embedding = res.embedding
    if res.loglik is not None:
        for name, value in loglik_columns(res.loglik).items():
            setattr(row, name, value)
    return row


def loglik_columns(loglik: list[float]) -> dict[str, Any]:
    """A task=loglik Result's [total, scored tokens] as its columns: total, per-token mean, perplexity, tokens."""
    total, count = loglik[0], int(loglik[1])
    mean = total / count if count else None
    return {"loglik": total, "loglik_mean": mean, "perplexity": None if mean is None else math.exp(-mean),
            "scored_tokens": count}


def price(rows: list[OutputRow], prices: Any) -> None:
    """Each sample's cost under output.prices (per million tokens: `input`, `cached_input` for prompt tokens the
    engine took from a prefix cache, `input` where that price is not given, and `output` for generated ones). Each
    sample is its own request (n=1, its own seed), so each carries its prompt. An input error row and a request the
    endpoint rejected cost 0; a sample the endpoint cut off (endpoint_finish) costs what it reported; a scored row
    (task=loglik, embed) its prompt. The price is that of generating the sample, whether or not this run paid it
    (a cache hit or a duplicate answered once: the summary counts those)."""
    cached_price = prices.input if prices.cached_input is None else prices.cached_input
    for r in rows:
        if r.generation is None and r.finish_reason != "scored" and not r.num_generated_tokens:
            r.cost = 0.0
            continue
        cached = r.cached_prompt_tokens or 0
        r.cost = ((r.num_prompt_tokens - cached) * prices.input + cached * cached_price
                  + r.num_generated_tokens * prices.output) / 1e6


def error_kind(error: str) -> str:
    return error.split(":", 1)[0]


def stats_of(part: Part, rows: list[OutputRow]) -> PartStats:
    """Input errors count once per row (every sample of an error row has the error); invalid outputs per sample,
    apart: they are what the model wrote, not a bad row, and run.max_error_rate does not count them."""
    kinds = [error_kind(r.error) if r.error is not None else None for r in rows]
    errors = Counter(k for r, k in zip(rows, kinds) if k is not None and k != INVALID and r.sample_index == 0)
    return PartStats(rows=part.num_rows, samples=len(rows), errors=dict(errors),
                     prompt_tokens=sum(r.num_prompt_tokens for r in rows if r.sample_index == 0),
                     generated_tokens=sum(r.num_generated_tokens for r in rows),
                     invalid_outputs=sum(k == INVALID for k in kinds),
                     skipped=part.num_rows - len({r.row for r in rows}),
                     cost=sum(r.cost or 0.0 for r in rows), needs_review=sum(bool(r.needs_review) for r in rows))


class Committer:
    def __init__(self, output_dir: Path, *, passthrough: list[str], metadata: dict[str, str],
                 optional: tuple[str, ...] = (), attempt: int = 0):
        self.output_dir = output_dir
        self.attempt = attempt  # > 0: a retry's parts, with the `attempt` column
        self.passthrough = passthrough
        self.optional = optional  # names of OPTIONAL_FIELDS this job writes, after the contract's columns
        self.prices: Any = None  # output.prices: each sample's cost is written (price())
        self.questions: Optional[list[str]] = None  # task=decide: a column per question, and needs_review
        self.exclusive = False  # first writer wins: a part already committed (by another worker) is never replaced
        self.metadata = metadata  # file key-value metadata: config hash, model identity
        self.sink: Any = None  # output.sink's table (output/tables/): each committed part also one transaction of it

    def part_path(self, index: int) -> Path:
        return self.output_dir / f"part-{index:05d}.parquet"

    def committed(self) -> set[int]:
        """Parts committed here, and a table output's parts of this output (those whose files output_dir lost)."""
        here = {int(m.group(1)) for p in self.output_dir.iterdir() if (m := PART_RE.match(p.name))}
        return here | self.sink.known if self.sink is not None else here

    def read_stats(self, index: int) -> PartStats:
        """A committed part's counts, once its metadata shows it is this job's (trust.check_part); a part only the
        table output holds, as its commit recorded them."""
        if self.sink is not None and not self.part_path(index).exists():
            return PartStats(**(self.sink.stats(index) or {}))
        return self.stats_from(self.part_path(index), pq.read_metadata(self.part_path(index)).metadata, index)

    def read_part(self, index: int) -> pa.Table:
        return pq.read_table(self.part_path(index))  # with its metadata: a table output's reconcile commits from here

    def stats_from(self, path: Any, meta: Optional[dict[bytes, bytes]], index: int) -> PartStats:
        check_part(path, meta, index, self.metadata.get("batchgen.config_hash", ""))
        raw = (meta or {}).get(b"batchgen.stats")
        return PartStats(**json.loads(raw)) if raw else PartStats()

    def commit(self, part: Part, rows: list[OutputRow]) -> PartStats:
        """Write the part under a temp name, fsync, then rename: never a torn file under a final name."""
        if self.prices is not None:
            price(rows, self.prices)
        stats = stats_of(part, rows)
        table = self._table(part, rows, stats)
        final = self.part_path(part.index)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            with writing(final), open(tmp, "wb") as f:
                pq.write_table(table, f, compression="zstd")
                f.flush()
                os.fsync(f.fileno())
                crash_window("part written under its temp name")
                if self.exclusive:
                    link_durably(tmp, final)
                else:
                    replace_durably(tmp, final)
        except OutputWriteError:
            tmp.unlink(missing_ok=True)
            raise
        self.to_table(part.index, table)
        return stats

    def to_table(self, index: int, table: pa.Table) -> None:
        """A part committed here, made one transaction of the table output (none: nothing to do)."""
        if self.sink is None:
            return
        kill_point("part committed before its table commit")
        crash_window("part committed, not yet in its table")
        self.sink.commit(index, table, self.attempt)
        kill_point("part committed to its table")

    def clean_stale(self, mine: Callable[[int], bool], own_files: tuple[str, ...] = ()) -> None:
        """Remove what a killed run of this shard left behind: temp parts and temp journals of its own parts,
        journals of committed parts, and temp copies of the files only this shard writes (`own_files`, e.g. its
        status file). Another shard's temp files are its own (docs/contract.md section 6, rule 4)."""
        done = self.committed()
        own_tmp = tuple(f".{name}.tmp-" for name in own_files)
        for p in self.output_dir.iterdir():
            tmp = TMP_PART_RE.match(p.name) or TMP_JOURNAL_RE.match(p.name)
            journal = JOURNAL_RE.match(p.name)
            if tmp and mine(int(tmp.group(1))) or journal and int(journal.group(1)) in done:
                log.info("removing %s left by an interrupted run", p.name)
                p.unlink(missing_ok=True)
            elif p.name.startswith(own_tmp):
                p.unlink(missing_ok=True)

    def _table(self, part: Part, rows: list[OutputRow], stats: PartStats) -> pa.Table:
        columns = {
            "id": pa.array([r.id for r in rows], pa.string()),
            "sample_index": pa.array([r.sample_index for r in rows], pa.int32()),
            "generation": pa.array([r.generation for r in rows], pa.string()),
            "finish_reason": pa.array([r.finish_reason for r in rows], pa.string()),
            "num_prompt_tokens": pa.array([r.num_prompt_tokens for r in rows], pa.int32()),
            "num_generated_tokens": pa.array([r.num_generated_tokens for r in rows], pa.int32()),
            "seed": pa.array([r.seed for r in rows], pa.int64()),
            "error": pa.array([r.error for r in rows], pa.string()),
        }
        fields = list(OUTPUT_FIELDS)
        if "parsed" in self.optional:
            columns["parsed"] = pa.array([r.parsed for r in rows], pa.string())
        for name in ("choice_scores", "token_logprobs", "top_logprobs", "reasoning", *USAGE_COLUMNS, "cost",
                     *LOGLIK_COLUMNS, "embedding", PROMPT_COLUMN):
            if name in self.optional:
                columns[name] = pa.array([getattr(r, name) for r in rows], OPTIONAL_FIELDS[name].type)
        fields += [OPTIONAL_FIELDS[name] for name in self.optional]
        if self.questions:
            columns.update(decide.columns(rows, self.questions))
            fields += decide.fields(self.questions)
        if self.attempt:
            columns["attempt"] = pa.array([self.attempt] * len(rows), pa.int32())
            fields.append(ATTEMPT_FIELD)
        if self.passthrough:
            taken = part.table.select(self.passthrough).take(pa.array([r.row for r in rows], pa.int64()))
            for name in self.passthrough:
                columns[name] = taken.column(name)
                fields.append(taken.schema.field(name))
        meta = self.metadata | {"batchgen.part": str(part.index), "batchgen.stats": json.dumps(_asdict(stats))}
        schema = pa.schema(fields, metadata=meta)
        return pa.Table.from_arrays([columns[f.name] for f in fields], schema=schema)

    def write_empty(self, schema_fields: Optional[list[pa.Field]] = None) -> None:
        """An empty dataset still yields a readable result: one part with the schema and no rows. It has no row
        group at all (an empty row group makes `datasets.load_dataset("parquet")` fail on a batch size of 0)."""
        optional = ([OPTIONAL_FIELDS[name] for name in self.optional]
                    + (decide.fields(self.questions) if self.questions else []) + [ATTEMPT_FIELD] * bool(self.attempt))
        schema = pa.schema(OUTPUT_FIELDS + optional + (schema_fields or []),
                           metadata=self.metadata | {"batchgen.part": "0"})
        path = self.part_path(0)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with writing(path), open(tmp, "wb") as f:
                pq.ParquetWriter(f, schema).close()
                f.flush()
                os.fsync(f.fileno())
                replace_durably(tmp, path)
        except OutputWriteError:
            tmp.unlink(missing_ok=True)
            raise
        self.to_table(0, schema.empty_table())

    def finish(self, total_parts: int, before_success: Optional[Callable[[], None]] = None) -> bool:
        """Write _SUCCESS, last, once every part exists (whichever shard finishes last): after `before_success`
        has written the files derived from the complete output."""
        done = self.committed()
        if any(k not in done for k in range(total_parts)):
            return False
        if before_success is not None:
            before_success()
        with writing(self.output_dir / SUCCESS):
            (self.output_dir / SUCCESS).write_text("")
            fsync_dir(self.output_dir)
        kill_point("output complete")
        return True


def _asdict(stats: PartStats) -> dict[str, Any]:
    """The part's counts as its metadata holds them: cost and needs_review only where there are some."""
    return {k: v for k, v in asdict(stats).items() if v or k not in ("cost", "needs_review")}
