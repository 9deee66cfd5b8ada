"""Prompt rendering: a plain column, a `{column}` template, or the tokenizer's chat template.

The renderer turns one part's input columns into prompt texts, or into a per-row error string
(docs/contract.md section 7). It knows the tokenizer only for its chat template; it does not tokenize. Without a
tokenizer (engine=openai's chat endpoint, whose server renders the messages) a chat row's text is its messages as
JSON: what --show and output.include_prompt print, and what its length is estimated from.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchgen.errors import ConfigError
from batchgen.prompts.budget import RenderBudgetExceeded, render_budget
from batchgen.reader import DatasetConfig, column_values, is_json_text
from batchgen.reader.messages import content_text


@dataclass(slots=True)
class Rendered:
    texts: list[Optional[str]]  # prompt text per row, None where the row has an error
    errors: list[Optional[str]]  # why the row could not be rendered, else None
    add_special_tokens: bool  # False when the chat template already placed BOS and friends
    messages: list[Optional[list[dict]]]  # per row, the chat messages the text was rendered from (None: plain text)


def template_fields(template: str) -> list[str]:
    """Top-level column names a `{column}` template refers to."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field:
            names.append(field.split(".")[0].split("[")[0])
    return names


RenderRow = Callable[[dict], Any]  # a row (its columns) -> prompt text, or a list of {role, content} messages


class Renderer:
    def __init__(self, cfg: DatasetConfig, tokenizer: Any, render_row: Optional[RenderRow] = None, *,
                 chat_template: Optional[str] = None):
        """render_row: a Python job's own rendering (batchgen.run_job(cfg, render_row=...)), used instead of the
        prompt column or template: it returns the prompt text, or chat messages for the chat template. Whatever it
        raises costs its row (`bad_render: ...`), never the job. chat_template: dataset.chat_template's text as the
        caller read it already (a Ray worker: the driver's), instead of reading its file again."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.render_row = render_row
        self.template, self.system_prompt = cfg.template, cfg.system_prompt  # newlines made by validate (texts.py)
        self.chat_template = chat_template if chat_template is not None else chat_template_text(cfg.chat_template)
        # apply_chat_template's arguments: the job's template variables, the generation prompt (unless a variable
        # says otherwise), the job's template where it gives one; always text, never tokens
        self.chat_kwargs = {"add_generation_prompt": True, **(cfg.chat_template_kwargs or {}), "tokenize": False,
                            **({"chat_template": self.chat_template} if self.chat_template is not None else {})}
        self.chat = cfg.messages_column is not None or cfg.system_prompt is not None or cfg.chat_template is not None
        if cfg.template is not None and cfg.messages_column is None:
            _check_template(self.template)
        if tokenizer is None and (cfg.chat_template is not None or cfg.chat_template_kwargs):
            key = "dataset.chat_template" if cfg.chat_template is not None else "dataset.chat_template_kwargs"
            raise ConfigError([f"{key} is applied by a local tokenizer's apply_chat_template, and this job has none "
                               "(engine=openai with engine.endpoint=chat: the server renders the messages with its "
                               "own template); remove it, or set engine.tokenizer and engine.endpoint=completions"])
        if self.chat and self.chat_template is None and tokenizer is not None and \
                not getattr(tokenizer, "chat_template", None):
            key = "dataset.messages_column" if cfg.messages_column else "dataset.system_prompt"
            raise ConfigError([f"{key} asks for chat rendering, but the model's tokenizer has no chat template; "
                               "use a chat model, give one as dataset.chat_template, or use dataset.template / "
                               "dataset.prompt_column without dataset.system_prompt"])

    def required_columns(self) -> list[str]:
        if self.render_row is not None:
            return []  # the job's function reads what it reads; a missing column is its row's error
        if self.cfg.messages_column:
            return [self.cfg.messages_column]
        if self.cfg.template is not None:
            return []  # rows lacking a field become error rows; the whole-input check is in the planner
        return [self.cfg.prompt_column]

    def render(self, table: pa.Table) -> Rendered:
        rows = table.to_pylist()
        for name in [f.name for f in table.schema if is_json_text(f)]:  # mixed-type JSONL columns: their values
            for row, value in zip(rows, column_values(table, name)):
                row[name] = value
        texts: list[Optional[str]] = []
        errors: list[Optional[str]] = []
        messages: list[Optional[list[dict]]] = []
        for row in rows:
            text, error, chat = self._render_row(row)
            texts.append(text if error is None else None)
            errors.append(error)
            messages.append(chat if error is None else None)
        return Rendered(texts=texts, errors=errors, add_special_tokens=not self.chat, messages=messages)

    def _render_row(self, row: dict) -> tuple[Optional[str], Optional[str], Optional[list[dict]]]:
        if self.render_row is not None:
            try:
                value = self.render_row(row)
            except Exception as exc:  # the job's own code: one row's failure is that row's error
                return None, f"bad_render: {type(exc).__name__}: {exc}", None
            if isinstance(value, list):
                return self._chat(value)
            text, error = _check_prompt(value)
            return (self._chat([{"role": "user", "content": text}]) if error is None and self.chat
                    else (text, error, None))
        if self.cfg.messages_column:
            return self._chat(row.get(self.cfg.messages_column))
        text, error = self._plain(row)
        if error is None and self.chat:
            return self._chat([{"role": "user", "content": text}])
        return text, error, None

    def _plain(self, row: dict) -> tuple[Optional[str], Optional[str]]:
        if self.template is not None:
            return _format(self.template, row)
        return _check_prompt(row.get(self.cfg.prompt_column))

    def _chat(self, messages: Any) -> tuple[Optional[str], Optional[str], Optional[list[dict]]]:
        """The messages rendered by the chat template, the error, and the messages as rendered (system prompt in)."""
        if messages is None or (isinstance(messages, list) and not messages):
            return None, "empty_prompt", None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None, f"bad_messages: expected a list of {{role, content}}, got {type(messages).__name__}", None
        messages, why = _text_messages(messages)
        if why is not None:
            return None, f"bad_messages: {why}", None
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        if self.tokenizer is None:  # the server renders them with its own template
            return json.dumps(messages, ensure_ascii=False), None, messages
        try:
            with render_budget(self.cfg.render_timeout_s):
                text = self.tokenizer.apply_chat_template(messages, **self.chat_kwargs)
        except RenderBudgetExceeded as exc:  # a template looping for ever costs its row, never the job
            return None, f"bad_template: chat template: {exc}", None
        except Exception as exc:  # jinja errors from a user's template are row errors, not job failures
            return None, f"bad_template: chat template: {type(exc).__name__}: {exc}", None
        return (*_check_prompt(text), messages)


def _text_messages(messages: list[dict]) -> tuple[list[dict], Optional[str]]:
    """Each message as {role, content} with string content (a list of text parts joined, as OpenAI writes them:
    reader.messages.content_text), or why a message cannot be."""
    out = []
    for i, m in enumerate(messages):
        content, why = content_text(m.get("content"), f"messages[{i}].content")
        if why is not None or not isinstance(m.get("role"), str):
            return [], why or "every message needs a string role and string content"
        out.append({"role": m["role"], "content": content})
    return out, None


def chat_template_text(value: Optional[str]) -> Optional[str]:
    """dataset.chat_template as Jinja text. A value that names an existing file is that file's text, whatever its
    name ends in; any other value is the template's text, which has Jinja markers ({{ }}, {% %}): a value with
    none (a path to no file, a mistyped name) is refused, naming the key and the value, never rendered as every
    row's prompt."""
    if value is None:
        return None
    if os.path.isfile(value):
        return _read_template(value)
    if not any(mark in value for mark in JINJA_MARKS):
        raise ConfigError([_not_a_template(value)])
    return value


