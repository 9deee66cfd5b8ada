"""`batchgen status OUTPUT_DIR`: a run's progress, errors, journaled work in flight and lock holder, read
from the files on disk (so it tells a killed run's state as well as a live one's). Each shard's headline counts its
committed rows (its status file's, or its parts' where a writer killed between a commit and its next heartbeat left
the status file behind them), the samples its part journals hold, and the run's throughput figure
(output/throughput.py, as the summary says it). An output on object storage
(`s3://...`) is read through fsspec: its manifest, status files and `_SUCCESS` from the bucket, its parts from the
listing, and the journals and locks from its staging directory where this is the machine that runs it
(remote.RemoteOutput); `fetch_remote` is shared with `batchgen report`.
`batchgen status ROOT`, ROOT a `batchgen increment` root (ROOT/YYYY-MM-DD): one line per night (complete, unfinished
or being written; its rows and error rows, and those after its last published retry), the nights' totals, and how
many ids their union holds (`batchgen view ROOT`) and how many of those still fail."""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from batchgen.commands.terminal import one_line
from batchgen.errors import ConfigError
from batchgen.output.heartbeat import Heartbeat, read_heartbeats, writer_is_gone
from batchgen.output.journal import read_journals
from batchgen.output.lock import live_writers
from batchgen.output.manifest import MANIFEST, parse_manifest, read_manifest
from batchgen.output.remote import RemoteOutput, is_remote
from batchgen.output.rows.schema import PART_RE, SUCCESS
from batchgen.output.rows.stats import PartStats
from batchgen.output.tables import table_line
from batchgen.output.throughput import throughput, work_from


def describe(output_dir: Path) -> str:
    """The run's state, one line per fact (a `batchgen increment` root: its nights, describe_nights); ConfigError
    where there is no run or its manifest is torn."""
    from batchgen.output.ledger.nights import is_root

    if read_manifest(output_dir) is None:
        if is_root(output_dir):
            return describe_nights(output_dir)
        raise ConfigError([f"{output_dir}: no batchgen run here (no {MANIFEST}): name a job's output_dir, or a "
                           f"batchgen increment root (its YYYY-MM-DD nights)"])
    return _describe(str(output_dir), output_dir, output_dir, len(list(output_dir.glob("part-*.parquet"))),
                     parts_here=True)


def describe_remote(url: str) -> str:
    """describe() of an output on object storage."""
    with tempfile.TemporaryDirectory(prefix="batchgen-status-") as tmp:
        remote = fetch_remote(url, Path(tmp))
        if remote is None:
            raise ConfigError([f"{url}: no batchgen run here (no {MANIFEST})"])
        local = remote.staging if remote.staging.is_dir() else None
        return _describe(remote.url, Path(tmp), local, len(remote.committed()))


def describe_nights(root: Path) -> str:
    """A `batchgen increment` root (ROOT/YYYY-MM-DD): one line per night, oldest first (its state, committed rows,
    error rows, and those after its last published retry), then the nights' totals and what their union holds (each
    id once: `batchgen view ROOT`)."""
    from batchgen.output.ledger.nights import finished, nights, union_counts

    found = nights(root)
    lines = [f"{root}: batchgen increment root, {len(found)} nights ({sum(map(finished, found))} complete)"]
    rows = before = after = retried = 0
    for night in found:
        if read_manifest(night) is None:
            lines.append(f"  {night.name}: no batchgen output (no {MANIFEST})")
            continue
        line, done, last = _night(night)
        lines.append(line)
        rows, before = rows + done.rows - done.skipped, before + done.error_rows
        after += done.error_rows if last is None else last[1]["error_rows"]
        retried += last is not None
    errors = f"error rows {after} after retries ({before} before)" if retried else f"error rows {before}"
    ids, failing = union_counts(root)
    lines.append(f"  all nights: rows {rows}, {errors}")
    lines.append(f"  their union (batchgen view {root}): {ids} ids, each once; {failing} of them erred in every "
                 f"night that has them")
    return "\n".join(lines)


