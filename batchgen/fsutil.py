"""Durable local file writes (temp name, fsync, atomic rename, fsync of the directory), and content digests."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, final: Path) -> None:
    """Rename a fully written, fsynced temp file to its final name, then persist the rename."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


def link_durably(tmp: Path, final: Path) -> bool:
    """Give a fully written, fsynced temp file its final name unless that name exists (first writer wins: a hard
    link never replaces), persist it, and drop the temp name. False when another writer got there first."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(final.parent)
    return True


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    replace_durably(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, default=str) + "\n").encode())


FULL_DIGEST_BYTES = 64 << 20  # files up to this size are hashed whole
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 64, 64 << 10


def content_digest(f: Any, size: int) -> str:
    """A digest of an open binary file's content: the whole file up to FULL_DIGEST_BYTES, else SAMPLE_BLOCKS blocks
    of SAMPLE_BLOCK_BYTES spread evenly from its first byte to its last (4 MiB read whatever the size: a
    multi-GB checkpoint costs milliseconds; retrained weights change every block). Identical bytes give the same
    digest whatever the file's path or mtime."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(size).encode())
    if size <= FULL_DIGEST_BYTES:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        return "full:" + h.hexdigest()
    step = (size - SAMPLE_BLOCK_BYTES) / (SAMPLE_BLOCKS - 1)
    for i in range(SAMPLE_BLOCKS):
        f.seek(int(i * step))
        h.update(f.read(SAMPLE_BLOCK_BYTES))
    return "sampled:" + h.hexdigest()


def cache_home() -> Path:
    """batchgen's own cache directory on this machine: `$BATCHGEN_CACHE_DIR`, else `~/.cache/batchgen`."""
    return Path(os.environ.get("BATCHGEN_CACHE_DIR") or Path.home() / ".cache" / "batchgen")


_SHA256 = re.compile(r"[0-9a-f]{64}")


def file_sha256(path: Path) -> str:
    """The sha256 of a local file's whole content, read once per version of the file: the digest is kept in
    cache_home()/digests under the file's real path, size, mtime_ns, ctime_ns, inode and device, any of which an
    in-place rewrite changes (ctime even where a copy keeps the old mtime). A sampled digest (content_digest) can
    miss a fine-tune that rewrote a few tensors between its blocks; this cannot. About 0.8 s a GB on a CPU with
    SHA instructions, paid on the first run after the file changed. A kept digest that does not read back as one
    (torn, edited) is computed again and rewritten; an unwritable cache costs the time, never the answer."""
    st = os.stat(path)
    key = json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
    kept = cache_home() / "digests" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        entry = json.loads(kept.read_text())
        if isinstance(entry, dict) and entry.get("key") == key and _SHA256.fullmatch(str(entry.get("sha256"))):
            return entry["sha256"]
        log.warning("%s does not hold %s's digest; computing it again", kept, path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        log.warning("%s is unreadable (%s); computing %s's digest again", kept, exc, path)
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(kept, {"key": key, "sha256": digest})
    except OSError as exc:
        log.warning("could not keep %s's digest in %s (%s); it is computed again next run", path, kept, exc)
    return digest
