"""The dataset's config (`dataset.*`) and the checks on it that need no file opened."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import fsspec

PARQUET_EXTS = (".parquet", ".pq")
JSONL_EXTS = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz")
FORMATS = ("auto", "parquet", "jsonl", "hf", "openai_batch")
VERIFY = ("footers", "pages")
MAX_DEPTH = 32  # nesting of a JSONL value beyond which its row is a too_deep error (Parquet readers choke deeper)
BOM = b"\xef\xbb\xbf"
TEMPLATE_FILE_SUFFIXES = (".txt", ".text", ".md", ".jinja", ".jinja2", ".j2", ".tmpl", ".tpl", ".prompt", ".yaml",
                          ".yml", ".json")  # a dataset.template ending so, with no placeholder, is a path



@dataclass
class DatasetConfig:
    path: str = "???"  # file, directory, glob or fsspec URL; or a `datasets` dir / hub id for format=hf
    format: str = "auto"  # auto | parquet | jsonl | hf | openai_batch (OpenAI batch API request lines)
    id_column: Optional[str] = None  # unique row id column; null = `<file>:<row>`
    prompt_column: str = "prompt"
    template: Optional[str] = None  # "Summarize:\n{text}", rendered with the row's columns
    messages_column: Optional[str] = None  # list of {role, content}, rendered with the chat template
    system_prompt: Optional[str] = None  # system message for chat rendering
    chat_template: Optional[str] = None  # a Jinja chat template (its text, or a .jinja / .j2 file) instead of the
    # tokenizer's; setting it turns on chat rendering
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra variables for the chat template
    # ({enable_thinking: false}), as transformers' apply_chat_template and vLLM's chat_template_kwargs take them
    render_timeout_s: float = 2.0  # CPU seconds one row's chat template may take; past it the row is bad_template
    passthrough_columns: Optional[list[str]] = None  # null = every input column but id_column (it is `id`)
    limit: Optional[int] = None  # first N rows only
    max_new_tokens_column: Optional[str] = None  # per-row cap on generated tokens
    # per-row sampling from columns, each value checked per row (a bad one is an error row); null values take the job's
    temperature_column: Optional[str] = None  # a number >= 0 (0 = greedy)
    stop_column: Optional[str] = None  # a string or a list of strings, added to sampling.stop
    choice_column: Optional[str] = None  # a list of strings: the row's choice constraint
    schema_column: Optional[str] = None  # a name from sampling.schemas: the row's JSON schema
    top_p_column: Optional[str] = None  # a number in (0, 1]
    seed_column: Optional[str] = None  # an integer: the row's samples' seeds derive from it instead of sampling.seed
    n_column: Optional[str] = None  # samples for the row, 1..128 (else sampling.n)
    text_column: Optional[str] = None  # task=loglik: the text scored given the rendered prompt (null: the prompt)
    response_format_column: Optional[str] = None  # an OpenAI response_format (object or JSON text): text,
    # json_object or json_schema, the row's constraint
    # per-row logits processors, each value checked as its sampling.* key is (a bad one is a bad_value row)
    repetition_penalty_column: Optional[str] = None  # a number > 0
    presence_penalty_column: Optional[str] = None  # a number in [-2, 2]
    frequency_penalty_column: Optional[str] = None  # a number in [-2, 2]
    min_p_column: Optional[str] = None  # a number in [0, 1]
    min_tokens_column: Optional[str] = None  # an integer >= 0 (above the row's cap: the cap)
    logit_bias_column: Optional[str] = None  # an object {token id: bias in [-100, 100]}, or its JSON text
    bad_words_column: Optional[str] = None  # a list of words (or its JSON text): the row's own
    allowed_token_ids_column: Optional[str] = None  # a list of token ids (or its JSON text): the row's own
    stop_token_ids_column: Optional[str] = None  # a list of token ids (or its JSON text): the row's own
    split: Optional[str] = None  # format=hf: split of a DatasetDict or hub dataset
    batch_rows: int = 2048  # rows per read batch (memory bound of the reader)
    max_line_bytes: int = 8 * 1024 * 1024  # JSONL: a longer line is a too_large error row, never parsed
    verify: str = "pages"  # Parquet, before generation: pages (every page read once, checksums) | footers only

    def problems(self) -> list[str]:
        out = []
        if self.path in ("???", "", None):
            out.append("dataset.path is required (a file, directory, glob or URL)")
        else:
            out += _path_problems(self.path, self.format)
        if self.format not in FORMATS:
            out.append(f"dataset.format must be one of {', '.join(FORMATS)} (got {self.format!r})")
        if self.limit is not None and self.limit < 0:
            out.append(f"dataset.limit must be >= 0 or null (got {self.limit})")
        if self.batch_rows < 1:
            out.append(f"dataset.batch_rows must be >= 1 (got {self.batch_rows})")
        if self.verify not in VERIFY:
            out.append(f"dataset.verify must be one of {', '.join(VERIFY)} (got {self.verify!r})")
        if not self.render_timeout_s > 0:
            out.append(f"dataset.render_timeout_s must be > 0: the CPU seconds one row's chat template may take "
                       f"(got {self.render_timeout_s})")
        if self.max_line_bytes < 1:
            out.append(f"dataset.max_line_bytes must be >= 1 (got {self.max_line_bytes})")
        if self.template is not None and self.messages_column is not None:
            out.append("dataset.template and dataset.messages_column are exclusive: set one of them")
        if self.template is not None and _looks_like_a_path(self.template):
            out.append(f"dataset.template={self.template!r} looks like a file's path, but dataset.template is the "
                       f"prompt text itself, a format string with {{column}} placeholders rendered per row "
                       f"('Summarize:\\n{{text}}'): every row's prompt would be this path. Write the file's "
                       f"text as the value: in a job preset's YAML (dataset: template: |, then its lines), or on the "
                       f"command line 'dataset.template=\"...\"' with \\n for each newline")
        if self.choice_column and self.schema_column:
            out.append("dataset.choice_column and dataset.schema_column are exclusive: a row has one constraint")
        return out


def _looks_like_a_path(template: str) -> bool:
    """A template with no `{` placeholder that names an existing file, or is one word ending in a file suffix
    (.txt, .md, .jinja, ...) or holding a path separator: a path given where the text was meant."""
    if "{" in template:
        return False
    if os.path.isfile(template):
        return True
    word = template.strip()
    if not word or any(ch.isspace() for ch in word):
        return False
    return word.lower().endswith(TEMPLATE_FILE_SUFFIXES) or "/" in word or os.sep in word


def _path_problems(path: str, fmt: str) -> list[str]:
    """A URL whose filesystem is not installed, or a local path that does not exist (no glob, not a hub id)."""
    if "://" in path:
        protocol = path.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            return [f"dataset.path: {protocol}:// needs a package that is not installed: {exc}"]
        except ValueError:
            return [f"dataset.path: unknown URL scheme {protocol}:// (fsspec knows no such filesystem)"]
        return []
    if any(ch in path for ch in "*?[") or os.path.exists(path) or fmt == "hf":
        return []
    return [f"dataset.path: no such file or directory: {path}"]
