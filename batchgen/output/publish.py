"""Publishing a retry: once `batchgen retry`'s attempt N is complete, the latest-attempt view is written over the
top-level part files, so that every reader of the directory (`pd.read_parquet(output_dir)`, pyarrow.dataset, duckdb
`read_parquet('out/*.parquet')`) reads the latest attempt of each row, each row once, in the job's order.

A committed file is never changed: a part whose view holds a retried row gets a new file under its name. Per part:
1. the part as the job committed it is kept, hard-linked (else copied) to `_attempts/original/part-KKKKK.parquet`,
   once: a part is replaced only after its original is kept, so the original exists wherever the two differ;
2. the new part (the view's rows of that part, the job part's schema and metadata, its counts restated, its latest
   attempt in `batchgen.published`) is written under a temp name, fsynced, and renamed over `part-KKKKK.parquet`.
Each top-level name thus shows either its old or its new file, never neither, and both hold the same rows by id, so
every id is in the directory exactly once at every instant. Last, `_published.json` in the attempt's folder records
the counts after it; without it (a kill on the way) the next `batchgen retry OUTPUT_DIR` publishes again: a part whose
file already shows its latest attempt is skipped. The view reads attempt 0 from the originals (view.own_parts).

Knows the output layout and Parquet, not engines or configs.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.constraints import INVALID
from batchgen.fsutil import fsync_dir, replace_durably, write_json_atomic
from batchgen.output.journal import kill_point
from batchgen.output.rows.schema import SUCCESS, TMP_PART_RE
from batchgen.output.rows.stats import PartStats, error_kind
from batchgen.output.view import ATTEMPTS, ORIGINALS, attempt_dir, attempts, part_files, part_views

PUBLISHED = "_published.json"  # in an attempt's folder: its publish finished; the output's counts after it
PUBLISHED_KEY = b"batchgen.published"  # a published part's metadata: {"attempt": the latest attempt of its rows}


def pending(output_dir: Path) -> Optional[int]:
    """The last attempt where it is complete and not yet published (a retry killed while publishing, or one made
    before publishing existed), else None."""
    last = attempts(output_dir)[-1]
    here = attempt_dir(output_dir, last)
    return last if last and (here / SUCCESS).exists() and not (here / PUBLISHED).exists() else None


def publish(output_dir: Path, attempt: int) -> dict[str, Any]:
    """Write the latest-attempt view over the top-level parts that it changes (the module's steps), then record the
    counts after attempt `attempt` in its `_published.json`, and return them."""
    _remove_temps(output_dir)
    replaced = 0
    for own, table in part_views(output_dir):
        top = output_dir / own.name
        level = max(table.column("attempt").to_pylist(), default=0)
        if level > _level(top):  # else its file shows its latest rows already (a publish killed after it)
            _keep_original(output_dir, top)
            _replace(top, table, level)
            replaced += 1
    kill_point("publish: parts replaced")
    totals = PartStats()
    for path in part_files(output_dir):
        totals.add(PartStats.from_json((pq.read_metadata(path).metadata or {}).get(b"batchgen.stats")))
    record = {"attempt": attempt, "parts_replaced": replaced, "rows": totals.rows, "error_rows": totals.error_rows,
              "errors": totals.errors, "invalid_outputs": totals.invalid_outputs,
              "generated_tokens": totals.generated_tokens}
    write_json_atomic(attempt_dir(output_dir, attempt) / PUBLISHED, record)
    return record


def published(output_dir: Path, attempt: int) -> Optional[dict[str, Any]]:
    """Attempt `attempt`'s publish record (the counts after it), None where it is not published."""
    path = attempt_dir(output_dir, attempt) / PUBLISHED
    return json.loads(path.read_text()) if path.exists() else None


def published_line(output_dir: Path, record: dict[str, Any]) -> str:
    """What a publish did, as `batchgen retry` prints it."""
    errors = ", ".join(f"{k}={v}" for k, v in sorted(record["errors"].items()))
    return (f"published attempt {record['attempt']}: {output_dir}/*.parquet now holds the latest attempt of every "
            f"row ({record['parts_replaced']} parts replaced; the job's own kept in {output_dir}/{ATTEMPTS}/"
            f"{ORIGINALS}/): {record['error_rows']} of {record['rows']} rows still fail" + (f" ({errors})" if errors
                                                                                             else ""))


def reading_line(output_dir: Path) -> str:
    """Where to read the published rows, as `batchgen retry`'s last line says it: the command line's reader last."""
    return (f"the top-level parts now show each row's latest attempt: pd.read_parquet({str(output_dir)!r}) reads "
            f"them; to see them with their attempt: batchgen view {shlex.quote(str(output_dir))}")


def _level(path: Path) -> int:
    """The latest attempt among a top-level part's rows: its publish record, 0 for the job's own file."""
    raw = (pq.read_metadata(path).metadata or {}).get(PUBLISHED_KEY)
    return int(json.loads(raw)["attempt"]) if raw else 0


def _keep_original(output_dir: Path, top: Path) -> None:
    """Step 1: keep the job's part `top` in _attempts/original/ unless kept already (so `top` is still the
    original: a part is replaced only once this is done)."""
    kept = output_dir / ATTEMPTS / ORIGINALS / top.name
    if kept.exists():
        return
    kept.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(top, kept)  # the same file under a second name: nothing copied, nothing changed
    except FileExistsError:
        return
    except OSError:  # a file system without hard links: a copy, whole or not at all
        tmp = kept.with_name(f".{kept.name}.tmp-{os.getpid()}")
        shutil.copyfile(top, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, kept)
    fsync_dir(kept.parent)
    fsync_dir(kept.parent.parent)
    kill_point("publish: original kept")


def _replace(top: Path, view: pa.Table, level: int) -> None:
    """Step 2: the part's rows in the view, as the job's part has them (its schema, its metadata with the counts
    restated), written under a temp name, fsynced and renamed over `top`."""
    schema = pq.read_schema(top)
    meta = dict(schema.metadata or {})
    table = pa.Table.from_arrays([view.column(f.name).cast(f.type) for f in schema], schema=schema)
    stats = _restated(table, PartStats.from_json(meta.get(b"batchgen.stats")))
    meta |= {b"batchgen.stats": stats.to_json().encode(), PUBLISHED_KEY: json.dumps({"attempt": level}).encode()}
    tmp = top.with_name(f".{top.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        pq.write_table(table.replace_schema_metadata(meta), f, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    kill_point("publish: part under its temp name")
    replace_durably(tmp, top)
    kill_point("publish: part replaced")


def _restated(table: pa.Table, before: PartStats) -> PartStats:
    """A published part's counts from its rows (as committer.stats_of counts them), the input's own (rows, rows
    skipped) kept from the job's part."""
    cols = {c: table.column(c).to_pylist() for c in ("sample_index", "error", "num_prompt_tokens",
                                                      "num_generated_tokens")}
    first = [s == 0 for s in cols["sample_index"]]
    kinds = [error_kind(e) if e is not None else None for e in cols["error"]]
    extra = {c: table.column(c).to_pylist() for c in ("cost", "needs_review") if c in table.column_names}
    return PartStats(rows=before.rows, samples=table.num_rows, skipped=before.skipped,
                     errors=dict(Counter(k for k, f in zip(kinds, first) if k is not None and k != INVALID and f)),
                     prompt_tokens=sum(t or 0 for t, f in zip(cols["num_prompt_tokens"], first) if f),
                     generated_tokens=sum(t or 0 for t in cols["num_generated_tokens"]),
                     invalid_outputs=sum(k == INVALID for k in kinds),
                     cost=sum(c or 0.0 for c in extra["cost"]) if "cost" in extra else before.cost,
                     needs_review=sum(map(bool, extra["needs_review"])) if "needs_review" in extra
                     else before.needs_review)


def _remove_temps(output_dir: Path) -> None:
    """The temp parts a killed publish left (hidden names no reader takes; a retry runs only on a finished job, so
    no writer of the job's own is behind them)."""
    for folder in (output_dir, output_dir / ATTEMPTS / ORIGINALS):
        for path in folder.iterdir() if folder.is_dir() else ():
            if TMP_PART_RE.match(path.name):
                path.unlink(missing_ok=True)
