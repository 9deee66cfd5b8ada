"""`batchgen status OUTPUT_DIR`: a run's progress, errors, journaled work in flight and lock holder, read
from the files on disk (so it tells a killed run's state as well as a live one's). An output on object storage
(`s3://...`) is read through fsspec: its manifest, status files and `_SUCCESS` from the bucket, its parts from the
listing, and the journals and locks from its staging directory where this is the machine that runs it
(remote.RemoteOutput); `fetch_remote` is shared with `batchgen report`."""

from __future__ import annotations

import argparse
import fnmatch
import sys
import tempfile
from pathlib import Path
from typing import Optional

from batchgen.errors import ConfigError
from batchgen.output.committer import SUCCESS
from batchgen.output.heartbeat import read_heartbeats, writer_is_gone
from batchgen.output.journal import JOURNAL_RE, read_journal
from batchgen.output.lock import live_writers
from batchgen.output.manifest import MANIFEST, parse_manifest, read_manifest
from batchgen.output.remote import RemoteOutput, is_remote
from batchgen.output.tables import table_line


def describe(output_dir: Path) -> str:
    """The run's state, one line per fact; ConfigError where there is no run or its manifest is torn."""
    if read_manifest(output_dir) is None:
        raise ConfigError([f"{output_dir}: no batchgen run here (no {MANIFEST})"])
    return _describe(str(output_dir), output_dir, output_dir, len(list(output_dir.glob("part-*.parquet"))))


def describe_remote(url: str) -> str:
    """describe() of an output on object storage."""
    with tempfile.TemporaryDirectory(prefix="batchgen-status-") as tmp:
        remote = fetch_remote(url, Path(tmp))
        if remote is None:
            raise ConfigError([f"{url}: no batchgen run here (no {MANIFEST})"])
        local = remote.staging if remote.staging.is_dir() else None
        return _describe(remote.url, Path(tmp), local, len(remote.committed()))


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


def _describe(shown: str, files: Path, local: Optional[Path], parts: int) -> str:
    """`files`: where the manifest, status files and _SUCCESS are; `local`: where the journals and locks are (the
    output directory, or an object-storage output's staging directory; None where it is not on this machine)."""
    lines = [f"{shown}: {'complete' if (files / SUCCESS).exists() else 'incomplete'}"]
    beats = read_heartbeats(files)
    for path, s in beats:
        state = "stopped (no live writer)" if local and writer_is_gone(local, s) else s.state
        total = s.rows_total
        pct = f" ({100 * s.rows_done / total:.1f}%)" if total else ""
        eta = f", ETA {s.eta_s:.0f}s" if s.eta_s is not None and state == "running" else ""
        errors = ", ".join(f"{k}={v}" for k, v in sorted(s.errors.items())) or "none"
        lines.append(f"  {path.name}: {state}: rows {s.rows_done}/{total if total else '?'}{pct}, "
                     f"error rows {s.rows_failed} ({errors}), {s.generated_tokens} generated "
                     f"tokens, {s.tokens_per_s} tok/s{eta}, updated {s.updated_at}")
        if s.duplicate_ids:
            lines.append(f"    duplicate ids: {s.duplicate_ids} rows repeat an earlier row's id")
        if s.rows_skipped:
            lines.append(f"    skipped: {s.rows_skipped} rows already generated in run.skip_existing's output")
        if s.invalid_outputs:
            lines.append(f"    invalid outputs: {s.invalid_outputs} constrained samples did not parse or validate")
        if s.error:
            lines.append(f"    last error: {s.error}")
    if len(beats) > 1:  # shards: each counts its own rows out of its share
        done = sum(b.rows_done for _, b in beats)
        totals = [b.rows_total for _, b in beats]
        total = sum(totals) if None not in totals and len(beats) == beats[0][1].num_shards else None
        lines.append(f"  all shards: rows {done}/{total if total is not None else '?'}, error rows "
                     f"{sum(b.rows_failed for _, b in beats)}")
    lines.append(f"  committed parts: {parts}")
    lines += _table(files)
    lines += _journals(local) if local else []
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


def _attempts(output_dir: Path) -> list[str]:
    """One line per `batchgen retry` attempt beside the job's parts."""
    import json

    from batchgen.output.view import attempt_dir, attempts

    lines = []
    for a in attempts(output_dir)[1:]:
        here = attempt_dir(output_dir, a)
        recorded = json.loads((here / "_retry.json").read_text()) if (here / "_retry.json").exists() else {}
        state = "complete" if (here / SUCCESS).exists() else "incomplete (rerun batchgen retry to finish it)"
        overrides = " ".join(recorded.get("overrides", [])) or "none"
        lines.append(f"  {here.name}: {state}: {recorded.get('rows', '?')} rows retried "
                     f"({', '.join(recorded.get('kinds', []))}; overrides: {overrides}), "
                     f"{len(list(here.glob('part-*.parquet')))} committed parts")
    return lines


def _journals(output_dir: Path) -> list[str]:
    """One line per part in flight: samples journaled (kept by a resume) and any torn tail (dropped by it)."""
    lines = []
    for path in sorted(p for p in output_dir.iterdir() if JOURNAL_RE.match(p.name)):
        try:
            key, results, torn = read_journal(path)
        except OSError:
            continue  # removed while we looked: the part was just committed
        planned = f" of {key['rows'] * key['n']}" if key else ""
        tail = f", torn tail of {torn} bytes (dropped on resume)" if torn else ""
        lines.append(f"  part {JOURNAL_RE.match(path.name).group(1)} in flight: {len(results)}{planned} samples "
                     f"journaled{tail}")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchgen status", description=__doc__)
    parser.add_argument("output_dir", help="a directory, or an fsspec URL (s3://bucket/prefix)")
    where = parser.parse_args(argv).output_dir
    try:
        print(describe_remote(where) if is_remote(where) else describe(Path(where)))
    except ConfigError as exc:  # no run, or a torn manifest: named, exit 2 (docs/contract.md section 7)
        for problem in exc.problems:
            print(f"batchgen status: error: {problem}", file=sys.stderr)
        return 2
    return 0
