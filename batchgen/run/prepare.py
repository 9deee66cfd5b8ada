"""The one set-up of a job, shared by every way of running it (the local runner, the Ray driver and its workers,
`batchgen plan`): its input side opened and checked (`open_input`, before anything is written or a model loads),
its output directory locked, checked against the manifest and given a committer (`open_output`), and its engine
behind the response cache (`open_engine`). Returns typed records; knows the reader, the renderer and output_dir's
files, and engines only by their registry."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from batchgen.engines.base import Engine
from batchgen.job import JobConfig
from batchgen.output.committer import Committer, writing
from batchgen.output.heartbeat import status_name
from batchgen.output.input_index import load_input_index
from batchgen.output.ledger.existing import Existing
from batchgen.output.lock import OutputLock
from batchgen.output.manifest import MANIFEST, config_hash, file_metadata, job_id, model_identity, read_manifest
from batchgen.output.outdir import prepare_output_dir
from batchgen.output.remote import RemoteCommitter, RemoteOutput, is_remote
from batchgen.output.rows.decide import question_names as decide_names
from batchgen.output.rows.schema import optional_columns
from batchgen.output.tables import open_sink
from batchgen.output.trust import refuse_links
from batchgen.prompts.render import Renderer, RenderRow
from batchgen.reader import Reader, open_reader
from batchgen.run.preflight import check_columns, load_tokenizer, old_passthrough


@dataclass(slots=True)
class JobInput:
    """A job's input side, opened and checked."""

    reader: Reader
    tokenizer: Any
    renderer: Renderer
    passthrough: list[str]  # input columns copied into every output row of a new output
    existing: Optional[Existing]  # run.skip_existing's generated ids, or None
    old_passthrough: Optional[list[str]] = None  # an output started before passthrough carried every input column


def open_input(cfg: JobConfig, index_dir: Path, render_row: Optional[RenderRow] = None, *,
               skip_existing: bool = True, chat_template: Optional[str] = None) -> JobInput:
    """Every way of running a job starts here, before anything is written or a model loads:
    1. open the input (the reader streams it; nothing is read whole)
    2. take a JSONL input's index (types, part marks) from index_dir where one was saved for this input
    3. load the tokenizer (a chat template that does not load stops here)
    4. build the renderer and check every column the config names
    5. read run.skip_existing's chain (refused here if it does not fit), unless the caller does not generate
    chat_template: dataset.chat_template's text as the caller holds it (a Ray worker: the driver's), not read again"""
    reader = open_reader(cfg.dataset, part_size=cfg.rows_per_part)
    load_input_index(index_dir, reader)
    tokenizer = load_tokenizer(cfg)
    renderer = Renderer(cfg.dataset, tokenizer, render_row, chat_template=chat_template)
    passthrough = check_columns(cfg, reader, renderer)
    existing = Existing(cfg.run.skip_existing, cfg) if skip_existing and cfg.run.skip_existing else None
    return JobInput(reader, tokenizer, renderer, passthrough, existing, old_passthrough(cfg, reader, renderer))


class HeldEngine:
    """A job's engine kept loaded across its runs (batchgen.Session): the first run's open_engine builds it, the
    later runs get the same one; a run never closes it, its holder does (close)."""

    def __init__(self) -> None:
        self.engine: Optional[Engine] = None  # as built, before each run's response cache

    def get(self, cfg: JobConfig, tokenizer: Any) -> Engine:
        if self.engine is None:
            from batchgen.engines import build_engine, task_engine

            self.engine = build_engine(task_engine(cfg), tokenizer)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine, engine = None, self.engine
            engine.close()


def open_engine(cfg: JobConfig, tokenizer: Any, held: Optional[HeldEngine] = None) -> Engine:
    """The job's engine for its task, behind the response cache where run.dedupe or run.cache_dir is on: the one
    engine set-up of a local run and of a Ray worker; `held`'s engine where given (loaded by its first run)."""
    from batchgen.engines import build_engine, task_engine
    from batchgen.run import respcache

    model = model_identity(cfg.engine.model, cfg.engine.tokenizer)
    if held is not None:
        return respcache.wrap(held.get(cfg, tokenizer), cfg, model)
    return respcache.wrap(build_engine(task_engine(cfg), tokenizer), cfg, model)


