"""OpenAI batch JSONL: a request file in the official format (custom_id, method, url, body with response_format) in,
the Parquet parts and `_openai_batch_output.jsonl` out; every output line parses with the `openai` package's types,
and each body's settings (max_tokens, temperature, top_p, stop, n, seed, the penalties, logit_bias, response_format)
apply to its row. The tests of the bodies' sampling settings and response_format run the hf engine (engine=dummy
ignores temperature and top_p and has no constraints); the endpoint, bad-line, refusal and retry tests run
engine=dummy."""

from __future__ import annotations

import json

import jsonschema
import pytest

from batchgen.output.openai_out import RESULTS
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, dummy_overrides, job_overrides, read_output, run_cli, write_jsonl

TICKET = {"type": "object",
          "properties": {"label": {"enum": ["bug", "billing", "other"]}, "urgent": {"type": "boolean"}},
          "required": ["label", "urgent"], "additionalProperties": False}
TEXTS = corpus(12, seed=5)


def chat(cid: str, text: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "system", "content": "You label tickets."},
                                                          {"role": "user", "content": text}], **body}}


def requests() -> list[dict]:
    rf = {"type": "json_schema", "json_schema": {"name": "ticket", "strict": True, "schema": TICKET}}
    return [
        chat("greedy-0", TEXTS[0], max_tokens=6, temperature=0),
        chat("schema-1", TEXTS[1], max_tokens=40, temperature=0, response_format=rf),
        chat("schema-2", TEXTS[2], max_completion_tokens=40, temperature=0, response_format=rf),
        chat("object-3", TEXTS[3], max_tokens=40, temperature=0, response_format={"type": "json_object"}),
        chat("sampled-4", TEXTS[4], max_tokens=8, temperature=0.9, top_p=0.8, n=3, seed=42),
        chat("sampled-5", TEXTS[4], max_tokens=8, temperature=0.9, top_p=0.8, n=3, seed=42),  # the same: same draws
        chat("sampled-6", TEXTS[4], max_tokens=8, temperature=0.9, top_p=0.8, n=3, seed=43),
        chat("parts-7", [{"type": "text", "text": TEXTS[7]}], max_tokens=5, stop="\n"),
        chat("tools-8", TEXTS[8], max_tokens=5, tools=[{"type": "function", "function": {"name": "f"}}]),
        chat("text-9", TEXTS[9], max_tokens=5, temperature=0, response_format={"type": "text"}),
    ]


def run(tiny_model, tmp_path, lines, *extra, overrides=job_overrides):
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out"
    summary = run_job(compose_job(overrides(tiny_model, data, out, "dataset.format=openai_batch",
                                            "output.format=openai_batch", "sampling.max_new_tokens=64", *extra)))
    return summary, out


def test_an_official_batch_file_round_trips_and_every_line_parses_with_the_openai_types(tiny_model, tmp_path):
    from openai.types import BatchError
    from openai.types.chat import ChatCompletion

    summary, out = run(tiny_model, tmp_path, requests())
    assert summary.state == "done"
    lines = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [r["custom_id"] for r in requests()]  # one line per request, in order
    by_id = {x["custom_id"]: x for x in lines}
    for x in lines:
        assert set(x) == {"id", "custom_id", "response", "error"} and x["error"] is None
        if x["response"]["status_code"] == 200:
            completion = ChatCompletion.model_validate(x["response"]["body"])
            assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
            assert all(c.message.role == "assistant" for c in completion.choices)
    # the unsupported request is its own 400, naming the key; nothing else is lost
    failed = by_id["tools-8"]["response"]
    assert failed["status_code"] == 400 and failed["body"]["error"]["code"] == "bad_request"
    assert "body.tools" in failed["body"]["error"]["message"]
    BatchError.model_validate(failed["body"]["error"])
    # per-request settings
    body = lambda cid: ChatCompletion.model_validate(by_id[cid]["response"]["body"])  # noqa: E731
    assert body("greedy-0").usage.completion_tokens <= 6
    for cid in ("schema-1", "schema-2"):  # response_format json_schema: the schema holds
        jsonschema.validate(json.loads(body(cid).choices[0].message.content), TICKET)
    obj = body("object-3").choices[0]  # json_object is unbounded: a random model may run out of max_tokens
    assert obj.message.content.startswith("{") and (obj.finish_reason == "length" or isinstance(
        json.loads(obj.message.content), dict))
    sampled = [[c.message.content for c in body(cid).choices] for cid in ("sampled-4", "sampled-5", "sampled-6")]
    assert [len(s) for s in sampled] == [3, 3, 3] and [c.index for c in body("sampled-4").choices] == [0, 1, 2]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]  # the body's seed, not the job's
    assert "\n" not in body("parts-7").choices[0].message.content
    # the Parquet parts hold the same rows: one per sample, n from each body
    rows = read_output(out).to_pylist()
    assert len(rows) == 1 + 1 + 1 + 1 + 3 + 3 + 3 + 1 + 1 + 1
    assert {r["id"] for r in rows if r["error"] and r["error"].startswith("bad_request")} == {"tools-8"}
    parsed = [r for r in rows if r["id"] in ("schema-1", "schema-2")]
    assert all(r["parsed"] is not None and r["error"] is None for r in parsed)
    assert [r["parsed"] for r in rows if r["id"] == "text-9"] == [None]  # type text: unconstrained


