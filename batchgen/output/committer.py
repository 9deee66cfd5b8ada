"""The committer: writes each part atomically under its final name, keeps progress facts on disk.

A part is committed when `part-KKKKK.parquet` exists under its final name (docs/contract.md section 6); its
key-value metadata carries the config hash, the model identity and the part's own counts, so that a
resumed run can total what was done without reading the data. The rows come from assemble.py, their layout from
schema.py, their counts from stats.py. Knows Parquet and files, not models.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import BatchgenError
from batchgen.fsutil import fsync_dir, link_durably, replace_durably
from batchgen.output.journal import JOURNAL_RE, crash_window, kill_point
from batchgen.output.rows.assemble import price
from batchgen.output.rows.schema import (
    OUTPUT_FIELDS,
    PART_RE,
    SUCCESS,
    TMP_JOURNAL_RE,
    TMP_PART_RE,
    Layout,
    part_table,
)
from batchgen.output.rows.stats import PartStats, stats_of
from batchgen.output.trust import check_part
from batchgen.records import OutputRow, Part

log = logging.getLogger(__name__)


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


def write_atomically(final: Path, write: Callable[[Any], None], exclusive: bool = False) -> None:
    """A file that appears whole or not at all: `write(f)` into a temp name beside `final`, fsynced, then renamed
    over it (or, `exclusive`, linked: the first writer wins and a file already there is never replaced). A failed
    write leaves no temp file and raises OutputWriteError naming `final`."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        with writing(final), open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            crash_window("file written under its temp name")
            (link_durably if exclusive else replace_durably)(tmp, final)
    except OutputWriteError:
        tmp.unlink(missing_ok=True)
        raise


class Committer:
    def __init__(self, output_dir: Path, *, passthrough: list[str], metadata: dict[str, str],
                 optional: tuple[str, ...] = (), attempt: int = 0, prices: Any = None,
                 questions: Optional[list[str]] = None, exclusive: bool = False, sink: Any = None):
        """passthrough: the input columns copied; metadata: every file's key-value metadata (config hash, model
        identity); optional: the OPTIONAL_FIELDS this job writes; attempt > 0: a retry's parts (the `attempt`
        column); prices: output.prices (each sample's cost written); questions: task=decide's (a column each, and
        needs_review); exclusive: the first writer wins (a part another worker committed is never replaced); sink:
        output.sink's table (output/tables/), each committed part also one transaction of it."""
        self.output_dir = output_dir
        self.layout = Layout(tuple(optional), tuple(questions) if questions else None, attempt, tuple(passthrough))
        self.prices = prices
        self.exclusive = exclusive
        self.metadata = metadata
        self.sink = sink

    @property
    def attempt(self) -> int:
        return self.layout.attempt

    @property
    def passthrough(self) -> list[str]:
        return list(self.layout.passthrough)

    @property
    def optional(self) -> tuple[str, ...]:
        return self.layout.optional

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

    def totals(self, owned: Callable[[int], bool]) -> PartStats:
        """What is committed so far of the parts `owned` answers for (a shard's, so that shards' totals add up)."""
        totals = PartStats()
        for k in sorted(self.committed()):
            if owned(k):
                totals.add(self.read_stats(k))
        return totals

    def read_part(self, index: int) -> pa.Table:
        return pq.read_table(self.part_path(index))  # with its metadata: a table output's reconcile commits from here

    def stats_from(self, path: Any, meta: Optional[dict[bytes, bytes]], index: int) -> PartStats:
        check_part(path, meta, index, self.metadata.get("batchgen.config_hash", ""))
        return PartStats.from_json((meta or {}).get(b"batchgen.stats"))

    def commit(self, part: Part, rows: list[OutputRow]) -> PartStats:
        """Write the part under a temp name, fsync, then rename: never a torn file under a final name."""
        if self.prices is not None:
            price(rows, self.prices)
        stats = stats_of(part, rows)
        meta = self.metadata | {"batchgen.part": str(part.index), "batchgen.stats": stats.to_json()}
        table = part_table(part, rows, self.layout, meta)
        write_atomically(self.part_path(part.index), lambda f: pq.write_table(table, f, compression="zstd"),
                         self.exclusive)
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

    def write_empty(self, schema_fields: Optional[list[pa.Field]] = None) -> None:
        """An empty dataset still yields a readable result: one part with the schema and no rows. It has no row
        group at all (an empty row group makes `datasets.load_dataset("parquet")` fail on a batch size of 0)."""
        schema = pa.schema(OUTPUT_FIELDS + self.layout.extra_fields() + (schema_fields or []),
                           metadata=self.metadata | {"batchgen.part": "0"})
        write_atomically(self.part_path(0), lambda f: pq.ParquetWriter(f, schema).close())
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
