"""What batchgen trusts in an output_dir: only files it wrote itself, for this job.

- Before a manifest exists, nothing of an output may be there: a `_SUCCESS`, a part, a journal or an attempt in a
  directory without this job's `_manifest.json` was left by someone else (a `touch`, a copy, another tool), and
  trusting it would end a first run as "already done" or adopt another job's rows. Such a directory is refused
  (exit 2), naming what is there (`refuse_strays`).
- A committed part is the job's own only when its file metadata says so: the job's config hash and its own part
  number (`check_part`, called wherever a part's metadata is read: the totals on start, the skip of committed parts).
- batchgen writes regular files only: a name it writes that is a symlink (or a FIFO, a device) would make it append
  or lock through to something outside output_dir; it is refused (exit 2), naming it (`refuse_links`).

Knows file names and Parquet metadata, not configs or engines.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Optional

from batchgen.errors import ConfigError, ResumeMismatchError

# names batchgen writes into an output_dir (view.ATTEMPTS and the journal's, committer's, heartbeat's, lock's own)
OWN_NAME = re.compile(r"^(_SUCCESS|_manifest\.json|part-\d{5,}\.parquet|_part-\d{5,}\.journal|_status.*\.json|"
                      r"_history.*\.jsonl|_lock.*|_attempts|_openai_batch_output\.jsonl|_input_index\.json|"
                      r"_report\.html|_retry\.json|_input\.parquet|\.(part-|_part-|_).*\.tmp-\d+)$")
# what may be there before the manifest: the locks and holder notes this run takes first, Hydra's run logs, a
# JSONL input's index saved by `batchgen plan`, a retry attempt's input and record (batchgen retry writes them
# first), and a temp copy of the index or manifest that a killed run left
BEFORE_MANIFEST = re.compile(r"^(_lock.*|_logs|_input_index\.json|\._input_index\.json\.tmp-\d+|"
                             r"\._manifest\.json\.tmp-\d+|_input\.parquet|_retry\.json)$")


def refuse_strays(output_dir: Path) -> None:
    """Call before writing the manifest of a new run (no `_manifest.json` yet)."""
    refuse_stray_names(str(output_dir), [p.name for p in output_dir.iterdir()], "output_dir")


def refuse_stray_names(where: str, names: list[str], what: str) -> None:
    """Refuse outputs' files among `names` (a directory's or a bucket prefix's listing without a manifest)."""
    found = sorted(n for n in names if OWN_NAME.match(n) and not BEFORE_MANIFEST.match(n) and n != "_manifest.json"
                   and not n.startswith("."))  # a temp file is never trusted
    if found:
        shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
        raise ResumeMismatchError(
            f"{where} holds {shown} but no _manifest.json: not an output of this job (batchgen writes its "
            f"manifest before anything else). Remove them, or choose an empty {what}")


def refuse_links(output_dir: Path) -> None:
    """Call before the first write into output_dir (the lock included)."""
    for path in output_dir.iterdir():
        if not OWN_NAME.match(path.name) and path.name != "_logs":
            continue
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
            raise ConfigError([f"{path} is {kind}: batchgen writes only regular files it creates in output_dir. "
                               f"Remove it (rm {path}) and rerun"])


def check_part(path: str | Path, metadata: Optional[dict[bytes, bytes]], index: int, config_hash: str) -> None:
    """Refuse a committed part whose metadata does not name this job's config and this part number."""
    meta = metadata or {}
    found_hash = meta.get(b"batchgen.config_hash", b"").decode()
    found_part = meta.get(b"batchgen.part")
    empty_first = found_part is None and index == 0 and b"batchgen.stats" not in meta  # an empty input's part
    if found_hash != config_hash or not (empty_first or found_part == str(index).encode()):
        what = (f"config hash {found_hash or 'none'}, expected {config_hash}" if found_hash != config_hash else
                f"part number {found_part.decode() if found_part else 'none'}, expected {index}")
        raise ResumeMismatchError(
            f"{path} is not a part of this job ({what}): it was copied or renamed here, or written by another job. "
            f"Move it away and rerun; batchgen generates the part again")
