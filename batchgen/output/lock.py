"""One writer per output (docs/contract.md section 6, rule 4): OS file locks plus a note of each holder.

Each writer holds the lock of its shard (`_lock` for an unsharded run, `_lock.shard-KKKKK` for shard K); the OS
releases a lock when its process dies, so a dead writer's lock is simply taken over, and its holder note (host,
pid, start time, sharding) only names it in a refusal. Parts are assigned to shards by `index % num_shards`, so
two runs of different `run.num_shards` on one output_dir would write the same parts: a writer checks, under the
directory's short-lived `_lock.layout`, that no live writer uses another `run.num_shards` before it takes its own
lock. Every start and every manifest update goes through `_lock.layout`, so the check cannot race.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock, Timeout

from batchgen.errors import LockedError

LAYOUT = "_lock.layout"
LAYOUT_WAIT_S = 60.0  # another writer holds _lock.layout only while it checks locks or updates the manifest


def lock_name(shard: int, num_shards: int) -> str:
    return "_lock" if num_shards == 1 else f"_lock.shard-{shard:05d}"


class OutputLock:
    """The lock of one shard of an output directory."""

    def __init__(self, output_dir: Path, name: str = "_lock", *, shard: int = 0, num_shards: int = 1):
        self.output_dir = output_dir
        self.path = output_dir / name
        self.holder_path = output_dir / f"{name}.holder.json"
        self.shard, self.num_shards = shard, num_shards
        self._lock = FileLock(str(self.path), timeout=0)

    @classmethod
    def for_shard(cls, output_dir: Path, shard: int, num_shards: int) -> OutputLock:
        return cls(output_dir, lock_name(shard, num_shards), shard=shard, num_shards=num_shards)

    def acquire(self) -> None:
        with self.layout():
            for other in live_writers(self.output_dir):
                layout = other.get("num_shards")
                if layout is not None and layout != self.num_shards:
                    raise LockedError(
                        f"{self.output_dir} is being written by a run with run.num_shards={layout} (pid "
                        f"{other.get('pid', '?')} on {other.get('host', '?')}, since {other.get('since', '?')}); "
                        f"this run has run.num_shards={self.num_shards}. All writers of one output_dir must use "
                        f"the same run.num_shards: wait for it to finish or stop it, or use its sharding")
            try:
                self._lock.acquire()
            except Timeout:
                holder = self.holder() or {}
                raise LockedError(
                    f"{self.path.parent} is being written by another run (pid {holder.get('pid', '?')} on "
                    f"{holder.get('host', '?')}, since {holder.get('since', '?')}); wait for it to finish or "
                    f"stop it") from None
            info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "shard": self.shard, "num_shards": self.num_shards}
            self.holder_path.write_text(json.dumps(info))

    @contextlib.contextmanager
    def layout(self) -> Iterator[None]:
        """The output directory's short critical section: lock checks on start, manifest updates."""
        lock = FileLock(str(self.output_dir / LAYOUT), timeout=LAYOUT_WAIT_S)
        try:
            lock.acquire()
        except Timeout:
            raise LockedError(f"{self.output_dir / LAYOUT} stayed locked for {LAYOUT_WAIT_S:.0f}s; another writer "
                              f"is starting or hung there. Stop it, or retry") from None
        try:
            yield
        finally:
            lock.release()

    def release(self) -> None:
        self.holder_path.unlink(missing_ok=True)
        self._lock.release()

    def holder(self) -> Optional[dict[str, Any]]:
        return read_holder(self.holder_path)

    def is_held(self) -> bool:
        return is_held(self.path)

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def is_held(path: Path) -> bool:
    """True while a live process holds the lock file `path`. Opens it read-only (works on a read-only
    directory) and never creates it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


def read_holder(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def writer_locks(output_dir: Path) -> list[Path]:
    """The shard lock files of an output directory (not the layout lock, not holder notes)."""
    return sorted(p for p in output_dir.glob("_lock*") if p.name != LAYOUT and not p.name.endswith(".holder.json"))


def live_writers(output_dir: Path) -> list[dict[str, Any]]:
    """The holder notes of the shard locks live processes hold now; a note without its sharding (an older
    batchgen) is read from the lock's name."""
    out = []
    for path in writer_locks(output_dir):
        if not is_held(path):
            continue
        note = read_holder(path.with_name(f"{path.name}.holder.json")) or {}
        if "num_shards" not in note and path.name == "_lock":
            note["num_shards"] = 1
        out.append(note | {"lock": path.name})
    return out
