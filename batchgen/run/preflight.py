"""Pre-flight checks of a job once its input is open, before the output directory is touched or a model loads:
the tokenizer (and so the chat template), the columns the config names, the passthrough columns. Problems are
ConfigErrors naming the key (exit 2). Knows the config, the reader's columns and the renderer, not engines."""

from __future__ import annotations

import os
from typing import Any

from batchgen.engines.base import HUB_ID
from batchgen.errors import ConfigError
from batchgen.job import JobConfig
from batchgen.output.committer import OUTPUT_COLUMNS, optional_columns
from batchgen.prompts.render import Renderer, template_fields
from batchgen.reader import Reader


def load_tokenizer(cfg: JobConfig) -> Any:
    from transformers import AutoTokenizer

    path = cfg.engine.tokenizer or cfg.engine.model
    key = "engine.tokenizer" if cfg.engine.tokenizer else "engine.model"
    if not os.path.exists(path) and not HUB_ID.match(path):
        raise ConfigError([f"{key}: no such model directory: {path}"])
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.engine.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{key}: cannot load a tokenizer from {path!r}: {exc}"]) from exc


def check_columns(cfg: JobConfig, reader: Reader, renderer: Renderer) -> list[str]:
    """Every column the config names must exist; returns the passthrough columns."""
    ds = cfg.dataset
    available = reader.columns()
    if available is None:
        return []
    where = ", ".join(reader.files[:3]) + (" ..." if len(reader.files) > 3 else "")
    named = ("id_column", "max_new_tokens_column", "temperature_column", "stop_column", "choice_column",
             "schema_column", "top_p_column", "seed_column", "n_column", "response_format_column", "text_column")
    wanted = {f"dataset.{key}": getattr(ds, key) for key in named}
    if ds.messages_column:
        wanted["dataset.messages_column"] = ds.messages_column
    elif ds.template is None and renderer.render_row is None:
        wanted["dataset.prompt_column"] = ds.prompt_column
    problems = [f"{key}: column {col!r} not found in {where} (columns: {', '.join(available)})"
                for key, col in wanted.items() if col is not None and col not in available]
    if ds.template is not None:
        problems += [f"dataset.template refers to {{{name}}}, but no column {name!r} exists in {where} "
                     f"(columns: {', '.join(available)})" for name in template_fields(ds.template)
                     if name not in available]
    passthrough = _passthrough(cfg, available, problems, renderer.render_row is not None)
    if problems:
        raise ConfigError(problems)
    return passthrough


def _passthrough(cfg: JobConfig, available: list[str], problems: list[str], own_render: bool) -> list[str]:
    ds = cfg.dataset
    if ds.passthrough_columns is not None:
        for col in ds.passthrough_columns:
            if col not in available:
                problems.append(f"dataset.passthrough_columns: column {col!r} not found (columns: "
                                f"{', '.join(available)})")
            elif col in OUTPUT_COLUMNS or col in optional_columns(cfg.sampling, cfg.dataset, cfg.output, cfg.task):
                problems.append(f"dataset.passthrough_columns: {col!r} collides with an output column; "
                                f"rename it in the input")
        return list(ds.passthrough_columns)
    used = ({ds.messages_column} if ds.messages_column else set() if ds.template is not None or own_render
            else {ds.prompt_column})
    taken = set(OUTPUT_COLUMNS) | set(optional_columns(cfg.sampling, cfg.dataset, cfg.output, cfg.task))
    return [c for c in available if c not in used and c not in taken]
