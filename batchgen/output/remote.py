"""output_dir on object storage (an fsspec URL: `s3://bucket/prefix`, through s3fs), exactly once without rename.

A run works in a local staging directory (BATCHGEN_STAGING_DIR, default ~/.cache/batchgen/staging/<hash of the
URL>) with the local protocol unchanged: the lock, the journal of the parts in flight, temp files and the rename
that commits a part there. A committed part is then uploaded to its final key in one request (an object appears
whole or not at all: a single PUT, or a multipart upload completed in one call), and only then removed locally.
Nothing else is ever written under the output's prefix but final parts, `_manifest.json`, `_status*.json` and
`_SUCCESS`, so a reader of `s3://bucket/prefix/part-*.parquet` (pyarrow, duckdb, pandas) sees committed parts only.

On start the staging directory is reconciled with the bucket: the manifest (and `_SUCCESS`) come down, so a resume
is checked against what the output was made from; a part committed locally whose upload a crash cut short goes up
now. The committed set is the bucket's listing. What holds where:
- exactly once: per part key; a part uploaded twice (a crash after the upload, before the local removal) is the
  same bytes (seeds derive from ids), and its key is written, never appended;
- the journal is local: a resume on the same machine keeps the finished samples of the parts in flight; on another
  machine it generates them again (never twice in the output);
- the lock is local: one writer per machine and shard. Several machines may write one output as different shards
  (run.shard), which own different parts; two machines as the same shard are not detected.
Knows fsspec and file names; the committer's format is its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from batchgen.output.committer import Committer, OutputWriteError
from batchgen.output.journal import kill_point
from batchgen.output.manifest import MANIFEST
from batchgen.output.rows.schema import PART_RE, SUCCESS
from batchgen.output.rows.stats import PartStats

log = logging.getLogger(__name__)
PUSHED = (MANIFEST, SUCCESS)  # besides parts and status files, the only objects a run writes


def is_remote(output_dir: str) -> bool:
    return "://" in output_dir and not output_dir.startswith("file://")


class RemoteOutput:
    def __init__(self, url: str):
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        base = os.environ.get("BATCHGEN_STAGING_DIR") or str(Path.home() / ".cache" / "batchgen" / "staging")
        self.staging = Path(base) / hashlib.sha256(self.url.encode()).hexdigest()[:16]

    def key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def pull(self) -> None:
        """Bring the bucket's manifest and `_SUCCESS` into the staging directory before the run checks them. The
        staging directory is trusted only as the staging of the bucket's own run: where the bucket holds no manifest,
        or another one than the staging directory's, what is staged was left by a run whose output is gone or is
        another job's, and it is cleared (the locks aside) before anything is uploaded. Staged parts go up only
        after the manifest check (`reconcile`). A bucket prefix holding outputs' files but no manifest is refused."""
        self.staging.mkdir(parents=True, exist_ok=True)
        manifest = self.fs.cat(self.key(MANIFEST)) if self.fs.exists(self.key(MANIFEST)) else None
        local = self.staging / MANIFEST
        if manifest is None:
            self._refuse_strays()
        if manifest is None or not local.exists() or local.read_bytes() != manifest:
            self._clear_staging()
        if manifest is not None:
            local.write_bytes(manifest)
        if self.fs.exists(self.key(SUCCESS)):
            self.fs.get_file(self.key(SUCCESS), str(self.staging / SUCCESS))
        else:
            (self.staging / SUCCESS).unlink(missing_ok=True)

    def reconcile(self, config_hash: str) -> None:
        """After the manifest check: upload the parts a killed run committed here but could not upload; a staged
        part that is not this job's (trust.check_part) is removed, never uploaded."""
        import pyarrow.parquet as pq

        from batchgen.errors import ResumeMismatchError
        from batchgen.output.trust import check_part

        remote = self.committed()
        for path in sorted(self.staging.glob("part-*.parquet")):
            index = int(PART_RE.match(path.name).group(1))
            try:
                check_part(path, pq.read_metadata(path).metadata, index, config_hash)
            except (ResumeMismatchError, OSError, ValueError) as exc:
                log.warning("removing staged %s: %s", path.name, exc)
                path.unlink()
                continue
            if index not in remote:
                log.info("uploading %s, committed before an interrupted run could upload it", path.name)
                self.upload(path)
            else:
                path.unlink()

    def _refuse_strays(self) -> None:
        from batchgen.output.trust import refuse_stray_names

        refuse_stray_names(self.url, self._names(), "prefix")

    def _clear_staging(self) -> None:
        stale = [p for p in self.staging.iterdir() if not p.name.startswith(("_lock", "_logs"))]
        if stale:
            log.info("clearing %d files staged by an earlier run of another output at %s", len(stale), self.url)
        for path in stale:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    def committed(self) -> set[int]:
        return {int(m.group(1)) for n in self._names() if (m := PART_RE.match(n))}

    def _names(self) -> list[str]:
        """The names under the output's prefix, listed afresh (another machine's shard may have written since)."""
        try:
            return [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False, refresh=True)]
        except FileNotFoundError:
            return []

    def upload(self, path: Path, keep: bool = False) -> None:
        """`path` to its final key in one request, then (a part) removed from staging."""
        try:
            self.fs.put_file(str(path), self.key(path.name))
        except OSError as exc:
            raise OutputWriteError(Path(self.key(path.name)), exc) from exc
        if not keep:
            path.unlink()

    def push(self, name: str) -> None:
        """A staging file (the manifest, a status file, _SUCCESS) to the bucket, replacing the object."""
        if (self.staging / name).exists():
            self.upload(self.staging / name, keep=True)


class RemoteCommitter(Committer):
    """The committer over the staging directory, each committed part uploaded to the bucket at once."""

    def __init__(self, remote: RemoteOutput, **kwargs: Any):
        super().__init__(remote.staging, **kwargs)
        self.remote = remote

    def committed(self) -> set[int]:
        return self.remote.committed() | super().committed()

    def read_stats(self, index: int) -> PartStats:
        import pyarrow.parquet as pq

        key = self.remote.key(self.part_path(index).name)
        if self.sink is not None and not self.remote.fs.exists(key):
            return PartStats(**(self.sink.stats(index) or {}))
        with self.remote.fs.open(key, "rb") as f:
            meta = pq.read_metadata(f).metadata
        return self.stats_from(f"{self.remote.url}/{self.part_path(index).name}", meta, index)

    def read_part(self, index: Any) -> Any:
        import pyarrow.parquet as pq

        with self.remote.fs.open(self.remote.key(self.part_path(index).name), "rb") as f:
            return pq.read_table(f)

    def commit(self, part: Any, rows: Any) -> PartStats:
        stats = super().commit(part, rows)
        kill_point("part committed in staging before its upload")
        self.remote.upload(self.part_path(part.index))
        for status in self.output_dir.glob("_status*.json"):
            self.remote.push(status.name)
        return stats

    def write_empty(self, schema_fields: Any = None) -> None:
        super().write_empty(schema_fields)
        self.remote.upload(self.part_path(0))

    def finish(self, total_parts: int, before_success: Any = None) -> bool:
        done = self.committed()
        if any(k not in done for k in range(total_parts)):
            return False
        if before_success is not None:
            before_success()
        (self.output_dir / SUCCESS).write_text("")
        self.remote.push(SUCCESS)
        return True
