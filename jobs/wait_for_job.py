"""Wait for a batchgen job to finish, as an Airflow sensor or a CI step polls one: read its output directory's
status files, never its logs.

    python jobs/wait_for_job.py data/outputs/annotate --timeout 36000 --every 60

Exit 0 once `_SUCCESS` exists; 1 if a shard's last status is `failed`, or `running` with no live writer (the
process died: restart the job, it resumes); 3 on timeout. Prints one progress line per poll.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen.output.heartbeat import read_heartbeats, writer_is_gone  # noqa: E402


def check(output_dir: Path) -> tuple[str, str]:
    """(verdict, line): verdict is done, failed, dead or waiting."""
    if (output_dir / "_SUCCESS").exists():
        return "done", f"{output_dir}: complete"
    beats = [beat for _, beat in read_heartbeats(output_dir)]
    for s in beats:
        if s.state == "failed":
            return "failed", f"{output_dir}: shard {s.shard} failed: {s.error}"
        if writer_is_gone(output_dir, s):
            return "dead", f"{output_dir}: shard {s.shard} stopped without a live writer (killed?)"
    done = sum(s.rows_done for s in beats)
    return "waiting", f"{output_dir}: {done} rows done, {len(beats)} shard status file(s)"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--timeout", type=float, default=24 * 3600)
    parser.add_argument("--every", type=float, default=30.0)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    while True:
        verdict, line = check(args.output_dir)
        print(line, flush=True)
        if verdict == "done":
            return 0
        if verdict in ("failed", "dead"):
            return 1
        if time.monotonic() + args.every > deadline:
            return 3
        time.sleep(args.every)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
