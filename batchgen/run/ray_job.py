"""launcher=ray: one job on a Ray cluster. The driver (this process) checks the input and config, takes the output
directory's lock, writes the manifest and plans the parts; each worker is a Ray actor that loads one engine once
and runs whole parts through the same planner, journal and committer as a local run (feed.Feed).

- Pull scheduling: every free worker gets the next uncommitted part, so a slow part never holds the others up.
- Failures: a worker that dies (its actor or node, or the engine inside it that took the process down) or whose
  engine raises has its part requeued on another worker, up to launcher.max_attempts attempts. The part's journal
  keeps what the first attempt finished, so the next attempt generates only the rest. A dead actor is replaced.
- Exactly once: a worker checks that its part is not committed before it runs it, and commits first-writer-wins
  (Committer.exclusive: a hard link never replaces), so a part reported twice (a worker thought dead that was not)
  is still written once.
- The driver writes `_status.json` for the whole job, with a per-worker breakdown, and `_SUCCESS` at the end.

The input and output_dir must be reachable from every worker (a shared filesystem). Knows Ray and the job's
modules; the engines know nothing of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from batchgen.engines.base import EngineStats
from batchgen.errors import BatchgenError, ConfigError, ResumeMismatchError
from batchgen.job import JobConfig, LauncherConfig
from batchgen.output.committer import Committer
from batchgen.output.lock import OutputLock
from batchgen.output.prompt_files import changed_files, prompt_identity
from batchgen.output.rows.stats import PartStats
from batchgen.prompts.render import RenderRow
from batchgen.run import lifecycle
from batchgen.run.feed import Feed, Unreported, check_error_rate
from batchgen.run.lifecycle import Driven, Loaded
from batchgen.run.prepare import JobInput, JobOutput, kept_passthrough, make_committer, open_engine, open_input
from batchgen.run.progress import Progress, Summary
from batchgen.run.stopping import GracefulStop, Reaper, StopRequested

log = logging.getLogger(__name__)
FAIL_PART_ENV = "BATCHGEN_TEST_RAY_FAIL_PART"  # test hook only: a worker's engine raises in this part, first attempt


@dataclass(frozen=True)
class PartDone:
    """What a worker hands back for a part: its counts, and what this run of it generated or reused."""

    index: int
    stats: PartStats
    generated_tokens: int = 0
    reused_samples: int = 0  # taken from the part's journal (an earlier, failed attempt's)
    generated_samples: int = 0
    pid: int = field(default_factory=os.getpid)

    def into(self, summary: Summary) -> None:
        summary.committed(self.stats, self.generated_tokens)
        summary.took_samples(self.generated_samples, self.reused_samples)


@dataclass(frozen=True)
class PromptPin:
    """What the driver's prompts are rendered from, handed to every worker (one started mid-run included): the
    worker renders from the driver's chat template text, never reading dataset.chat_template's file again, and
    refuses to run where the model's or tokenizer's prompt files (output/prompt_files.py) are not those the driver
    read, as a resume would be refused."""

    chat_template: Optional[str]  # dataset.chat_template's text as the driver read it; None: the tokenizer's own
    files: dict[str, Any]  # prompt_identity(engine.model, engine.tokenizer) as the driver read them

    @classmethod
    def of(cls, cfg: JobConfig, job: JobInput) -> PromptPin:
        return cls(job.renderer.chat_template, prompt_identity(cfg.engine.model, cfg.engine.tokenizer))

    def refusal(self, cfg: JobConfig) -> Optional[ResumeMismatchError]:
        """Why a worker that has loaded its tokenizer and engine must not run, or None."""
        changes = changed_files(self.files, prompt_identity(cfg.engine.model, cfg.engine.tokenizer))
        if not changes:
            return None
        lines = "\n".join(f"  {c}" for c in changes)
        return ResumeMismatchError(
            f"launcher=ray: a worker on {os.uname().nodename} found other prompt files in {cfg.engine.model} than the "
            f"driver read when the run started:\n{lines}\nThe rows written so far were rendered from the driver's; "
            f"restore those files and rerun to resume, or write to a new output_dir.", changes=tuple(changes))


class PartWorker:
    """A Ray actor's body: one engine, loaded once; parts run one at a time, rendered from the driver's PromptPin."""

    def __init__(self, cfg: JobConfig, render_row: Optional[RenderRow], metadata: dict[str, str], pin: PromptPin):
        from batchgen.prompts.planner import Planner

        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        # a JSONL input: the driver's pass, saved beside output; the chat template: the driver's text
        job = open_input(cfg, self.output_dir, render_row, chat_template=pin.chat_template)
        self.committer = make_committer(cfg, self.output_dir, kept_passthrough(self.output_dir, job), dict(metadata),
                                        exclusive=True)
        self.planner = Planner(cfg, job.reader, job.renderer, job.tokenizer, job.existing)
        self.engine = open_engine(cfg, job.tokenizer)
        self.stop = GracefulStop()  # never entered: the driver stops the job; shielded sections still nest
        self.refused = pin.refusal(cfg)  # raised by every call: the driver stops the job with it (_get)

    def identity(self) -> dict[str, Any]:
        if self.refused:
            raise self.refused
        return self.engine.identity()

    def run_part(self, index: int, attempt: int) -> PartDone:
        """Generate and commit part `index` (nothing if it is committed already); what it did."""
        if self.refused:
            raise self.refused
        if index in self.committer.committed():
            return PartDone(index, self.committer.read_stats(index))
        committed: list[tuple[PartStats, int]] = []
        self.planner.only = {index}
        summary = Summary(self.output_dir, "partial", PartStats())
        feed = Feed(self.cfg, self.planner, self.committer, Unreported(self.stop), summary,
                    max_model_len=self.engine.max_model_len,
                    lookahead=0, on_committed=lambda stats, generated: committed.append((stats, generated)))
        on_result = feed.on_result
        if os.environ.get(FAIL_PART_ENV) == str(index) and attempt == 1:
            on_result = _fail_after_first(on_result)
        try:
            self.engine.stream(feed.source, on_result)
            feed.finish()
        finally:
            feed.close()
        if not committed:
            raise BatchgenError(f"part {index}: the worker committed nothing (no such part?)")
        stats, generated = committed[0]
        return PartDone(index, stats, generated, summary.reused_samples, summary.generated_samples)


def _fail_after_first(on_result: Any) -> Any:
    """Test hook (FAIL_PART_ENV): pass the first result on (journaled), then fail as a dying engine would."""
    seen = [0]

    def hooked(result: Any) -> None:
        on_result(result)
        seen[0] += 1
        if seen[0] == 1:
            raise RuntimeError("injected engine failure (test hook BATCHGEN_TEST_RAY_FAIL_PART)")

    return hooked


def run_on_ray(cfg: JobConfig, resolved: Optional[dict[str, Any]], render_row: Optional[RenderRow]) -> Summary:
    started = time.perf_counter()
    job = open_input(cfg, Path(cfg.output_dir), render_row)  # refused here, before anything is written
    if cfg.dataset.verify == "pages" and hasattr(job.reader, "verify_pages"):
        job.reader.verify_pages()
    total_rows = job.reader.count_rows()
    if total_rows is None:
        raise ConfigError(["launcher=ray needs an input whose rows can be counted before the run (Parquet, JSONL, "
                           "a saved `datasets` directory); a streamed hub dataset is not"])
    pin = PromptPin.of(cfg, job)  # what every worker renders from
    with GracefulStop() as stop:
        driver = RayDriver(cfg, render_row, stop, total_rows, pin=pin)
        return lifecycle.run(cfg, job, resolved, stop, driver, started)


class RayDriver:
    """The Ray run's parts: a worker per launcher.num_workers, each free one handed the next uncommitted part."""

    def __init__(self, cfg: JobConfig, render_row: Optional[RenderRow], stop: GracefulStop, total_rows: int, *,
                 pin: PromptPin):
        self.cfg, self.render_row, self.stop, self.total_rows, self.pin = cfg, render_row, stop, total_rows, pin
        self.samples_per_row = cfg.sampling.n
        self.parts = -(-total_rows // cfg.rows_per_part)

    def drive(self, out: JobOutput, summary: Summary, progress: Progress) -> Driven:
        """Join launcher.address or start a local cluster (shut down when the job ends), and run the parts on it."""
        import ray

        reaper = _init_ray(self.cfg.launcher, self.stop) if not ray.is_initialized() else None
        try:
            return self._drive_workers(out.committer, summary, progress)
        finally:
            if reaper is not None:  # the cluster is this job's: its processes go with it
                ray.shutdown()
                reaper.close()

    def close(self) -> None:
        pass  # the workers (and their engines) are killed when drive() ends

    def _drive_workers(self, committer: Committer, summary: Summary, progress: Progress) -> Driven:
        """Start the workers, hand each free one the next part, requeue a failed part elsewhere, until all are in."""
        import ray

        from batchgen.output.manifest import check_engine

        cfg, stop = self.cfg, self.stop
        pool = _Pool(cfg, (self.render_row, dict(committer.metadata), self.pin), stop)
        todo = deque(k for k in range(self.parts) if k not in committer.committed())
        loaded = Loaded(_get(stop, pool.workers[0].identity.remote()), time.perf_counter())
        with OutputLock.for_shard(committer.output_dir, 0, 1).layout():
            check_engine(committer.output_dir, loaded.identity)
        progress.loaded()
        progress.engine_stats = pool.stats
        watch = _JournalWatch(cfg, committer.output_dir, progress, self.parts)
        try:
            while todo or pool.running:
                if stop.signum is not None:
                    raise StopRequested(stop.signum)
                pool.dispatch(todo)
                watch.look({k for _, k in pool.running.values()})
                ready = _wait(stop, list(pool.running))
                for ref in ready:
                    self._collect(pool, ref, todo, summary, progress, committer)
                if not ready:
                    progress.write("running")
        finally:
            for w in pool.workers:
                ray.kill(w)
        return Driven(self.parts, self.total_rows, loaded, pool.stats())

    def _collect(self, pool: _Pool, ref: Any, todo: deque[int], summary: Summary, progress: Progress,
                 committer: Committer) -> None:
        """A finished task's part into the summary and the status (a failed one is requeued by the pool)."""
        done = pool.collect(ref, todo)
        if done is None:
            return
        i, k, out = done
        out.into(summary)
        progress.committed(k, out.stats, out.generated_tokens, worker=f"ray worker {i}")
        check_error_rate(self.cfg, summary.totals, committer)


def _init_ray(launcher: LauncherConfig, stop: GracefulStop) -> Optional[Reaper]:
    """Connect to launcher.address, or start a local cluster whose processes are reaped when this driver exits,
    however it dies (a SIGKILL included: Ray's agents outlive a dead driver otherwise, re-parented to init)."""
    import ray

    reaper = Reaper().start() if not launcher.address else None
    local = {} if launcher.address else {"num_cpus": max(launcher.num_workers * launcher.num_cpus, 1)}
    with reaper.marking() if reaper else contextlib.nullcontext():
        ray.init(address=launcher.address, include_dashboard=False, log_to_driver=False, **local)
    stop.rearm()  # ray.init's SIGTERM handler exits at once (then aborts, 134): a stop journals and exits 143
    return reaper


class _Pool:
    """The Ray workers and the parts they run: which are idle, which part each runs, how often a part was tried and
    where it last failed (it is requeued elsewhere), and each worker's totals."""

    def __init__(self, cfg: JobConfig, worker_args: tuple[Optional[RenderRow], dict[str, str], PromptPin],
                 stop: GracefulStop):
        import ray

        self.cfg, self.worker_args, self.stop = cfg, worker_args, stop  # worker_args: PartWorker's after cfg
        self.actor = ray.remote(PartWorker)
        self.generation = Counter[int]()
        self.workers = [self.start(i) for i in range(cfg.launcher.num_workers)]
        self.idle = list(range(len(self.workers)))
        self.running: dict[Any, tuple[int, int]] = {}  # task ref -> (worker, part)
        self.attempts: Counter[int] = Counter()
        self.failed_on: dict[int, int] = {}
        self.per_worker = {i: {"parts": 0, "rows": 0, "failures": 0} for i in range(len(self.workers))}

    def stats(self) -> EngineStats:
        """The per-worker breakdown, as the counters that go into _status.json's "engine"."""
        return EngineStats({"workers": self.per_worker})

    def start(self, i: int) -> Any:
        """Worker i (named batchgen-worker-i, its replacements batchgen-worker-i-2, -3, ...)."""
        launcher = self.cfg.launcher
        self.generation[i] += 1
        name = f"batchgen-worker-{i}" + (f"-{self.generation[i]}" if self.generation[i] > 1 else "")
        return self.actor.options(name=name, num_cpus=launcher.num_cpus, num_gpus=launcher.num_gpus,
                                  max_restarts=0).remote(self.cfg, *self.worker_args)

    def dispatch(self, todo: deque[int]) -> None:
        """Hand each idle worker the next part, elsewhere than where that part last failed."""
        while todo and self.idle:
            k = todo.popleft()
            i = next((w for w in self.idle if w != self.failed_on.get(k)), self.idle[0])
            self.idle.remove(i)
            self.attempts[k] += 1
            self.running[self.workers[i].run_part.remote(k, self.attempts[k])] = (i, k)

    def collect(self, ref: Any, todo: deque[int]) -> Optional[tuple[int, int, PartDone]]:
        """A finished task: (worker, part, its result), or None when it failed (the part requeued, a dead worker
        replaced; too many failures of one part raise)."""
        from ray.exceptions import RayActorError, RayTaskError

        i, k = self.running.pop(ref)
        try:
            out = _get(self.stop, ref)
        except (RayActorError, RayTaskError) as exc:
            self.per_worker[i]["failures"] += 1
            if isinstance(exc, RayActorError):
                log.warning("worker %d died running part %d; starting a new one", i, k)
                self.workers[i] = self.start(i)
            _requeue(k, i, exc, self.attempts, self.failed_on, todo, self.cfg.launcher.max_attempts)
            self.idle.append(i)
            return None
        self.idle.append(i)
        self.per_worker[i]["parts"] += 1
        self.per_worker[i]["rows"] += out.stats.rows
        return i, k, out


class _JournalWatch:
    """The driver's bar per journaled sample: the workers journal into the shared output_dir, and the driver counts
    the samples in the journals of the parts in flight (at most every heartbeat), as `batchgen status` does. A
    part's samples are planned as its rows times sampling.n here (the worker knows its error rows and per-row n; the
    commit then moves the bar to the part's exact rows)."""

    def __init__(self, cfg: JobConfig, output_dir: Path, progress: Progress, parts: int):
        self.cfg, self.output_dir, self.progress, self.parts = cfg, output_dir, progress, parts
        self.seen: dict[int, int] = {}
        self.looked = 0.0

    def look(self, running: set[int]) -> None:
        from batchgen.output.journal import journal_path, read_journal

        for k in running - set(self.seen):  # a part's first run (a requeued part keeps what it counted)
            rows = self.cfg.rows_per_part if k < self.parts - 1 or not self.progress.total else (
                self.progress.total - self.cfg.rows_per_part * (self.parts - 1))
            self.progress.start_part(k, max(rows, 1) * self.cfg.sampling.n, 0, max(rows, 1))
            self.seen[k] = 0
        if time.monotonic() - self.looked < Progress.HEARTBEAT_S:
            return
        self.looked = time.monotonic()
        for k in running:
            try:
                _, results, _ = read_journal(journal_path(self.output_dir, k))
            except (OSError, ValueError):
                continue  # not written yet, or committed and removed meanwhile
            planned = self.progress.parts.get(k, {}).get("samples_planned", 0)
            new = min(len(results), planned) - self.seen[k]
            if new > 0 and k in self.progress.parts:
                made = [r for r in results[-new:] if r.answered is None]  # not run.dedupe's or cache_dir's
                self.progress.journaled(k, new, sum(r.num_generated_tokens for r in made),
                                        sum(r.num_prompt_tokens for r in made), made=len(made))
                self.seen[k] += new


def _wait(stop: GracefulStop, refs: list[Any]) -> list[Any]:
    """The refs ready within a heartbeat. A stop signal is held until Ray's wait returns (Ray runs the Python
    handler inside its C++ wait, where StopRequested would surface as a SystemError), then raised."""
    import ray

    with stop.shielded():
        ready, _ = ray.wait(refs, num_returns=1, timeout=Progress.HEARTBEAT_S)
    return ready


def _get(stop: GracefulStop, ref: Any) -> Any:
    """ray.get, a heartbeat at a time, so that a stop signal is raised within one (see _wait). A worker's refusal
    (PromptPin.refusal) is raised as itself: no other worker or attempt would render as the driver did."""
    import ray
    from ray.exceptions import RayTaskError

    while not _wait(stop, [ref]):
        pass
    with stop.shielded():
        try:
            return ray.get(ref)
        except RayTaskError as exc:
            if isinstance(exc.cause, ResumeMismatchError):
                raise exc.cause from None
            raise


def _requeue(k: int, worker: int, exc: BaseException, attempts: Counter[int], failed_on: dict[int, int],
             todo: deque[int], max_attempts: int) -> None:
    why = " ".join(str(exc).split())[-300:]
    if attempts[k] >= max_attempts:
        raise BatchgenError(f"part {k} failed {attempts[k]} times (launcher.max_attempts={max_attempts}), last on "
                            f"worker {worker}: {why}; committed parts and journaled samples are kept, rerun to resume")
    log.warning("part %d failed on worker %d (attempt %d of %d): %s; requeued", k, worker, attempts[k],
                max_attempts, why)
    failed_on[k] = worker
    todo.appendleft(k)
