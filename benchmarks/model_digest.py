"""What the model identity costs (fsutil.file_sha256: a weight file's whole sha256, kept per version of the file):
a checkpoint file of each size is written, then identified three times: the first computes the digest, the next
two read the kept one. The file was just written, so it is read from the page cache where memory holds it; a cold
read adds the disk's own time. Prints the CPU model and its SHA flag beside each figure.

    python benchmarks/model_digest.py --gb 1 15 --dir DIR
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path


def cpu() -> str:
    model, flags = platform.processor(), ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        flags = "sha_ni" if " sha_ni" in text else "no sha_ni"
    except (OSError, StopIteration):
        pass
    return f"{model} ({flags})"


def write(path: Path, gb: float) -> None:
    chunk = os.urandom(64 << 20)
    with open(path, "wb") as f:
        for _ in range(int(gb * 16)):
            f.write(chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, nargs="+", default=[1.0])
    parser.add_argument("--dir", default=None, help="where the checkpoint files are written (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        os.environ["BATCHGEN_CACHE_DIR"] = str(Path(where) / "cache")
        from batchgen.fsutil import file_sha256

        print(f"CPU: {cpu()}")
        for gb in args.gb:
            path = Path(where) / f"model-{gb:g}gb.safetensors"
            write(path, gb)
            times = []
            for _ in range(3):
                started = time.perf_counter()
                file_sha256(path)
                times.append(time.perf_counter() - started)
            print(f"{gb:g} GB: first identification {times[0]:.2f} s ({gb / times[0]:.2f} GB/s), then "
                  f"{times[1] * 1e3:.2f} ms and {times[2] * 1e3:.2f} ms (the kept digest)")
            path.unlink()


if __name__ == "__main__":
    main()
