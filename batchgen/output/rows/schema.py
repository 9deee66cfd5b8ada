"""What an output holds: its files' names (parts, their temp names, _SUCCESS) and its columns' types: the contract's
columns (docs/contract.md section 5), the optional ones a job's settings add (optional_columns), and a part's rows
laid out as an Arrow table under that schema (part_table). Knows Arrow types, not files or engines."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa

from batchgen.constraints import KINDS
from batchgen.output.rows import decide
from batchgen.records import OutputRow, Part

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
CHOICE_SCORES = pa.map_(pa.string(), pa.float64())  # label -> probability, in choice order (a map keeps it)
TOP_LOGPROB = pa.struct([pa.field("token", pa.string()), pa.field("token_id", pa.int32()),
                         pa.field("logprob", pa.float32())])
PROMPT_COLUMN = "rendered_prompt"  # output.include_prompt's; not `prompt`, the default dataset.prompt_column's name
# written only where the job asks for them (Committer.optional): a constraint adds `parsed`, choice_scores its own
OPTIONAL_FIELDS = {
    "parsed": pa.field("parsed", pa.string()),
    "choice_scores": pa.field("choice_scores", CHOICE_SCORES),
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


@dataclass(frozen=True)
class Layout:
    """The columns a job's parts have beyond the contract's: optional ones (OPTIONAL_FIELDS, in order), task=decide's
    questions, a retry's attempt number (> 0: the `attempt` column) and the input columns passed through."""

    optional: tuple[str, ...] = ()
    questions: Optional[tuple[str, ...]] = None
    attempt: int = 0
    passthrough: tuple[str, ...] = ()

    def extra_fields(self) -> list[pa.Field]:
        """The fields after the contract's that every part has, passthrough aside (their types are the input's)."""
        questions = decide.fields(list(self.questions)) if self.questions else []
        return [OPTIONAL_FIELDS[name] for name in self.optional] + questions + [ATTEMPT_FIELD] * bool(self.attempt)


def part_table(part: Part, rows: list[OutputRow], layout: Layout, metadata: dict[str, str]) -> pa.Table:
    """A part's output rows as the Arrow table its file holds: the contract's columns, the layout's, then the
    passthrough columns taken from the part's input rows."""
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
    for name in layout.optional:
        columns[name] = pa.array([getattr(r, name) for r in rows], OPTIONAL_FIELDS[name].type)
    if layout.questions:
        columns.update(decide.columns(rows, list(layout.questions)))
    if layout.attempt:
        columns["attempt"] = pa.array([layout.attempt] * len(rows), pa.int32())
    fields = OUTPUT_FIELDS + layout.extra_fields()
    if layout.passthrough:
        taken = part.table.select(list(layout.passthrough)).take(pa.array([r.row for r in rows], pa.int64()))
        for name in layout.passthrough:
            columns[name] = taken.column(name)
            fields.append(taken.schema.field(name))
    schema = pa.schema(fields, metadata=metadata)
    return pa.Table.from_arrays([columns[f.name] for f in fields], schema=schema)


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
