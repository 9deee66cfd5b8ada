"""Which files an input is: dataset.path resolved (file, directory, glob or fsspec URL), its format detected."""

from __future__ import annotations

import os

import fsspec

from batchgen.errors import InputError
from batchgen.reader.config import JSONL_EXTS, PARQUET_EXTS, DatasetConfig


def resolve_files(cfg: DatasetConfig) -> tuple[str, list[str], fsspec.AbstractFileSystem, str]:
    """(format, sorted files, filesystem, root for ids). Raises InputError naming dataset.path."""
    if cfg.format == "hf" or (cfg.format == "auto" and _is_saved_hf_dataset(cfg.path)):
        return "hf", [cfg.path], fsspec.filesystem("file"), ""
    fs, path = fsspec.core.url_to_fs(cfg.path)
    if any(ch in path for ch in "*?["):
        root = _glob_root(path)
        files = sorted(p for p in fs.glob(path) if not _hidden(p, root))
    elif fs.isdir(path):
        files = sorted(p for p in fs.find(path) if p.endswith(PARQUET_EXTS + JSONL_EXTS) and not _hidden(p, path))
        root = path
    elif fs.exists(path):
        files, root = [path], ""
    else:
        raise InputError(f"dataset.path: no such file or directory: {cfg.path}")
    files = [f for f in files if not fs.isdir(f)]
    if not files:
        raise InputError(f"dataset.path: no Parquet or JSONL files match {cfg.path}")
    fmt = cfg.format if cfg.format != "auto" else _format_of(files)
    files = [fs.unstrip_protocol(f) if fs.protocol not in ("file", ("file", "local")) else f for f in files]
    return fmt, files, fs, root


def _hidden(path: str, root: str) -> bool:
    """A file or folder under `root` whose name starts with `_` or `.` (pyarrow's rule): a batchgen output's
    _manifest.json, _status.json, _SUCCESS and journals, temp parts, .ipynb_checkpoints. A directory of parts
    from an earlier job is then an input like any other."""
    rel = path[len(root):] if root and path.startswith(root) else os.path.basename(path)
    return any(name.startswith(("_", ".")) for name in rel.split("/") if name)


def _is_saved_hf_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, name)) for name in ("dataset_dict.json", "state.json")
    )


def _glob_root(pattern: str) -> str:
    parts = pattern.split("/")
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if any(c in p for c in "*?["))]]
    return "/".join(fixed)


def _format_of(files: list[str]) -> str:
    kinds = {"parquet" if f.endswith(PARQUET_EXTS) else "jsonl" if f.endswith(JSONL_EXTS) else None for f in files}
    if None in kinds:
        bad = next(f for f in files if not f.endswith(PARQUET_EXTS + JSONL_EXTS))
        raise InputError(f"dataset.format: cannot tell the format of {bad}; set dataset.format=parquet|jsonl|hf")
    if len(kinds) > 1:
        raise InputError("dataset.path mixes Parquet and JSONL files; point it at one format")
    return kinds.pop()
