"""OpenAI batch input (`dataset.format=openai_batch`): the JSONL request file of OpenAI's Batch API (and of vLLM's
`run-batch`), one `{custom_id, method, url, body}` request per line.

Each line becomes one row of plain columns that the rest of batchgen already reads: `custom_id` (the row id),
`messages` (a /v1/chat/completions body) or `prompt` (a /v1/completions body), and the body's per-request settings
as per-row columns: `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`, `stop`, `n`, `seed`,
`presence_penalty`, `frequency_penalty`, `logit_bias` (JSON text) and `response_format` (JSON text; mapped to a
JSON-schema constraint). `configure` points the dataset.*_column keys at them. A file holds one endpoint, as OpenAI
requires: its first request's url decides chat or completions.

A line that is not such a request, or whose body asks for what batchgen does not do (tools, logprobs, streaming), or
whose message has a role the API does not have, is a `bad_request` error row naming the line and the key, never a
silently different generation. Keys that do not change the output (`model`, `user`, `metadata`,
`store`, `service_tier`) are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Optional

import pyarrow as pa

from batchgen.reader.config import DatasetConfig
from batchgen.reader.jsonl import JsonlReader, _parse_line
from batchgen.reader.messages import content_text

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
SETTINGS = ("max_tokens", "temperature", "top_p", "stop", "n", "seed", "response_format", "presence_penalty",
            "frequency_penalty", "logit_bias")
AS_JSON = ("response_format", "logit_bias")  # objects kept as JSON text: one string column whatever their keys
IGNORED = ("model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls")
# allowed only at these values: any other would change what is generated
NEUTRAL = {"logprobs": False, "stream": False, "echo": False, "best_of": 1, "suffix": None, "tools": None,
           "tool_choice": None, "functions": None, "top_logprobs": None}
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # the API's: it answers any other with a 400
COLUMNS = {"id_column": "custom_id", "max_new_tokens_column": "max_tokens", "temperature_column": "temperature",
           "top_p_column": "top_p", "stop_column": "stop", "n_column": "n", "seed_column": "seed",
           "response_format_column": "response_format", "presence_penalty_column": "presence_penalty",
           "frequency_penalty_column": "frequency_penalty", "logit_bias_column": "logit_bias"}


def endpoint_of(cfg: DatasetConfig) -> tuple[Optional[str], list[str]]:
    """The file's endpoint ("chat" or "completions") from its first request, or the problem reading it."""
    from batchgen.reader.files import resolve_files

    try:
        _, files, fs, _ = resolve_files(cfg)
    except Exception as exc:  # the path problems are reported by DatasetConfig.problems
        said = str(exc)
        return None, [said if said.startswith("dataset.path") else f"dataset.path: {said}"]
    for path in files:
        with fs.open(path, "rb", compression="infer") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                record, _ = _parse_line(raw, f"line {lineno}")
                url = record.get("url") if isinstance(record, dict) else None
                if url in ENDPOINTS:
                    return ENDPOINTS[url], []
                return None, [f"dataset.format=openai_batch: {path} line {lineno}: url {url!r} is not one of "
                              f"{', '.join(ENDPOINTS)} (the first request decides the file's endpoint)"]
    return "chat", []  # an empty input: nothing to render either way


def configure(cfg: DatasetConfig) -> list[str]:
    """Point the dataset.*_column keys the user left unset at the request's columns, by the file's endpoint."""
    if cfg.template is not None:  # before the columns are pointed: the template is the one key in the way
        return [f"dataset.template={cfg.template!r} (set on the command line or by a preset such as job=demo) with "
                f"dataset.format=openai_batch: each request carries its own prompt or messages; leave the template "
                f"unset (dataset.template=null), or run without the preset"]
    endpoint, problems = endpoint_of(cfg)
    if problems:
        return problems
    for key, column in COLUMNS.items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, column)
    if endpoint == "chat":
        cfg.messages_column = cfg.messages_column or "messages"
    else:
        cfg.prompt_column = "prompt"
    return []


