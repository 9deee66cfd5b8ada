"""The job's config: the root that composes engine, dataset and sampling configs, plus run settings.

Plain dataclasses: the CLI fills them from Hydra once; nothing here imports omegaconf.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from batchgen.engines import (
    default_rows_per_part,
)
from batchgen.engines.base import EngineConfig
from batchgen.prompts.texts import escape, map_texts
from batchgen.reader import DatasetConfig
from batchgen.sampling import SamplingConfig

ON_BAD_ROW = ("record", "fail")
TOO_LONG = ("truncate_left", "skip", "fail")



# Where a job runs: `launcher=local` (this process, or one shard of an array: run.shard / run.num_shards) or
# `launcher=ray` (a driver here, one engine per Ray actor, parts pulled by free workers: run/ray_job.py).
LAUNCHERS = ("local", "ray")


@dataclass
class LauncherConfig:
    name: str = "local"  # local | ray (chosen with `launcher=ray`)
    address: Optional[str] = None  # ray: an existing cluster (`ray://host:10001`, `auto`); null: a local one
    num_workers: int = 2  # ray: actors, each loading one engine once
    num_cpus: float = 1  # ray: per worker
    num_gpus: float = 0  # ray: per worker (a GPU worker is pinned to its device by Ray's CUDA_VISIBLE_DEVICES)
    max_attempts: int = 3  # ray: a part whose worker died (or whose engine raised) is requeued, at most this often

    def problems(self) -> list[str]:
        out = []
        if self.name not in LAUNCHERS:
            out.append(f"launcher must be one of {', '.join(LAUNCHERS)} (got {self.name!r})")
        if self.num_workers < 1:
            out.append(f"launcher.num_workers must be >= 1 (got {self.num_workers})")
        if self.num_cpus < 0 or self.num_gpus < 0:
            out.append("launcher.num_cpus and launcher.num_gpus must be >= 0")
        if self.max_attempts < 1:
            out.append(f"launcher.max_attempts must be >= 1 (got {self.max_attempts})")
        if self.name == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                out.append("launcher=ray needs Ray: pip install 'batchgen[ray]'")
        return out


@dataclass
class RunConfig:
    rows_per_part: Optional[int] = None  # rows per output part (the unit of commit); null = engine default
    on_bad_row: str = "record"  # record: write an error row and go on; fail: stop the job
    too_long: str = "truncate_left"  # truncate_left | skip (error row) | fail
    resume: bool = True  # resume into an existing output_dir
    max_error_rate: float = 0.5  # stop after the current part when more rows than this erred
    # this worker's share of the parts: parts k with k % num_shards == shard; null: from a Slurm array's environment
    # (SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN of SLURM_ARRAY_TASK_COUNT), else 0 of 1
    shard: Optional[int] = None
    num_shards: Optional[int] = None
    progress: bool = True  # tqdm bar on stderr
    # parts in flight beyond the oldest one, so the engine's batch stays full across part boundaries (each part
    # still commits on its own, as soon as its last sample is in); null: 8 engine batches (feed.auto_lookahead)
    lookahead_parts: Optional[int] = None
    # an earlier output (PATH) of the same job: the ids it generated without error are skipped (nightly increments)
    skip_existing: Optional[str] = None
    # without dataset.id_column a row's id is its position `<file>:<row>`: skip_existing (and batchgen increment)
    # refuse it unless this says positions are ids (an input that only ever grows by rows appended at its end)
    skip_by_position: bool = False
    # set by `batchgen retry` (its attempt-NNN/ output): written as the `attempt` column; 0 = the job itself
    attempt: int = 0
    dedupe: bool = True  # identical greedy or seeded requests of the job are generated once (run/respcache.py)
    cache_dir: Optional[str] = None  # answers kept across runs (local or fsspec URL), keyed by a content hash


def owns(index: int, shard: int, num_shards: int) -> bool:
    """The shard rule, written once: part `index` belongs to shard `index % num_shards`."""
    return index % num_shards == shard


@dataclass(frozen=True)
class Share:
    """A worker's share of the job (JobConfig.share()): the parts k with k % num_shards == shard, rows_per_part rows
    each, handed once to whoever counts by it (the planner, the progress) instead of the whole config."""

    shard: int
    num_shards: int
    rows_per_part: int

    def owns(self, index: int) -> bool:
        return owns(index, self.shard, self.num_shards)

    def rows(self, total_rows: int) -> int:
        """This share's rows of an input of `total_rows`."""
        return shard_rows(total_rows, self.rows_per_part, self.shard, self.num_shards)

    def holds(self, first: int, end: int) -> bool:
        """Whether input rows [first, end) overlap a part of this share (a row group this shard must read)."""
        size = self.rows_per_part
        return any(self.owns(k) for k in range(first // size, (max(end, first + 1) - 1) // size + 1))


def shard_rows(total_rows: int, rows_per_part: int, shard: int, num_shards: int) -> int:
    """Rows of the parts a shard owns (index % num_shards == shard) out of total_rows: full parts, and the last
    part's remainder if it is the shard's."""
    parts = -(-total_rows // rows_per_part)
    owned = len(range(shard, parts, num_shards))
    if owned and owns(parts - 1, shard, num_shards):
        return (owned - 1) * rows_per_part + total_rows - (parts - 1) * rows_per_part
    return owned * rows_per_part


@dataclass
class Prices:
    """output.prices: per million tokens, in the currency you bill in; unset (null input and output): no cost."""

    input: Optional[float] = None  # prompt tokens
    output: Optional[float] = None  # generated tokens (reasoning included)
    cached_input: Optional[float] = None  # prompt tokens served from a prefix cache; null: the input price

    @property
    def given(self) -> bool:
        return self.input is not None or self.output is not None


@dataclass
class OutputConfig:
    # parquet: the parts only; openai_batch: also _openai_batch_output.jsonl, OpenAI's batch output format
    format: str = "parquet"
    usage: bool = False  # per-row usage columns: cached_prompt_tokens, reasoning_tokens, latency_s
    include_prompt: bool = False  # a rendered_prompt column: each row's prompt as rendered (template or chat template)
    prices: Prices = field(default_factory=Prices)  # a cost column per sample and cost totals (summary, report, plan)
    # where consumers read the result: parquet (output_dir's parts), or each committed part also made exactly one
    # transaction of a table (output/tables/): delta (deltalake) or iceberg (pyiceberg), output_dir its staging area
    sink: str = "parquet"
    table: Optional[str] = None  # delta: the table's path or URL; iceberg: namespace.table in output.catalog
    catalog: dict[str, Any] = field(default_factory=dict)  # iceberg: pyiceberg's catalog properties (type, uri, ...)
    storage_options: dict[str, str] = field(default_factory=dict)  # delta: delta-rs storage options (S3 endpoint...)
    mode: str = "append"  # append | upsert: merge on (id, sample_index), a retried or re-generated row replaces its
    schema_evolution: str = "none"  # none: a table of other columns is refused | add_columns: new columns are added

    def priced(self) -> Optional[Prices]:
        """output.prices where given, else None."""
        return self.prices if self.prices.given else None


@dataclass
class EmbedConfig:
    """task=embed: how a row's final hidden states become its embedding."""

    pooling: str = "mean"  # mean: over the row's tokens; last: the last token's state
    normalize: bool = True  # scaled to unit length (L2)


@dataclass
class Question:
    """task=decide: one question asked of every row, its prompt appended to the row's rendered prompt."""

    name: str = "???"  # its output column
    kind: str = "choice"  # predicate (yes or no) | choice (one of options) | score (levels 1..levels)
    prompt: str = ""  # appended to the row's rendered prompt, e.g. "Is this a bug report? Answer yes or no:"
    options: list[str] = field(default_factory=list)  # choice: the options; predicate: [yes, no] where empty
    levels: int = 5  # score: the answers 1..levels
    abstain_below: Optional[float] = None  # a top answer less likely than this marks the row needs_review


@dataclass
class DecideConfig:
    questions: list[Question] = field(default_factory=list)


@dataclass
class JobConfig:
    name: str = "???"
    output_dir: str = "data/outputs/${name}"
    engine: EngineConfig = field(default_factory=EngineConfig)  # validate() makes it the engine's own class
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    task: str = "generate"  # generate | loglik | embed (no generation: prompts/planner.py, engines/hf/loglik.py)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    decide: DecideConfig = field(default_factory=DecideConfig)
    # set on the config checks.validate returns, whose text keys hold their newlines (texts.py): a config validated
    # again is not unescaped twice (`\\n` stays a backslash and an n)
    texts_unescaped: ClassVar[bool] = False

    @property
    def rows_per_part(self) -> int:
        return self.run.rows_per_part or default_rows_per_part(self.engine.name)

    def map_texts(self, fn: Callable[[str], str]) -> None:
        """`fn` applied to each text key (prompts/texts.py's TEXT_KEYS), in place."""
        map_texts(self.dataset, self.sampling, self.decide.questions, fn)

    def escaped(self) -> JobConfig:
        """A copy of a validated config with its text keys written back as a config writes them (a manifest's
        config, from which `batchgen retry` builds and validates the job again)."""
        out = copy.deepcopy(self)
        out.map_texts(escape)
        out.texts_unescaped = False  # written again: validating the copy makes its newlines once more
        return out

    def share(self) -> Share:
        """This worker's share: run.shard of run.num_shards (0 of 1 where a config made in Python was never
        validated; checks.validate resolves them, from the Slurm environment too)."""
        return Share(self.run.shard or 0, self.run.num_shards or 1, self.rows_per_part)
