"""reader/openai_batch.py: a Batch API request file's lines as rows of plain columns, `configure` pointing the
dataset.*_column keys at them by the file's endpoint, and a request batchgen cannot serve a bad_request error row
naming its line. (Whole jobs on such files: tests/scenarios/test_openai_batch.py.)"""

from __future__ import annotations

import json

import pyarrow as pa

from batchgen.reader import DatasetConfig, column_values, open_reader
from batchgen.reader.openai_batch import COLUMNS, OpenAIBatchReader, configure, endpoint_of
from tests.conftest import write_jsonl
from tests.reader.conftest import read_all

HI = [{"role": "user", "content": "hi"}]


def chat(cid, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": HI, **body}}


def batch_file(tmp_path, lines) -> DatasetConfig:
    cfg = DatasetConfig(path=str(write_jsonl(tmp_path / "batch.jsonl", lines)), format="openai_batch")
    assert configure(cfg) == []
    return cfg


def test_configure_points_the_unset_keys_at_the_request_columns_of_a_chat_file(tmp_path):
    cfg = DatasetConfig(path=str(write_jsonl(tmp_path / "b.jsonl", ["", chat("a")])), format="openai_batch",
                        temperature_column="mine")
    assert endpoint_of(cfg) == ("chat", [])  # blank lines before the first request are skipped
    assert configure(cfg) == []
    assert (cfg.messages_column, cfg.id_column, cfg.max_new_tokens_column) == ("messages", "custom_id", "max_tokens")
    assert cfg.temperature_column == "mine"  # set by the user: kept
    assert {key: getattr(cfg, key) for key in COLUMNS if key != "temperature_column"} == {
        key: column for key, column in COLUMNS.items() if key != "temperature_column"}


def test_configure_reads_prompts_from_a_completions_file(tmp_path):
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}
    cfg = DatasetConfig(path=str(write_jsonl(tmp_path / "c.jsonl", [line])), format="openai_batch",
                        prompt_column="text")
    assert endpoint_of(cfg) == ("completions", []) and configure(cfg) == []
    assert (cfg.prompt_column, cfg.messages_column, cfg.id_column) == ("prompt", None, "custom_id")