JINJA_MARKS = ("{{", "{%", "{#")


def _read_template(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"dataset.chat_template={path!r}: cannot read the template file "
                           f"({getattr(exc, 'strerror', None) or exc}); give a readable UTF-8 file or the "
                           "template's text"]) from None


def _not_a_template(value: str) -> str:
    """Why a dataset.chat_template that is no file and has no Jinja marker is refused, in the user's terms."""
    suffix = os.path.splitext(value)[1]
    if "\n" not in value and ("/" in value or os.sep in value or (1 < len(suffix) <= 11 and suffix[1:].isalnum())):
        return (f"dataset.chat_template={value!r}: cannot read the template file: no such file "
                f"({os.path.abspath(value)}); give the path of an existing template file (any name), or the "
                "template's Jinja text")
    return (f"dataset.chat_template={value!r} is neither an existing file nor a Jinja template (no {{{{ }}}}, "
            "{% %} or {# #} in it); give the path of an existing template file, or the template's text")


def _check_template(template: str) -> None:
    """A template fills row values in as text: a field inside a format spec (`{text:{width}}`) would make a row's
    value the spec (`>2000000000` asks for gigabytes), so the spec is written in the template itself."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError([f"dataset.template {template!r} is not a valid {{column}} template: {exc}"]) from exc
    nested = [f"{{{field}:{spec}}}" for _, field, spec, _ in parsed if spec and "{" in spec]
    if nested:
        raise ConfigError([f"dataset.template: {nested[0]} takes its format spec from a row's value; row values "
                           f"are data: write the spec in the template (e.g. {{{nested[0][1:].split(':')[0]}:>8}})"])


def _format(template: str, row: dict) -> tuple[Optional[str], Optional[str]]:
    for name in template_fields(template):
        if row.get(name) is None:
            return None, f"bad_template: field {name!r} is missing or null"
    try:
        return _check_prompt(template.format_map(row))
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        return None, f"bad_template: {type(exc).__name__}: {exc}"


def _check_prompt(value: Any) -> tuple[Optional[str], Optional[str]]:
    if value is None:
        return None, "empty_prompt"
    if not isinstance(value, str):
        return None, f"non_string_prompt: got {type(value).__name__}"
    if not value.strip():
        return None, "empty_prompt"
    return value, None
