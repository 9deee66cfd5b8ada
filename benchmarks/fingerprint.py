"""What the resume guard and the JSONL typing pass cost at start-up, measured here.

    python benchmarks/fingerprint.py                 # a 4 GiB two-file safetensors checkpoint, 500k JSONL rows
    python benchmarks/fingerprint.py --gib 1 --rows 100000

Prints: the manifest's model fingerprint (manifest.model_identity: safetensors headers plus 64 sampled 64 KiB
blocks per file) with the files' pages dropped from the page cache first (posix_fadvise DONTNEED, so the reads go
to the disk) and warm; the JSONL reader's typing-and-counting pass over the whole input (JsonlReader.schema)
against reading the same rows once as batches, which every job does anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchgen.engines.hf.backends.cpu.kernels import describe_cpu  # noqa: E402
from batchgen.output.manifest import model_identity  # noqa: E402
from batchgen.reader import DatasetConfig, open_reader  # noqa: E402


def write_checkpoint(model: Path, gib: float, files: int = 2) -> None:
    """A safetensors checkpoint of random bytes (one bf16 tensor per file), `gib` GiB over `files` files."""
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    per_file = int(gib * (1 << 30)) // files // 2 * 2
    for i in range(files):
        header = json.dumps({"w": {"dtype": "BF16", "shape": [per_file // 2], "data_offsets": [0, per_file]}}).encode()
        with open(model / f"model-{i:05d}-of-{files:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            left = per_file
            while left:
                chunk = min(left, 64 << 20)
                f.write(os.urandom(chunk))
                left -= chunk


def drop_cache(model: Path) -> None:
    for path in model.iterdir():
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)  # dirty pages are not dropped: write them first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    print(describe_cpu())
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        model = Path(tmp) / "model"
        write_checkpoint(model, args.gib)
        size = sum(p.stat().st_size for p in model.iterdir()) / (1 << 30)
        for label, cold in (("cold (pages dropped)", True), ("warm", False)):
            if cold:
                drop_cache(model)
            t = time.perf_counter()
            model_identity(str(model))
            took = time.perf_counter() - t
            print(f"model fingerprint, {size:.1f} GiB in 2 safetensors files, {label}: {took:.3f} s")

        data = Path(tmp) / "in.jsonl"
        with open(data, "w") as f:
            for i in range(args.rows):
                f.write(json.dumps({"id": i, "prompt": f"the river town {i} " * 8, "tags": ["a", "b"],
                                    "meta": {"source": "web", "score": i / 7}}) + "\n")
        mb = data.stat().st_size / 1e6
        reader = open_reader(DatasetConfig(path=str(data)))
        t = time.perf_counter()
        reader.schema()
        scan = time.perf_counter() - t
        t = time.perf_counter()
        rows = sum(b.table.num_rows for b in reader.iter_batches())
        read = time.perf_counter() - t
        print(f"JSONL typing pass over {rows} rows ({mb:.0f} MB): {scan:.2f} s; reading them as batches: {read:.2f} s "
              f"(the pass adds {scan / read:.2f}x the read)")


if __name__ == "__main__":
    main()
