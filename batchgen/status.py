"""`batchgen status OUTPUT_DIR`: a run's progress, errors, journaled work in flight and lock holder, read
from the files on disk (so it tells a killed run's state as well as a live one's)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from batchgen.committer import SUCCESS
from batchgen.journal import JOURNAL_RE, read_journal
from batchgen.lock import is_held, live_writers, lock_name


def describe(output_dir: Path) -> str:
    if not (output_dir / "_manifest.json").exists():
        return f"{output_dir}: no batchgen run here (no _manifest.json)"
    lines = [f"{output_dir}: {'complete' if (output_dir / SUCCESS).exists() else 'incomplete'}"]
    statuses = []
    for path in sorted(output_dir.glob("_status*.json")):
        try:
            s = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced, or unreadable: the other shards' lines still tell
        statuses.append(s)
        state = s.get("state")
        if state == "running" and not is_held(output_dir / lock_name(s.get("shard", 0), s.get("num_shards", 1))):
            state = "stopped (no live writer)"  # killed: its last heartbeat said running
        total = s.get("rows_total")
        pct = f" ({100 * s['rows_done'] / total:.1f}%)" if total else ""
        eta = f", ETA {s['eta_s']:.0f}s" if s.get("eta_s") is not None and state == "running" else ""
        errors = ", ".join(f"{k}={v}" for k, v in sorted((s.get("errors") or {}).items())) or "none"
        lines.append(f"  {path.name}: {state}: rows {s['rows_done']}/{total if total else '?'}{pct}, "
                     f"error rows {s.get('rows_failed', 0)} ({errors}), {s.get('generated_tokens', 0)} generated "
                     f"tokens, {s.get('tokens_per_s', 0)} tok/s{eta}, updated {s.get('updated_at')}")
        if s.get("duplicate_ids"):
            lines.append(f"    duplicate ids: {s['duplicate_ids']} rows repeat an earlier row's id")
        if s.get("error"):
            lines.append(f"    last error: {s['error']}")
    if len(statuses) > 1:  # shards: each counts its own rows out of its share
        done = sum(x.get("rows_done", 0) for x in statuses)
        totals = [x.get("rows_total") for x in statuses]
        total = sum(totals) if None not in totals and len(statuses) == statuses[0].get("num_shards") else None
        lines.append(f"  all shards: rows {done}/{total if total is not None else '?'}, error rows "
                     f"{sum(x.get('rows_failed', 0) for x in statuses)}")
    parts = sorted(output_dir.glob("part-*.parquet"))
    lines.append(f"  committed parts: {len(parts)}")
    lines += _journals(output_dir)
    writers = live_writers(output_dir)
    for h in writers:
        lines.append(f"  running: {h['lock']} held by pid {h.get('pid')} on {h.get('host')} since {h.get('since')}")
    if not writers:
        lines.append("  no run holds the lock")
    return "\n".join(lines)


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
    parser.add_argument("output_dir", type=Path)
    args = parser.parse_args(argv)
    print(describe(args.output_dir))
    return 0 if (args.output_dir / "_manifest.json").exists() else 2
