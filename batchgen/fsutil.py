"""Durable local file writes (temp name, fsync, atomic rename, fsync of the directory), and content digests."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


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
