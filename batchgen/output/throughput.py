"""A run's one throughput figure, defined once: what the run did per second of generation, its time after the
engine was ready (start-up and model load excluded). The summary, the status heartbeat (so `batchgen status`) and
`batchgen report` all say it through `throughput`, from the same record (RunWork). A generating task counts
generated tokens; a scoring task (task=loglik, decide, embed), which generates nothing, counts rows and the prompt
tokens it scored. Knows counts and seconds, not engines or files."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

SCORING_TASKS = ("loglik", "decide", "embed")  # tasks that generate nothing: their rate is rows and prompt tokens


@dataclass(slots=True)
class RunWork:
    """What one run did after its engine was ready (progress.Progress counts it; the heartbeat keeps it)."""

    task: str = "generate"  # the job's task (JobConfig.task)
    rows: float = 0.0  # rows this run finished: committed, or the share of a part's rows its journaled samples are
    prompt_tokens: int = 0  # prompt tokens of the samples this run finished (those a scoring task scored)
    generated_tokens: int = 0  # tokens this run generated, journaled or committed (none reused from a journal)
    generation_s: float = 0.0  # seconds since the engine was ready; 0 before it is

    @property
    def scoring(self) -> bool:
        return self.task in SCORING_TASKS

    def per_s(self, count: float) -> float:
        """`count` per second of generation (0 before the engine is ready)."""
        return count / self.generation_s if self.generation_s > 0 else 0.0

    def tokens_per_s(self) -> float:
        """The heartbeat's `tokens_per_s`: generated tokens per second of generation."""
        return self.per_s(self.generated_tokens)


def throughput(work: RunWork) -> str:
    """The figure as every report says it: `812.4 generated tok/s after load`; for a scoring task
    `40.1 rows/s, 1203.0 prompt tok/s scored after load` (a rate of generated tokens would say 0)."""
    if work.scoring:
        return (f"{work.per_s(work.rows):.1f} rows/s, {work.per_s(work.prompt_tokens):.1f} prompt tok/s scored "
                f"after load")
    return f"{work.tokens_per_s():.1f} generated tok/s after load"


def work_from(raw: Any) -> Optional[RunWork]:
    """The RunWork a status file recorded (`this_run`); None where it has none (a batchgen older than the field).
    Keys a newer batchgen added are ignored."""
    if not isinstance(raw, dict):
        return None
    known = {f.name for f in dataclasses.fields(RunWork)}
    return RunWork(**{k: v for k, v in raw.items() if k in known})
