"""OpenAI batch output (`output.format=openai_batch`): besides the Parquet parts, `_openai_batch_output.jsonl`, one
line per input row in the OpenAI Batch API's output format, which the `openai` client's types read:

    {"id": "batch_req_...", "custom_id": ROW_ID, "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": <a chat.completion or text_completion>}}

The body holds every sample of the row as a choice (index = sample_index), with finish_reason and usage token
counts. A row that could not be generated (an input error: too_long, bad_request...) gets status_code 400 and an
`{"error": {message, type, param, code}}` body, as OpenAI reports a failed request. The file is written whole, under
a temp name then renamed, once the output is complete (the job's last part, `batchgen finalize`, or a retry: then
from the latest-attempt view), so it always matches the parts. Knows the output layout, not engines.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchgen.constraints import INVALID
from batchgen.fsutil import replace_durably
from batchgen.output.manifest import read_manifest
from batchgen.output.rows.stats import error_kind
from batchgen.output.view import latest_batches

RESULTS = "_openai_batch_output.jsonl"
FORMATS = ("parquet", "openai_batch")
COLUMNS = ["id", "sample_index", "generation", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "error"]


def wanted(manifest: dict[str, Any]) -> bool:
    """Whether the job whose manifest this is asks for the OpenAI batch output."""
    return ((manifest.get("config") or {}).get("output") or {}).get("format") == "openai_batch"


def write_if_wanted(output_dir: Path) -> Path | None:
    """After the output became complete: its results file, where its job asked for one."""
    manifest = read_manifest(output_dir) or {}
    return write(output_dir, manifest) if wanted(manifest) else None


def write(output_dir: Path, manifest: dict[str, Any]) -> Path:
    """Write output_dir's results file from its latest-attempt view; returns its path. Chat or completions from the
    manifest's output config (the rendering the job used)."""
    config = manifest.get("output_config") or {}
    dataset = config.get("dataset") or {}
    chat = bool(dataset.get("messages_column") or dataset.get("system_prompt"))
    model = os.path.basename(str((config.get("engine") or {}).get("model", "")).rstrip("/")) or "batchgen"
    path = output_dir / RESULTS
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    created = int(time.time())
    try:
        seen: dict[str, int] = {}  # a custom_id's requests so far: a repeated one gets ids of its own
        with open(tmp, "w", encoding="utf-8") as f:
            for row_id, samples in _rows(output_dir):
                occurrence = seen[row_id] = seen.get(row_id, -1) + 1
                f.write(json.dumps(line(row_id, samples, chat=chat, model=model, created=created,
                                        occurrence=occurrence), ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        replace_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _rows(output_dir: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(id, its samples) per request, in output order: a row's samples are consecutive in every part and in the view
    and start at sample_index 0, which is what starts a row; the id alone would merge adjacent requests that share
    a custom_id (docs/output-and-resume.md "Duplicate ids") into one line."""
    current: list[dict[str, Any]] = []
    for table in latest_batches(output_dir, columns=COLUMNS):
        for sample in table.to_pylist():
            if current and (sample["sample_index"] == 0 or current[0]["id"] != sample["id"]):
                yield current[0]["id"], current
                current = []
            current.append(sample)
    if current:
        yield current[0]["id"], current


def line(row_id: str, samples: list[dict[str, Any]], *, chat: bool, model: str, created: int,
         occurrence: int = 0) -> dict[str, Any]:
    """One results line; `occurrence` > 0 for a later request with the same custom_id (its own response ids)."""
    key = row_id if occurrence == 0 else f"{row_id}\x00{occurrence}"
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
    out: dict[str, Any] = {"id": f"batch_req_{digest}", "custom_id": row_id, "error": None}
    failed = [s for s in samples if s["error"] is not None and error_kind(s["error"]) != INVALID]
    if failed:  # an input error: every sample of the row has it
        error = failed[0]["error"]
        kind, _, detail = error.partition(":")
        body: dict[str, Any] = {"error": {"message": detail.strip() or kind, "type": "invalid_request_error",
                                          "param": None, "code": kind}}
        out["response"] = {"status_code": 400, "request_id": f"req_{digest}", "body": body}
        return out
    completion = sum(s["num_generated_tokens"] for s in samples)
    prompt = samples[0]["num_prompt_tokens"]
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if chat:
        choices = [{"index": s["sample_index"], "finish_reason": s["finish_reason"], "logprobs": None,
                    "message": {"role": "assistant", "content": s["generation"]}} for s in samples]
        body = {"id": f"chatcmpl-{digest}", "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    else:
        choices = [{"index": s["sample_index"], "finish_reason": s["finish_reason"], "logprobs": None,
                    "text": s["generation"]} for s in samples]
        body = {"id": f"cmpl-{digest}", "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    out["response"] = {"status_code": 200, "request_id": f"req_{digest}", "body": body}
    return out