def kept_passthrough(output_dir: Path, job: JobInput) -> list[str]:
    """The input columns this output's parts carry: those its manifest recorded when it was started; for an output
    started before manifests recorded them, the default of its time (job.old_passthrough), so that a resume never
    mixes parts of two column sets. Call once the manifest is checked or written."""
    recorded = (read_manifest(output_dir) or {}).get("passthrough")
    if isinstance(recorded, list):
        return [str(name) for name in recorded]
    return job.passthrough if job.old_passthrough is None else job.old_passthrough


@dataclass(slots=True)
class JobOutput:
    """A job's output directory, locked for its shard and checked against the manifest."""

    output_dir: Path  # where parts are committed: output_dir, or the local staging of an object-storage output
    shown: Any  # what the summary names: output_dir, or the URL
    remote: Optional[RemoteOutput]  # object storage, else None
    lock: OutputLock  # this shard's, held while the JobOutput is open
    committer: Committer


def output_place(cfg: JobConfig) -> tuple[Path, Optional[RemoteOutput]]:
    """Where the job's files live on this machine: output_dir, or an object-storage output's staging directory."""
    remote = RemoteOutput(cfg.output_dir) if is_remote(cfg.output_dir) else None
    return (remote.staging if remote else Path(cfg.output_dir)), remote


@contextlib.contextmanager
def open_output(cfg: JobConfig, job: JobInput, resolved: Optional[dict[str, Any]]) -> Iterator[JobOutput]:
    """The output directory, for this shard (run.shard of run.num_shards):
    1. make it; refuse a symlink among the names batchgen writes there
    2. take this shard's lock (a second writer, or a live writer of another sharding, is refused)
    3. under the layout lock: bring an object-storage output's manifest down, check or write the manifest (a stray
       file or another job's output refused), push it up, then upload the parts a killed run staged
    4. a committer, and what a killed run of this shard left behind removed"""
    output_dir, remote = output_place(cfg)
    with writing(output_dir):
        output_dir.mkdir(parents=True, exist_ok=True)
    refuse_links(output_dir)
    lock = OutputLock.for_shard(output_dir, cfg.run.shard, cfg.run.num_shards)
    with lock:
        with lock.layout():
            if remote:
                remote.pull()
            prepare_output_dir(cfg, output_dir, job.reader, resolved or {}, job.passthrough)
            digest = config_hash(cfg)
            if remote:
                remote.push(MANIFEST)
                remote.reconcile(digest)  # only now: a staged part goes up once the manifest matched
            metadata = file_metadata(digest, model_identity(cfg.engine.model, cfg.engine.tokenizer))
            committer = make_committer(cfg, output_dir, kept_passthrough(output_dir, job), metadata, remote)
        mine = (status_name(cfg.run.shard, cfg.run.num_shards),)  # the shard's own status file's temp copies
        committer.clean_stale(cfg.share().owns, mine)
        if committer.sink is not None:
            _reconcile_table(cfg, output_dir, committer)
        yield JobOutput(output_dir, remote.url if remote else output_dir, remote, lock, committer)


def make_committer(cfg: JobConfig, output_dir: Path, passthrough: list[str], metadata: dict[str, str],
                   remote: Optional[RemoteOutput] = None, exclusive: bool = False) -> Committer:
    """The job's committer over output_dir (or an object-storage output's staging), with what the config adds to
    each part: optional columns, prices, decide's questions, the table output (its job id from the manifest).
    exclusive: the first writer of a part wins (Ray workers)."""
    kwargs = {"passthrough": passthrough, "metadata": metadata, "attempt": cfg.run.attempt,
              "optional": optional_columns(cfg.sampling, cfg.dataset, cfg.output, cfg.task),
              "prices": cfg.output.priced(), "questions": decide_names(cfg.task, cfg.decide), "exclusive": exclusive,
              "sink": open_sink(cfg.output, job_id(output_dir)) if cfg.output.sink != "parquet" else None}
    return RemoteCommitter(remote, **kwargs) if remote else Committer(output_dir, **kwargs)


def _reconcile_table(cfg: JobConfig, output_dir: Path, committer: Committer) -> None:
    """A table output: read which parts of this output the table holds (a resume skips them, whichever machine
    committed them), then commit this shard's parts that output_dir holds and the table lacks (a run killed between
    the part's write and its table commit)."""
    parts = (read_manifest(output_dir) or {}).get("parts") or 0
    committer.sink.refresh(range(parts))
    lacking = committer.committed() - committer.sink.known
    mine = cfg.share().owns
    committer.sink.reconcile([k for k in lacking if mine(k)], committer.read_part,
                             cfg.run.attempt)