def test_configure_refuses_a_first_request_of_another_endpoint_and_a_template(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", ["", {"custom_id": "x", "url": "/v1/embeddings", "body": {}}])
    assert configure(DatasetConfig(path=str(path), format="openai_batch")) == [
        f"dataset.format=openai_batch: {path} line 2: url '/v1/embeddings' is not one of /v1/chat/completions, "
        f"/v1/completions (the first request decides the file's endpoint)"]
    ok = write_jsonl(tmp_path / "ok.jsonl", [chat("a")])
    cfg = DatasetConfig(path=str(ok), format="openai_batch", template="Q: {prompt}")
    (problem,) = configure(cfg)
    assert problem.startswith("dataset.template='Q: {prompt}' (set on the command line or by a preset")
    assert "leave the template unset (dataset.template=null)" in problem
    assert cfg.id_column is None and cfg.messages_column is None  # nothing pointed
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert endpoint_of(DatasetConfig(path=str(empty), format="openai_batch")) == ("chat", [])


def test_a_request_body_becomes_the_rows_columns(tmp_path):
    parts = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
             {"role": "user", "content": "q"}]
    cfg = batch_file(tmp_path, [
        chat("a", max_completion_tokens=5, stop="\n", temperature=0.5, top_p=0.9, seed=3, n=2, user="u",
             response_format={"type": "json_object"}, logit_bias={"7": 2, "3": -1}, presence_penalty=0.5,
             frequency_penalty=0.25, logprobs=False, stream=False, metadata={"k": "v"}),
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": parts}}])
    reader = open_reader(cfg)
    assert isinstance(reader, OpenAIBatchReader)
    assert set(reader.columns()) == {"custom_id", "messages", "max_tokens", "temperature", "top_p", "stop", "n",
                                     "seed", "response_format", "presence_penalty", "frequency_penalty",
                                     "logit_bias"}  # ignored keys (model, user, metadata) are no column
    ids, rows, errors = read_all(cfg)
    assert ids == ["a", "b"] and errors == [None, None]
    assert rows[0] | {"messages": None} == {
        "custom_id": "a", "messages": None, "max_tokens": 5, "stop": ["\n"], "temperature": 0.5, "top_p": 0.9,
        "seed": 3, "n": 2, "response_format": '{"type": "json_object"}', "logit_bias": '{"3": -1, "7": 2}',
        "presence_penalty": 0.5, "frequency_penalty": 0.25}
    assert rows[0]["messages"] == HI
    assert rows[1]["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]
    assert {k for k, v in rows[1].items() if v is not None} == {"custom_id", "messages"}  # unset: null


def test_every_setting_column_exists_even_where_no_request_sets_it(tmp_path):
    cfg = batch_file(tmp_path, [{"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "p"}}])
    reader = open_reader(cfg)
    schema = reader.schema()
    assert schema.names == ["custom_id", "prompt", "max_tokens", "temperature", "top_p", "stop", "n", "seed",
                            "response_format", "presence_penalty", "frequency_penalty", "logit_bias"]
    assert schema.field("max_tokens").type == pa.string()  # no value anywhere: a null column
    table = next(reader.iter_batches()).table
    assert table.column("prompt").to_pylist() == ["p"] and column_values(table, "max_tokens") == [None]


def test_a_request_batchgen_cannot_serve_is_a_bad_request_row_naming_its_line_and_key(tmp_path):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    cfg = batch_file(tmp_path, [
        chat("ok"),
        {"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": {"messages": HI}},
        chat("logprobs", logprobs=True),
        chat("unknown", frobnicate=1),
        "",
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": HI}},
        {"custom_id": "embed", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "body", "url": "/v1/chat/completions", "body": "hi"},
        {"custom_id": "empty", "url": "/v1/chat/completions", "body": {"model": "m"}},
        {"custom_id": "image", "url": "/v1/chat/completions", "body": {"messages": image}},
        {"custom_id": "prompt", "url": "/v1/completions", "body": {"prompt": "p"}},
        "[1, 2]",
    ])
    ids, rows, errors = read_all(cfg)
    assert ids == ["ok", "get", "logprobs", "unknown", "batch.jsonl:4", "embed", "body", "empty", "image", "prompt",
                   "batch.jsonl:10"]  # the id kept where the line has one; else generated
    assert errors == [
        None,
        "bad_request: line 2: method 'GET' is not POST",
        "bad_request: line 3: body.logprobs=true is not supported by batchgen",
        "bad_request: line 4: body.frobnicate is not a key batchgen knows for /v1/chat/completions",
        "bad_request: line 6: custom_id must be a non-empty string",
        "bad_request: line 7: url '/v1/embeddings' is not one of /v1/chat/completions, /v1/completions",
        "bad_request: line 8: body must be an object",
        "bad_request: line 9: body has no messages",
        "bad_request: line 10: image parts are not supported yet: body.messages[0].content[0] has type 'image_url'; "
        "give the message's text only (text parts or a string), or leave the row out",
        "bad_request: line 11: url /v1/completions differs from the file's endpoint (one endpoint per file, as "
        "OpenAI requires)",
        "malformed_json: line 12 (batch.jsonl:10): expected an object, got list",
    ]
    assert rows[0]["messages"] == HI and all(r["messages"] is None for r in rows[1:])  # nothing of a bad request


def test_a_completions_prompt_must_be_one_string(tmp_path):
    cfg = batch_file(tmp_path, [{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": ["p", "q"]}},
                                {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "r", "stop": "."}}])
    _, rows, errors = read_all(cfg)
    assert errors[0] == ("bad_request: line 1: body.prompt must be one string (a list of prompts or token ids is not "
                         "supported)")
    assert errors[1] is None and (rows[1]["prompt"], rows[1]["stop"]) == ("r", ["."])


def test_the_saved_pass_carries_the_files_endpoint(tmp_path):
    cfg = batch_file(tmp_path, [{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "p"}},
                                chat("b")])
    whole = open_reader(cfg)
    whole.stride = 1
    saved = json.loads(json.dumps(whole.index()))
    assert saved["endpoint"] == "completions" and saved["shape"]["format"] == "openai_batch"
    shard = open_reader(cfg)
    shard.stride = 1
    assert shard.use_index(saved) and shard.endpoint == "completions"
    (batch,) = shard.iter_range(1, 2)
    assert batch.ids == ["b"] and "differs from the file's endpoint" in batch.read_errors[0]
