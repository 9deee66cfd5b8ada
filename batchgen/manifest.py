"""The manifest: what a run's output was made from, so that a resume can refuse a different input,
model or output-affecting config (DESIGN section 6, rule 3). Knows files and dicts, not models.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from batchgen import __version__
from batchgen.errors import ResumeMismatchError
from batchgen.fsutil import write_json_atomic
from batchgen.job import JobConfig

MANIFEST = "_manifest.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def output_config(cfg: JobConfig) -> dict[str, Any]:
    """The config keys that change what is written; batch sizes, sharding and policies do not."""
    engine = cfg.engine
    return {
        "dataset": dataclasses.asdict(cfg.dataset) | {"batch_rows": None},
        "sampling": dataclasses.asdict(cfg.sampling),
        "engine": {"name": engine.name, "model": engine.model, "tokenizer": engine.tokenizer, "dtype": engine.dtype,
                   "quantization": engine.quantization, "max_model_len": engine.max_model_len},
        "run": {"rows_per_part": cfg.rows_per_part, "too_long": cfg.run.too_long},
    }


def config_hash(cfg: JobConfig) -> str:
    return hashlib.sha256(json.dumps(output_config(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(model: str) -> dict[str, Any]:
    """Path, config.json digest and weight file sizes of a local model; the id alone for a hub model."""
    path = Path(model)
    if not path.is_dir():
        return {"model": model}
    config = path / "config.json"
    weights = sorted((p.name, p.stat().st_size) for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    return {
        "model": os.path.abspath(model),
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.exists() else None,
        "weights": [f"{name}:{size}" for name, size in weights],
    }


def build_manifest(cfg: JobConfig, resolved: dict[str, Any], fingerprint: list[dict]) -> dict[str, Any]:
    return {
        "batchgen_version": __version__,
        "config_hash": config_hash(cfg),
        "output_config": json.loads(json.dumps(output_config(cfg), default=str)),
        "input": fingerprint,
        "model": model_identity(cfg.engine.model),
        "config": resolved,
    }


def check_or_write(output_dir: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest for a new run; for a resume, refuse unless input, model and config all match."""
    path = output_dir / MANIFEST
    if not path.exists():
        write_json_atomic(path, manifest)
        return
    old = json.loads(path.read_text())
    changes = diff(old, manifest)
    if changes:
        lines = "\n".join(f"  {c}" for c in changes)
        raise ResumeMismatchError(
            f"{output_dir} holds a run made from a different input, model or config:\n{lines}\n"
            f"Resume with the original settings, or write to a new output_dir (output_dir=... or name=...)."
        )


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for key in ("output_config", "input", "model"):
        out += _diff(old.get(key), new.get(key), key)
    return out


def _diff(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [line for k in sorted(set(a) | set(b), key=str) for line in _diff(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [line for i, (x, y) in enumerate(zip(a, b)) for line in _diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: was {a!r}, now {b!r}"]
