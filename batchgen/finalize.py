"""`batchgen finalize OUTPUT_DIR`: after the shards of a job have run (a Slurm array, separate workers), write
`_SUCCESS` once every part of every shard exists, or name the missing parts and exit 1. The shard that finishes
last writes `_SUCCESS` itself too; finalize is for a scheduler's last step, and is safe to run any number of times.
Reads the manifest and the part names only."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from batchgen.committer import PART_RE, SUCCESS
from batchgen.fsutil import fsync_dir
from batchgen.manifest import MANIFEST


def missing_parts(output_dir: Path) -> tuple[list[int], int]:
    """The parts not committed yet, and how many parts the output has (from the manifest)."""
    manifest = json.loads((output_dir / MANIFEST).read_text())
    total = manifest.get("parts")
    if total is None:
        raise ValueError(f"{output_dir / MANIFEST} does not say how many parts the output has (written by a batchgen "
                         f"before finalize); rerun any shard to let it finish the output")
    done = {int(m.group(1)) for p in output_dir.iterdir() if (m := PART_RE.match(p.name))}
    return [k for k in range(total) if k not in done], total


def remote_main(url: str) -> int:
    """finalize for an output_dir on object storage: the manifest and the listing from the bucket."""
    from batchgen.remote import RemoteOutput

    remote = RemoteOutput(url)
    if not remote.fs.exists(remote.key(MANIFEST)):
        print(f"batchgen finalize: error: {url}: no batchgen run here (no {MANIFEST})", file=sys.stderr)
        return 2
    manifest = json.loads(remote.fs.cat(remote.key(MANIFEST)))
    total = manifest.get("parts")
    if total is None:
        print(f"batchgen finalize: error: {url}/{MANIFEST} does not say how many parts the output has",
              file=sys.stderr)
        return 2
    missing = sorted(set(range(total)) - remote.committed())
    if missing:
        print(f"batchgen finalize: {url}: {len(missing)} of {total} parts missing: "
              f"{', '.join(map(str, missing[:20]))}", file=sys.stderr)
        return 1
    remote.fs.pipe(remote.key(SUCCESS), b"")
    print(f"batchgen finalize: {url}: all {total} parts committed; {SUCCESS} written")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchgen finalize", description=__doc__)
    parser.add_argument("output_dir")
    args = parser.parse_args(argv)
    if "://" in args.output_dir:
        return remote_main(args.output_dir)
    out = Path(args.output_dir)
    if not (out / MANIFEST).exists():
        print(f"batchgen finalize: error: {out}: no batchgen run here (no {MANIFEST})", file=sys.stderr)
        return 2
    try:
        missing, total = missing_parts(out)
    except ValueError as exc:
        print(f"batchgen finalize: error: {exc}", file=sys.stderr)
        return 2
    if missing:
        shards = json.loads((out / MANIFEST).read_text()).get("layout", {}).get("num_shards", 1)
        shown = ", ".join(f"{k} (shard {k % shards})" for k in missing[:20]) + (" ..." if len(missing) > 20 else "")
        print(f"batchgen finalize: {out}: {len(missing)} of {total} parts missing: {shown}; rerun those shards "
              f"(run.shard=K run.num_shards={shards}), then finalize again", file=sys.stderr)
        return 1
    if not (out / SUCCESS).exists():
        (out / SUCCESS).write_text("")
        fsync_dir(out)
    print(f"batchgen finalize: {out}: all {total} parts committed; {SUCCESS} written")
    return 0
