"""One writer per output_dir (DESIGN section 6, rule 4): an OS file lock plus a note of its holder.

The OS releases the lock when its process dies, so a stale lock of a dead process is simply taken
over; the holder note (host, pid, start time) is only there to name the holder in the refusal.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock, Timeout

from batchgen.errors import LockedError


class OutputLock:
    def __init__(self, output_dir: Path, name: str = "_lock"):
        self.path = output_dir / name
        self.holder_path = output_dir / f"{name}.holder.json"
        self._lock = FileLock(str(self.path), timeout=0)

    def acquire(self) -> None:
        try:
            self._lock.acquire()
        except Timeout:
            holder = self.holder() or {}
            raise LockedError(
                f"{self.path.parent} is being written by another run (pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')}, since {holder.get('since', '?')}); wait for it to finish or stop it"
            ) from None
        info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.holder_path.write_text(json.dumps(info))

    def release(self) -> None:
        self.holder_path.unlink(missing_ok=True)
        self._lock.release()

    def holder(self) -> Optional[dict[str, Any]]:
        try:
            return json.loads(self.holder_path.read_text())
        except (OSError, ValueError):
            return None

    def is_held(self) -> bool:
        probe = FileLock(str(self.path), timeout=0)
        try:
            probe.acquire()
        except Timeout:
            return True
        probe.release()
        return False

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