class OpenAIBatchReader(JsonlReader):
    """JSONL lines of requests, each turned into a row of plain columns (module doc) before typing and batching."""

    format = "openai_batch"  # its saved pass holds the requests' columns, not the lines' (JsonlReader.shape)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.endpoint: Optional[str] = None

    def index(self) -> dict[str, Any]:
        """The pass's result and the file's endpoint (its first request's), which judges every line."""
        return super().index() | {"endpoint": self.endpoint}  # super().index() runs the pass, which sets it

    def use_index(self, saved: dict[str, Any]) -> bool:
        """A saved pass and its endpoint: a shard that starts mid-file judges its lines by the file's first request,
        as the pass did, not by its own first line."""
        if not super().use_index(saved):
            return False
        self.endpoint = saved.get("endpoint")
        return True

    def schema(self) -> pa.Schema:
        """The requests' columns, each one present even where no request sets it (a null column)."""
        if self._schema is None:
            schema = super().schema()
            for name in ("custom_id", *SETTINGS):
                if name not in schema.names:
                    schema = schema.append(pa.field(name, pa.string()))
            self._schema = schema
        return self._schema

    def _records(self, path: str, offset: int = 0, lineno: int = 0, row: int = 0
                 ) -> Iterator[tuple[int, Optional[dict], Optional[str], int]]:
        for number, record, error, start in super()._records(path, offset, lineno, row):
            if record is not None:
                record, error = self._request(record, number)
            yield number, record, error, start

    def _request(self, line: dict[str, Any], lineno: int) -> tuple[Optional[dict], Optional[str]]:
        def bad(why: str) -> tuple[Optional[dict], Optional[str]]:
            # the id is kept where there is one, so that the error row maps back to its request
            cid = line.get("custom_id")
            return ({"custom_id": cid} if isinstance(cid, str) and cid else None), f"bad_request: line {lineno}: {why}"

        cid, url, body = line.get("custom_id"), line.get("url"), line.get("body")
        if not isinstance(cid, str) or not cid:
            return bad("custom_id must be a non-empty string")
        if line.get("method", "POST") != "POST":
            return bad(f"method {line.get('method')!r} is not POST")
        kind = ENDPOINTS.get(url)
        if kind is None:
            return bad(f"url {url!r} is not one of {', '.join(ENDPOINTS)}")
        self.endpoint = self.endpoint or kind
        if kind != self.endpoint:
            return bad(f"url {url} differs from the file's endpoint (one endpoint per file, as OpenAI requires)")
        if not isinstance(body, dict):
            return bad("body must be an object")
        row, why = _body(body, kind, url)
        if why is not None:
            return bad(why)
        return {"custom_id": cid, **row}, None


def _body(body: dict[str, Any], kind: str, url: str) -> tuple[dict[str, Any], Optional[str]]:
    """A request body as the row's columns, or why batchgen cannot serve it."""
    row: dict[str, Any] = {}
    for key, value in body.items():
        if key in IGNORED:
            continue
        if key in NEUTRAL:
            if value != NEUTRAL[key] and value is not None:
                return row, f"body.{key}={json.dumps(value)[:60]} is not supported by batchgen"
            continue
        key = "max_tokens" if key == "max_completion_tokens" else key
        if key == "messages" and kind == "chat":
            messages = _messages(value)
            if isinstance(messages, str):
                return row, messages
            row[key] = messages
        elif key == "prompt" and kind == "completions":
            if not isinstance(value, str):
                return row, "body.prompt must be one string (a list of prompts or token ids is not supported)"
            row[key] = value
        elif key in SETTINGS:
            row[key] = json.dumps(value, sort_keys=True) if key in AS_JSON else value
        else:
            return row, f"body.{key} is not a key batchgen knows for {url}"
    if "messages" not in row and "prompt" not in row:
        return row, f"body has no {'messages' if kind == 'chat' else 'prompt'}"
    if isinstance(row.get("stop"), str):
        row["stop"] = [row["stop"]]
    return row, None


def _messages(value: Any) -> list[dict[str, Any]] | str:
    """Chat messages with string content: a content given as text parts joined (messages.content_text); else why
    not."""
    if not isinstance(value, list):
        return "body.messages must be a list"
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"body.messages[{i}] must be an object"
        if m.get("role") not in ROLES:  # a made-up role would render as a turn of its own in the chat template
            return f"body.messages[{i}].role {json.dumps(m.get('role'))[:60]} is not one of {', '.join(ROLES)}"
        content = m.get("content")
        if isinstance(content, list):
            content, why = content_text(content, f"body.messages[{i}].content")
            if why is not None:
                return why
        out.append({"role": m.get("role"), "content": content})
    return out