def _night(night: Path) -> tuple[str, PartStats, Optional[tuple[int, dict[str, Any]]]]:
    """A night's line, its committed counts (as the job wrote them) and its last published retry (attempt, record)."""
    from batchgen.output.ledger.nights import finished

    done, totals = PartStats(), []
    for _, beat in read_heartbeats(night):
        done.add(_committed(beat, night))
        totals.append(beat.rows_total)
    writers = live_writers(night)  # a lock without its holder's note (another tool's) is named without it
    holders = "; ".join(f"pid {h['pid']} on {h.get('host', '?')} since {h.get('since', '?')}" for h in writers
                        if "pid" in h)
    said = f"rows {done.rows - done.skipped}" + (f" ({done.skipped} skipped: other nights')" if done.skipped else "")
    if finished(night):
        state = "complete"
    else:
        state = ("being written" + (f" ({holders})" if holders else "") if writers else "unfinished (no live "
                 "writer: a rerun the same night resumes it, a later night generates its rows again)")
        said += f", {done.rows}/{sum(totals) if totals and None not in totals else '?'} input rows committed"
    kinds = ", ".join(f"{k}={v}" for k, v in sorted(done.errors.items()))
    line = (f"  {night.name}: {state}: {said}, error rows {done.error_rows}" + (f" ({kinds})" if kinds else "")
            + _after_retries(night, done.error_rows) + _unpublished(night))
    return one_line(line), done, _last_published(night)


def _unpublished(output_dir: Path) -> str:
    """Where the last retry attempt is not published (unfinished, or killed while it published): how to finish it."""
    from batchgen.output.publish import published
    from batchgen.output.view import attempts

    last = attempts(output_dir)[-1]
    if not last or published(output_dir, last) is not None:
        return ""
    return f"; retry attempt-{last:03d} not finished: `batchgen retry {output_dir}` finishes it"


def fetch_remote(url: str, into: Path) -> Optional[RemoteOutput]:
    """Copy an object-storage output's manifest, status files and `_SUCCESS` into the directory `into`; None where
    the prefix holds no manifest, ConfigError (naming its URL) where it is torn."""
    remote = RemoteOutput(url)
    try:
        names = [p.rsplit("/", 1)[-1] for p in remote.fs.ls(remote.root, detail=False, refresh=True)]
    except FileNotFoundError:
        return None
    if MANIFEST not in names:
        return None
    text = remote.fs.cat(remote.key(MANIFEST))
    parse_manifest(text, f"{remote.url}/{MANIFEST}")
    (into / MANIFEST).write_bytes(text)
    for name in names:
        if name == SUCCESS or fnmatch.fnmatch(name, "_status*.json"):
            remote.fs.get_file(remote.key(name), str(into / name))
    return remote


def _describe(shown: str, files: Path, local: Optional[Path], parts: int, *, parts_here: bool = False) -> str:
    """`files`: where the manifest, status files and _SUCCESS are; `local`: where the journals and locks are (the
    output directory, or an object-storage output's staging directory; None where it is not on this machine);
    `parts_here`: whether the committed parts are in `local` too (not on object storage)."""
    journals = read_journals(local) if local else None  # None: on the machine that runs it
    shards = [_Shard.seen(path.name, beat, local if parts_here else None, journals)
              for path, beat in read_heartbeats(files)]
    lines = [f"{shown}: {'complete' if (files / SUCCESS).exists() else 'incomplete'}"
             + _after_retries(files, sum(sh.done.error_rows for sh in shards))]
    for shard in shards:
        lines += shard.lines("stopped (no live writer)" if local and writer_is_gone(local, shard.beat)
                             else shard.beat.state)
    if len(shards) > 1:  # shards: each counts its own rows out of its share
        totals = [sh.beat.rows_total for sh in shards]
        total = sum(totals) if None not in totals and len(shards) == shards[0].beat.num_shards else None
        lines.append(f"  all shards: rows {sum(sh.done.rows for sh in shards)}/{total if total is not None else '?'}"
                     f", error rows {sum(sh.done.error_rows for sh in shards)}")
    lines.append(f"  committed parts: {parts}")
    lines += _table(files)
    lines += _journal_lines(journals or {})
    lines += _attempts(files)
    if local is None:
        lines.append("  journals and locks: in the staging directory of the machine that runs it (not this one)")
        return "\n".join(lines)
    writers = live_writers(local)
    for h in writers:
        lines.append(f"  running: {h['lock']} held by pid {h.get('pid')} on {h.get('host')} since {h.get('since')}")
    if not writers:
        lines.append("  no run holds the lock")
    return "\n".join(lines)


def _table(files: Path) -> list[str]:
    """A table output (output.sink): how many of the output's parts the table holds, read from the table."""
    line = table_line(read_manifest(files) or {})
    return [f"  table: {line}"] if line else []


