"""Pre-flight checks of a job once its input is open, before the output directory is touched or a model loads:
the tokenizer (and so the chat template), the columns the config names, the passthrough columns. Problems are
ConfigErrors naming the key (exit 2). Knows the config, the reader's columns and the renderer, not engines."""

from __future__ import annotations

import os
from typing import Any, Optional

from batchgen.engines.base import HUB_ID
from batchgen.errors import ConfigError
from batchgen.job import JobConfig
from batchgen.output.rows.schema import OUTPUT_COLUMNS, PROMPT_COLUMN, optional_columns
from batchgen.prompts.render import Renderer, template_fields
from batchgen.reader import Reader
from batchgen.sampling import PROCESSOR_COLUMNS


def load_tokenizer(cfg: JobConfig) -> Optional[Any]:
    """The job's tokenizer (engine.tokenizer, else engine.model's); None for engine=openai's chat endpoint without
    a local one (its config allows no other engine that), whose server renders and counts: the planner then
    estimates prompt lengths from characters and the engine takes the counts from the server's usage."""
    from transformers import AutoTokenizer

    if cfg.engine.name == "openai" and cfg.engine.tokenizer_dir() is None:
        return None
    path = cfg.engine.tokenizer or cfg.engine.model
    key = "engine.tokenizer" if cfg.engine.tokenizer else "engine.model"
    if not os.path.exists(path) and not HUB_ID.match(path):
        raise ConfigError([f"{key}: no such model directory: {path}"])
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.engine.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{key}: cannot load a tokenizer from {path!r}: {exc}"]) from exc


def check_columns(cfg: JobConfig, reader: Reader, renderer: Renderer) -> list[str]:
    """Every column the config names must exist; returns the passthrough columns (_passthrough)."""
    ds = cfg.dataset
    available = reader.columns()
    if available is None:
        return []
    where = ", ".join(reader.files[:3]) + (" ..." if len(reader.files) > 3 else "")
    named = ("id_column", "max_new_tokens_column", "temperature_column", "stop_column", "choice_column",
             "schema_column", "top_p_column", "seed_column", "n_column", "response_format_column", "text_column",
             *PROCESSOR_COLUMNS.values())
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
    passthrough = _passthrough(cfg, available, problems)
    if problems:
        raise ConfigError(problems)
    return passthrough


def _passthrough(cfg: JobConfig, available: list[str], problems: list[str]) -> list[str]:
    """dataset.passthrough_columns as named (each must exist and must not be an output column: both named), or by
    default every input column, the prompt's (prompt_column, messages_column, a template's fields) too, but
    dataset.id_column (the `id` column holds it) and a column named as an output column (an output directory read as
    the next job's input: its `generation` is this job's to write)."""
    ds = cfg.dataset
    taken = _output_names(cfg)
    if ds.passthrough_columns is None:
        return [c for c in available if c not in taken and c != ds.id_column]
    for col in ds.passthrough_columns:
        if col not in available:
            problems.append(f"dataset.passthrough_columns: column {col!r} not found (columns: "
                            f"{', '.join(available)})")
        elif col in taken:
            problems.append(f"dataset.passthrough_columns: input column {col!r} collides with {taken[col]}; "
                            f"rename it in the input, or leave it out of dataset.passthrough_columns")
    return list(ds.passthrough_columns)


def _output_names(cfg: JobConfig) -> dict[str, str]:
    """The columns the job writes itself, each with what writes it (for a collision's message)."""
    out = {name: f"the output column {name!r}" for name in OUTPUT_COLUMNS}
    for name in optional_columns(cfg.sampling, cfg.dataset, cfg.output, cfg.task):
        out[name] = (f"output.include_prompt's column {name!r}" if name == PROMPT_COLUMN else
                     f"the output column {name!r}")
    return out


def old_passthrough(cfg: JobConfig, reader: Reader, renderer: Renderer) -> Optional[list[str]]:
    """The passthrough columns of an output started by a batchgen whose default was every input column but the
    prompt's (prompt_column or messages_column; a template's fields were kept), dataset.id_column included: what a
    resume of such an output keeps writing (prepare.kept_passthrough). None where dataset.passthrough_columns names
    them (the same then and now) or the input has no columns to tell."""
    ds = cfg.dataset
    available = reader.columns()
    if ds.passthrough_columns is not None or available is None:
        return None
    used = ({ds.messages_column} if ds.messages_column else set() if ds.template is not None or renderer.render_row
            else {ds.prompt_column})
    taken = _output_names(cfg)
    return [c for c in available if c not in used and c not in taken]
