"""A part's counts (PartStats): made from its output rows when it is committed, stored in its file's metadata, added
up into a run's totals. One list of fields: adding and storing derive from it."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from batchgen.constraints import INVALID
from batchgen.records import OutputRow, Part


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
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, dict(Counter(mine) + Counter(theirs)) if isinstance(mine, dict) else mine + theirs)

    def to_json(self) -> str:
        """The counts as a part's metadata holds them: cost and needs_review only where there are some (a part
        written before they existed reads the same)."""
        return json.dumps({k: v for k, v in asdict(self).items() if v or k not in SPARSE})

    @classmethod
    def from_json(cls, raw: Any) -> PartStats:
        return cls(**json.loads(raw)) if raw else cls()


SPARSE = ("cost", "needs_review")  # stored only where not zero


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
