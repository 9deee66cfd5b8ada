"""The part journal: finished results of the part in flight, appended as the engine finishes them, so
that a crash loses only what the engine had not finished (docs/contract.md section 6, rule 2).

`_part-KKKKK.journal` sits beside the part it feeds. It is a header frame (the journal key: part
index, first row, row ids digest, config hash, samples per row) followed by one frame per Result.
A frame is `length (u32 LE) | crc32 (u32 LE) | JSON payload`, written with one `write()`; a process
kill therefore never loses a frame the engine reported, and a torn tail (a power loss, or a kill
inside the crash-test window below) fails its length or CRC check and is cut off on reopen.
The file is fsynced by the first append `fsync_interval_s` or more after the previous fsync, and on
close; a machine crash (not a process kill) can also lose what was appended since the last fsync. A journal
whose key differs from the part being planned is discarded. The
runner removes the journal once the part is committed. Knows files and Results, not parts or models.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from batchgen.records import Result

log = logging.getLogger(__name__)
FORMAT = "batchgen-journal/1"
JOURNAL_RE = re.compile(r"^_part-(\d{5,})\.journal$")
FRAME = struct.Struct("<II")  # payload length in bytes, crc32 of the payload
MAX_FRAME = 64 << 20  # a larger length field is a torn or foreign frame, not a record
FSYNC_INTERVAL_S = 1.0  # default: fsync the journal at most once a second (and on close)
CRASH_WINDOW_ENV = "BATCHGEN_TEST_CRASH_WINDOW_S"  # test hook only: see crash_window()
KILL_AT_ENV = "BATCHGEN_TEST_KILL_AT"  # test hook only: see kill_point()


def journal_path(output_dir: Path, index: int) -> Path:
    return output_dir / f"_part-{index:05d}.journal"


def journal_key(*, part: int, first_row: int, ids: list[str], config_hash: str, n: int) -> dict[str, Any]:
    """What a journal must match to be trusted: this part of this input under this output config."""
    digest = hashlib.sha256("\n".join(ids).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return {"part": part, "first_row": first_row, "rows": len(ids), "ids_sha256": digest,
            "config_hash": config_hash, "n": n}


def crash_window(where: str, *, per_part: bool = True) -> None:
    """Test hook for the kill harness: when BATCHGEN_TEST_CRASH_WINDOW_S is set, sleep at the points a crash
    must survive, so that random kills land in them often: that long inside each journal frame, ten times
    that at the once-per-part points (a part under its temp name, a committed part's journal not yet
    removed). Never set it in production."""
    delay = os.environ.get(CRASH_WINDOW_ENV)
    if delay:
        log.debug("crash-test window: %s", where)
        time.sleep(float(delay) * (10 if per_part else 1))


def kill_point(where: str) -> None:
    """Test hook: SIGKILL this process at the named point when BATCHGEN_TEST_KILL_AT names it (a comma-separated
    list), so that a test lands a kill exactly between two writes. Never set it in production."""
    points = os.environ.get(KILL_AT_ENV)
    if points and where in points.split(","):
        import signal

        log.debug("test kill point: %s", where)
        os.kill(os.getpid(), signal.SIGKILL)


def encode_frame(obj: Any) -> bytes:
    payload = json.dumps(obj, separators=(",", ":")).encode()
    return FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def read_frames(data: bytes) -> tuple[list[Any], int]:
    """Decoded frames and the byte length of the valid prefix; whatever follows it is a torn tail."""
    frames, pos = [], 0
    while pos + FRAME.size <= len(data):
        length, crc = FRAME.unpack_from(data, pos)
        end = pos + FRAME.size + length
        if length > MAX_FRAME or end > len(data) or zlib.crc32(data[pos + FRAME.size:end]) != crc:
            break
        try:
            frames.append(json.loads(data[pos + FRAME.size:end]))
        except ValueError:
            break
        pos = end
    return frames, pos


def read_journal(path: Path) -> tuple[Optional[dict[str, Any]], list[Result], int]:
    """(key, results, torn tail bytes) of a journal on disk; key is None when the header is unreadable."""
    data = path.read_bytes()
    frames, valid = read_frames(data)
    if not frames or not isinstance(frames[0], dict) or frames[0].get("format") != FORMAT:
        return None, [], len(data)
    return frames[0].get("key"), [Result(**f) for f in frames[1:]], len(data) - valid


def read_journals(output_dir: Path, mine: Callable[[int], bool] = lambda index: True
                  ) -> dict[int, tuple[Optional[dict[str, Any]], list[Result], int]]:
    """Every part journal in output_dir whose part index `mine` accepts, read (read_journal): index -> (key, results,
    torn tail bytes). One removed while it is read (its part just committed) or unreadable is left out."""
    found = {}
    for path in sorted(output_dir.iterdir()):
        match = JOURNAL_RE.match(path.name)
        if match and mine(int(match.group(1))):
            try:
                found[int(match.group(1))] = read_journal(path)
            except (OSError, TypeError):  # gone, or frames of another batchgen's Result: a resume starts it afresh
                continue
    return found


class Journal:
    """One part's journal, open for appending. Use `Journal.open`, then `append`, `close`, `remove`."""

    def __init__(self, path: Path, fd: int, *, fsync_interval_s: float):
        self.path = path
        self.fd = fd
        self.fsync_interval_s = fsync_interval_s
        self.appended = 0  # results appended by this process
        self._dirty = False
        self._synced_at = time.monotonic()

    @classmethod
    def open(cls, path: Path, key: dict[str, Any], *, valid_keys: set[int],
             fsync_interval_s: float = FSYNC_INTERVAL_S) -> tuple[Journal, list[Result]]:
        """Reopen the journal of this part if its key matches and it holds only requests in `valid_keys`
        (cutting a torn tail), else start a new one. Returns the journal and the results it already holds."""
        results = _recover(path, key, valid_keys) if path.exists() else None
        if results is None:
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            with open(tmp, "wb") as f:
                f.write(encode_frame({"format": FORMAT, "key": key}))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # a journal exists only with a whole header
            results = []
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        return cls(path, fd, fsync_interval_s=fsync_interval_s), results

    def append(self, result: Result) -> None:
        self.append_all([result])

    def append_all(self, results: list[Result]) -> None:
        """Append the results' frames in one write(): a process kill keeps all of them or, torn, none (a beam
        search row's hypotheses are journaled together, feed.Feed)."""
        data = b"".join(encode_frame(asdict(r)) for r in results)
        if os.environ.get(CRASH_WINDOW_ENV):  # test hook: a kill in the window leaves a torn frame
            os.write(self.fd, data[: len(data) // 2])
            crash_window("journal frame half written", per_part=False)
            os.write(self.fd, data[len(data) // 2:])
        else:
            os.write(self.fd, data)
        self.appended += len(results)
        self._dirty = True
        if time.monotonic() - self._synced_at >= self.fsync_interval_s:
            self.sync()

    def sync(self) -> None:
        if self._dirty:
            os.fsync(self.fd)
            self._dirty = False
        self._synced_at = time.monotonic()

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self.sync()
        finally:
            os.close(self.fd)
            self.fd = -1

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _recover(path: Path, key: dict[str, Any], valid_keys: set[int]) -> Optional[list[Result]]:
    """The results of a matching journal, its torn tail cut off; None if it cannot be trusted."""
    try:
        found, results, torn = read_journal(path)
    except (OSError, TypeError) as exc:
        log.warning("%s: unreadable journal (%s); starting the part afresh", path.name, exc)
        return None
    if found != key:
        log.warning("%s: journal belongs to another input or config (%s, expected %s); starting the part afresh",
                    path.name, found, key)
        return None
    unknown = [r.key for r in results if r.key not in valid_keys]
    if unknown:
        log.warning("%s: journal holds requests this part does not plan (%s); starting the part afresh",
                    path.name, unknown[:5])
        return None
    if torn:
        log.warning("%s: dropping a torn tail of %d bytes", path.name, torn)
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - torn)
            f.flush()
            os.fsync(f.fileno())
    log.info("%s: reusing %d journaled results", path.name, len(results))
    return list({r.key: r for r in results}.values())