def _last_published(output_dir: Path) -> Optional[tuple[int, dict[str, Any]]]:
    """The last published retry attempt and its publish record (the counts after it), None where none is."""
    from batchgen.output.publish import published
    from batchgen.output.view import attempts

    done = [(a, record) for a in attempts(output_dir)[1:] if (record := published(output_dir, a))]
    return done[-1] if done else None


def _after_retries(output_dir: Path, before: int) -> str:
    """The headline's rows still failing after the last published retry (what reading the directory shows)."""
    last = _last_published(output_dir)
    if last is None:
        return ""
    a, record = last
    return (f"; after retry attempt-{a:03d}: {record['error_rows']} error rows of {record['rows']} ({before} before "
            f"retries)")


def _attempts(output_dir: Path) -> list[str]:
    """One line per `batchgen retry` attempt beside the job's parts, with the rows that still fail after it."""
    from batchgen.output.view import attempt_dir, attempts

    lines = []
    for a in attempts(output_dir)[1:]:
        here = attempt_dir(output_dir, a)
        recorded = json.loads((here / "_retry.json").read_text()) if (here / "_retry.json").exists() else {}
        state = "complete" if (here / SUCCESS).exists() else "incomplete (rerun batchgen retry to finish it)"
        overrides = one_line(" ".join(recorded.get("overrides", [])) or "none")
        lines.append(f"  {here.name}: {state}: {recorded.get('rows', '?')} rows retried "
                     f"({one_line(', '.join(recorded.get('kinds', [])))}; overrides: {overrides}), "
                     f"{len(list(here.glob('part-*.parquet')))} committed parts" + _after(output_dir, a))
    return lines


def _after(output_dir: Path, attempt: int) -> str:
    """An attempt's rows still failing once it was published; where its publish is pending, how to finish it."""
    from batchgen.output.publish import pending, published

    record = published(output_dir, attempt)
    if record is None:
        return f"; not yet published: `batchgen retry {output_dir}` publishes it" if pending(output_dir) == attempt \
            else ""
    errors = ", ".join(f"{k}={v}" for k, v in sorted(record["errors"].items()))
    return f"; {record['error_rows']} rows still fail after it" + (f" ({one_line(errors)})" if errors else "")


def _journal_lines(journals: dict[int, Any]) -> list[str]:
    """One line per part in flight: samples journaled (kept by a resume) and any torn tail (dropped by it)."""
    lines = []
    for index, (key, results, torn) in sorted(journals.items()):
        planned = f" of {key['rows'] * key['n']}" if key else ""
        tail = f", torn tail of {torn} bytes (dropped on resume)" if torn else ""
        lines.append(f"  part {index:05d} in flight: {len(results)}{planned} samples journaled{tail}")
    return lines


