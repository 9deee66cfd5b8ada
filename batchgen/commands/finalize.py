"""`batchgen finalize OUTPUT_DIR`: after the shards of a job have run (a Slurm array, separate workers), write
`_SUCCESS` once every part of every shard exists, or name the missing parts and exit 1. The shard that finishes
last writes `_SUCCESS` itself too; finalize is for a scheduler's last step, and is safe to run any number of times.
Reads the manifest and the part names only."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from batchgen.errors import ConfigError
from batchgen.fsutil import fsync_dir
from batchgen.output.manifest import MANIFEST, parse_manifest, read_manifest
from batchgen.output.rows.schema import PART_RE, SUCCESS


def finalize(where: str, manifest: Optional[dict], committed: set[int], write_success: Callable[[], None]) -> int:
    """The exit code; `manifest` None where there is no run. Every part committed: `write_success()`."""
    if manifest is None:
        print(f"batchgen finalize: error: {where}: no batchgen run here (no {MANIFEST})", file=sys.stderr)
        return 2
    total = manifest.get("parts")
    if total is None:
        print(f"batchgen finalize: error: {where}/{MANIFEST} does not say how many parts the output has (written by "
              f"a batchgen before finalize); rerun any shard to let it finish the output", file=sys.stderr)
        return 2
    missing = [k for k in range(total) if k not in committed]
    if missing:
        shards = manifest.get("layout", {}).get("num_shards", 1)
        shown = ", ".join(f"{k} (shard {k % shards})" for k in missing[:20]) + (" ..." if len(missing) > 20 else "")
        print(f"batchgen finalize: {where}: {len(missing)} of {total} parts missing: {shown}; rerun those shards "
              f"(run.shard=K run.num_shards={shards}), then finalize again", file=sys.stderr)
        return 1
    write_success()
    print(f"batchgen finalize: {where}: all {total} parts committed; {SUCCESS} written")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchgen finalize", description=__doc__)
    parser.add_argument("output_dir")
    where = parser.parse_args(argv).output_dir
    try:
        return _remote(where) if "://" in where else _local(where)
    except ConfigError as exc:  # a torn manifest: named, exit 2 (docs/contract.md section 7)
        for problem in exc.problems:
            print(f"batchgen finalize: error: {problem}", file=sys.stderr)
        return 2


def _remote(where: str) -> int:
    """Object storage: the manifest and the listing from the bucket."""
    from batchgen.output.remote import RemoteOutput

    remote = RemoteOutput(where)
    key = remote.key(MANIFEST)
    manifest = parse_manifest(remote.fs.cat(key), f"{remote.url}/{MANIFEST}") if remote.fs.exists(key) else None
    return finalize(where, manifest, remote.committed() if manifest else set(),
                    lambda: remote.fs.pipe(remote.key(SUCCESS), b""))


def _local(where: str) -> int:
    out = Path(where)
    manifest = read_manifest(out)
    committed = {int(m.group(1)) for p in out.iterdir() if (m := PART_RE.match(p.name))} if manifest else set()

    def write_success() -> None:
        if not (out / SUCCESS).exists():
            from batchgen.output.openai_out import write_if_wanted

            write_if_wanted(out)  # before _SUCCESS: a complete output has its results file
            (out / SUCCESS).write_text("")
            fsync_dir(out)

    return finalize(where, manifest, committed, write_success)