def test_greedy_settings_from_the_body_equal_the_same_settings_from_the_config(tiny_model, tmp_path):
    """max_tokens and temperature taken from each body give what the job's own keys give."""
    lines = [chat(f"r{i}", t, max_tokens=7, temperature=0) for i, t in enumerate(TEXTS[:6])]
    _, out = run(tiny_model, tmp_path, lines)
    from_body = [r["generation"] for r in read_output(out).to_pylist()]
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"messages": line["body"]["messages"]} for line in lines])
    run_job(compose_job(job_overrides(tiny_model, plain, tmp_path / "ref", "dataset.messages_column=messages",
                                      "sampling.max_new_tokens=7")))
    assert from_body == [r["generation"] for r in read_output(tmp_path / "ref").to_pylist()]


def test_penalties_and_logit_bias_from_the_body_equal_the_same_settings_from_the_config(tiny_model, tmp_path):
    """OpenAI's presence_penalty, frequency_penalty and logit_bias (string token ids, as JSON has them) apply to
    their rows as sampling.* keys would."""
    body = dict(max_tokens=10, temperature=0, presence_penalty=1.5, frequency_penalty=0.5, logit_bias={"5": 3})
    lines = [chat(f"r{i}", t, **body) for i, t in enumerate(TEXTS[:3])]
    _, out = run(tiny_model, tmp_path, lines)
    from_body = [r["generation"] for r in read_output(out).to_pylist()]
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"messages": line["body"]["messages"]} for line in lines])
    keys = ("sampling.presence_penalty=1.5", "sampling.frequency_penalty=0.5", "sampling.logit_bias={5: 3}")
    for name, extra in (("ref", keys), ("off", ())):
        run_job(compose_job(job_overrides(tiny_model, plain, tmp_path / name, "dataset.messages_column=messages",
                                          "sampling.max_new_tokens=10", *extra)))
    assert from_body == [r["generation"] for r in read_output(tmp_path / "ref").to_pylist()]
    assert from_body != [r["generation"] for r in read_output(tmp_path / "off").to_pylist()]


def test_completions_bodies_and_bad_lines(tiny_model, tmp_path):
    from openai.types import Completion

    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": t, "max_tokens": 5, "temperature": 0}} for i, t in enumerate(TEXTS[:4])]
    lines[2] = {"custom_id": "c2", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}
    lines.append("{not json")
    summary, out = run(tiny_model, tmp_path, lines, overrides=dummy_overrides)
    results = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    assert [x["response"]["status_code"] for x in results] == [200, 200, 400, 200, 400]
    assert "differs from the file's endpoint" in results[2]["response"]["body"]["error"]["message"]
    assert results[4]["response"]["body"]["error"]["code"] == "malformed_json"
    for x in results:
        if x["response"]["status_code"] == 200:
            done = Completion.model_validate(x["response"]["body"])
            assert done.object == "text_completion" and done.choices[0].text and done.usage.completion_tokens <= 5


def test_a_bad_output_format_and_a_template_are_refused(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "b.jsonl", requests()[:1])
    bad = run_cli(dummy_overrides(tiny_model, data, tmp_path / "o", "dataset.format=openai_batch",
                                  "output.format=csv"))
    assert bad.returncode == 2 and "output.format must be parquet or openai_batch" in bad.stderr
    with pytest.raises(Exception, match=r"dataset.template=.* with dataset.format=openai_batch: each request carries"):
        compose_job(dummy_overrides(tiny_model, data, tmp_path / "o", "dataset.format=openai_batch",
                                    "dataset.template='Q: {prompt}'"))


def test_a_retry_of_an_openai_batch_job_rewrites_its_results_file(tiny_model, tmp_path):
    lines = [chat(f"r{i}", t * (8 if i % 3 == 0 else 1), max_tokens=6, temperature=0) for i, t in enumerate(TEXTS)]
    _, out = run(tiny_model, tmp_path, lines, "run.too_long=skip", "engine.max_model_len=96",
                 "run.max_error_rate=0.9", overrides=dummy_overrides)
    codes = [json.loads(x)["response"]["status_code"] for x in (out / RESULTS).read_text().splitlines()]
    assert 400 in codes
    done = run_cli(["retry", str(out), "--kinds", "too_long", "run.too_long=truncate_left"])
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(x) for x in (out / RESULTS).read_text().splitlines()]
    assert [x["custom_id"] for x in results] == [f"r{i}" for i in range(len(TEXTS))]
    assert all(x["response"]["status_code"] == 200 for x in results)  # the latest attempts, every request answered
