"""Nightly increments (run.skip_existing=PATH): the ids an earlier output already generated, so that a job over
yesterday's rows plus today's generates only today's.

Only the earlier output's `id` and `error` columns are read (pyarrow's column projection), and its ids are kept as
8-byte hashes (about 40 bytes a row in a Python set; 10 million rows: about 400 MB). An id counts as generated when
every one of its samples there has no error: rows that erred are generated again. The earlier output must have been
made under the same output config, the input aside (its _manifest.json is compared); otherwise the job is refused,
naming the keys that differ. Knows Parquet outputs and manifests, not engines.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from batchgen.errors import ConfigError
from batchgen.manifest import MANIFEST, diff, output_config

INPUT_KEYS = ("path", "limit")  # dataset keys that may differ between nights: the input itself


def id_hash(row_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(row_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    """An output config without what names the input (dataset.path, dataset.limit) or the chain itself."""
    out = json.loads(json.dumps(config, default=str))
    for key in INPUT_KEYS:
        out.get("dataset", {}).pop(key, None)
    out.get("run", {}).pop("skip_existing", None)
    return out


class Existing:
    """The earlier output's generated ids (hashed)."""

    def __init__(self, path: str, cfg: Any):
        self.path = os.path.realpath(path) if "://" not in path else path
        manifest = Path(self.path) / MANIFEST
        if not manifest.exists():
            raise ConfigError([f"run.skip_existing: {path} holds no batchgen output (no {MANIFEST})"])
        earlier = json.loads(manifest.read_text()).get("output_config", {})
        changes = diff({"output_config": comparable(earlier)}, {"output_config": comparable(output_config(cfg))})
        if changes:
            raise ConfigError([f"run.skip_existing: {path} was generated under another output config ("
                               f"{'; '.join(changes[:5])}); its rows would not be what this job generates. Point it "
                               f"at an output of the same job, or leave it unset"])
        self.ids = self._generated()

    def _generated(self) -> set[int]:
        """Ids with no erring sample in the earlier output's latest-attempt view (batchgen retry's attempts)."""
        from batchgen.view import latest_batches

        seen: set[int] = set()
        erred: set[int] = set()
        for batch in latest_batches(self.path, columns=["id", "error"]):
            for row_id, error in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                (erred if error is not None else seen).add(id_hash(row_id))
        return seen - erred

    def __contains__(self, row_id: str) -> bool:
        return id_hash(row_id) in self.ids

    def __len__(self) -> int:
        return len(self.ids)