@dataclass(slots=True)
class _Shard:
    """One shard as status tells it: its status file, with what the files beside it show."""

    name: str  # its status file's name
    beat: Heartbeat
    done: PartStats  # committed, all runs: the status file's counts, or the parts' where they show more
    journaled: int = 0  # samples in the journals of its parts in flight (a resume keeps them)
    journaled_rows: float = 0.0  # the rows they stand for (0 where the journals are on another machine)
    journaled_tokens: int = 0  # generated tokens of those samples
    journaled_prompt_tokens: int = 0  # their prompt tokens

    @classmethod
    def seen(cls, name: str, beat: Heartbeat, part_dir: Optional[Path], journals: Optional[dict[int, Any]]
             ) -> _Shard:
        """`journals`: every part journal on this machine (read_journals), None where they are on another."""
        shard = cls(name, beat, _committed(beat, part_dir))
        if journals is None:  # the status file's count
            shard.journaled = sum(p.get("samples_journaled", 0) for p in beat.parts_in_flight)
            return shard
        planned = {p.get("index"): p.get("samples_planned") for p in beat.parts_in_flight}
        for index, (key, results, _) in journals.items():
            if index % beat.num_shards != beat.shard or not key:
                continue
            shard.journaled += len(results)
            shard.journaled_tokens += sum(r.num_generated_tokens for r in results)
            shard.journaled_prompt_tokens += sum(r.num_prompt_tokens for r in results)
            samples = planned.get(index) or key["rows"] * key["n"]
            shard.journaled_rows += min(key["rows"], key["rows"] * len(results) / max(samples, 1))
        return shard

    def lines(self, state: str) -> list[str]:
        """The headline, then what else the status file tells."""
        s = self.beat
        lines = [f"  {self.name}: {state}: {self._rows()}, error rows {self.done.error_rows} ({self._errors()}), "
                 f"{self._work()}{f', ETA {s.eta_s:.0f}s' if s.eta_s is not None and state == 'running' else ''}, "
                 f"updated {s.updated_at}"]
        if s.duplicate_ids:
            lines.append(f"    duplicate ids: {s.duplicate_ids} rows repeat an earlier row's id")
        if s.rows_skipped:
            lines.append(f"    skipped: {s.rows_skipped} rows already generated in run.skip_existing's output")
        if s.invalid_outputs:
            lines.append(f"    invalid outputs: {s.invalid_outputs} constrained samples did not parse or validate")
        if s.error:
            lines.append(f"    last error: {one_line(s.error)}")  # may quote a row or a server: escaped
        return lines

    def _rows(self) -> str:
        """`rows 3/30 (10.0%) committed + 7 samples journaled (3.5 rows: 21.7% with them)`."""
        total, rows = self.beat.rows_total, self.done.rows
        said = f"rows {rows}/{total or '?'}{f' ({100 * rows / total:.1f}%)' if total else ''} committed"
        if self.journaled:
            share = (f" ({self.journaled_rows:.1f} rows: {100 * (rows + self.journaled_rows) / total:.1f}% with them)"
                     if total and self.journaled_rows else "")
            said += f" + {self.journaled} samples journaled{share}"
        return said

    def _errors(self) -> str:
        return ", ".join(f"{one_line(k)}={v}" for k, v in sorted(self.done.errors.items())) or "none"

    def _work(self) -> str:
        """Tokens committed and journaled (never fewer than the run counted), and the run's throughput figure."""
        work = work_from(self.beat.this_run)
        if work is None:  # a status file of an older batchgen
            return (f"{self.done.generated_tokens + self.journaled_tokens} generated tokens, "
                    f"{self.beat.tokens_per_s} tok/s")
        if work.scoring:
            scored = max(self.done.prompt_tokens + self.journaled_prompt_tokens, work.prompt_tokens)
            return f"{scored} prompt tokens scored, {throughput(work)}"
        generated = max(self.done.generated_tokens + self.journaled_tokens, work.generated_tokens)
        return f"{generated} generated tokens, {throughput(work)}"


def _committed(beat: Heartbeat, part_dir: Optional[Path]) -> PartStats:
    """A shard's committed counts: its status file's, or its parts' in `part_dir` where that directory holds more of
    its parts than the status file counted (a writer killed between a commit and its next heartbeat). The parts'
    footers are read only then."""
    said = PartStats(rows=beat.rows_done, samples=beat.samples_done, errors=dict(beat.errors),
                     prompt_tokens=beat.prompt_tokens, generated_tokens=beat.generated_tokens,
                     invalid_outputs=beat.invalid_outputs, skipped=beat.rows_skipped)
    if part_dir is None:
        return said
    mine = [p for p in part_dir.iterdir() if (m := PART_RE.match(p.name)) and int(m.group(1)) % beat.num_shards
            == beat.shard]
    if beat.parts_done is not None and len(mine) <= beat.parts_done:
        return said
    seen = PartStats()
    for path in mine:
        seen.add(_part_stats(path))
    return seen if seen.rows > said.rows else said


def _part_stats(path: Path) -> PartStats:
    """A committed part's counts from its footer (PartStats() where it cannot be read: status reports, never fails)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        raw = (pq.read_metadata(path).metadata or {}).get(b"batchgen.stats")
        return PartStats(**json.loads(raw)) if raw else PartStats()
    except (OSError, ValueError, TypeError, pa.ArrowException):
        return PartStats()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchgen status", description=__doc__)
    parser.add_argument("output_dir", help="a directory, or an fsspec URL (s3://bucket/prefix); a batchgen "
                                           "increment root lists its nights")
    where = parser.parse_args(argv).output_dir  # a batchgen increment root: its nights (describe_nights)
    try:
        print(describe_remote(where) if is_remote(where) else describe(Path(where)))
    except ConfigError as exc:  # no run, or a torn manifest: named, exit 2 (docs/contract.md section 7)
        for problem in exc.problems:
            print(f"batchgen status: error: {problem}", file=sys.stderr)
        return 2
    return 0
