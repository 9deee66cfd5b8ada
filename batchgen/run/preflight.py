"""Pre-flight checks of a job once its input is open, before the output directory is touched or a model loads:
the tokenizer (and so the chat template), the columns the config names, the passthrough columns. Problems are
ConfigErrors naming the key (exit 2). Knows the config, the reader's columns and the renderer, not engines."""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

from batchgen.engines.base import HUB_ID, EngineConfig
from batchgen.errors import ConfigError
from batchgen.job import JobConfig
from batchgen.output.rows.schema import OUTPUT_COLUMNS, PROMPT_COLUMN, optional_columns
from batchgen.prompts.render import Renderer, template_fields
from batchgen.reader import Reader
from batchgen.sampling import PROCESSOR_COLUMNS

HUB_TIMEOUT_S = 2.0  # seconds the hub has to answer the pre-flight's one request before it counts as unreachable

RESERVED_PREFIX = "_batchgen_"  # batchgen retry's hidden input columns (_batchgen_id, _batchgen_occurrence)


def load_tokenizer(cfg: JobConfig) -> Optional[Any]:
    """The job's tokenizer (engine.tokenizer, else engine.model's); None for engine=openai's chat endpoint without
    a local one (its config allows no other engine that), whose server renders and counts: the planner then
    estimates prompt lengths from characters and the engine takes the counts from the server's usage."""
    from transformers import AutoTokenizer

    check_hub(cfg.engine)
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


def check_hub(engine: EngineConfig) -> None:
    """A model or tokenizer named by a hub id (no local path) that cannot load: the hub unreachable and the model not
    in the local Hugging Face cache, or HF_HUB_OFFLINE=1 and the model not cached. Said in seconds, exit 2; without
    this check, from_pretrained retries every file for a minute or more before it fails (or uses the cache)."""
    from huggingface_hub import constants

    wanted = _hub_ids(engine)
    if not wanted:
        return
    unreachable = None if constants.HF_HUB_OFFLINE else _unreachable(constants.ENDPOINT)
    problems = []
    for key, repo in wanted:
        cached = _cached(repo, constants.HF_HUB_CACHE)
        if constants.HF_HUB_OFFLINE and cached is None:
            problems.append(f"{key}={repo}: HF_HUB_OFFLINE=1 is set and {repo} is not in the local Hugging Face "
                            f"cache ({constants.HF_HUB_CACHE}); point {key} at a local model directory, download it "
                            f"where the hub is reachable (`hf download {repo}`), or unset HF_HUB_OFFLINE")
        elif unreachable is not None:
            problems.append(_unreachable_problem(key, repo, cached, unreachable))
    if problems:
        raise ConfigError(problems)


def _unreachable_problem(key: str, repo: str, cached: Optional[str], why: str) -> str:
    from huggingface_hub import constants

    said = (f"{key}={repo} is not a local directory, and the Hugging Face Hub ({constants.ENDPOINT}) cannot be "
            f"reached from here ({why})")
    if cached is not None:
        return f"{said}; {repo} is in the local cache ({cached}): set HF_HUB_OFFLINE=1 to use it, or point {key} there"
    return (f"{said}, nor is {repo} in the local cache ({constants.HF_HUB_CACHE}); point {key} at a local model "
            f"directory (downloaded where the hub is reachable: `hf download {repo} --local-dir DIR`), or set "
            f"HF_HUB_CACHE to a cache that holds it and HF_HUB_OFFLINE=1")


def _hub_ids(engine: EngineConfig) -> list[tuple[str, str]]:
    """(key, hub id) of the model and tokenizer this job loads from the hub: those not local paths (engine=openai's
    engine.model names the server's model, loaded by no one here)."""
    keys = ["engine.tokenizer"] + (["engine.model"] if engine.name != "openai" else [])
    named = [(key, getattr(engine, key.split(".")[1])) for key in keys]
    return [(key, path) for key, path in named if path and not os.path.exists(path) and HUB_ID.match(path)
            and not path.startswith((".", "/"))]


def _unreachable(endpoint: str) -> Optional[str]:
    """Why the hub at `endpoint` gives no answer within HUB_TIMEOUT_S (any HTTP answer counts as reachable), else
    None. In a thread: a name lookup or a connect into a black hole has no timeout of its own."""
    from huggingface_hub.utils import get_session

    answer: list[Optional[str]] = []

    def ask() -> None:
        try:
            get_session().head(endpoint, timeout=HUB_TIMEOUT_S)
            answer.append(None)
        except Exception as exc:  # whatever the HTTP client raises (httpx's or requests'), the hub gave no answer
            timed_out = "Timeout" in type(exc).__name__  # httpx's ReadTimeout, ConnectTimeout; requests' too
            answer.append(f"no answer in {HUB_TIMEOUT_S:g} s" if timed_out else f"{type(exc).__name__}: {exc}"[:200])

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(HUB_TIMEOUT_S + 1)
    return answer[0] if answer else f"no answer in {HUB_TIMEOUT_S:g} s"


def _cached(repo: str, cache: str) -> Optional[str]:
    """The local cache's snapshot of `repo` (its main revision), or None."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo, cache_dir=cache, local_files_only=True)
    except OSError:  # LocalEntryNotFoundError: nothing cached
        return None


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
    if not cfg.run.attempt:  # a retry's own input carries them (commands/retry.py)
        problems += [f"dataset.path: {where} has a column {col!r}: names starting with {RESERVED_PREFIX!r} are "
                     f"batchgen's own (batchgen retry adds its hidden columns under them); rename it in the input"
                     for col in available if col.startswith(RESERVED_PREFIX)]
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
