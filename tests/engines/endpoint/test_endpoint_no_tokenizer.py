"""engine=openai without a local tokenizer (a hosted API's user has none): the chat endpoint's server renders the
messages and its usage gives the token counts, so every row is written with the server's counts (an answer without
usage: estimates from characters, logged); `batchgen plan` marks its token figures as estimates and does not stop on
run.too_long, which cannot be checked before sending; the completions endpoint, sent token ids, is refused naming
the keys. Against tests/endpoint_server.py on the tiny model."""

from __future__ import annotations

import json
import logging

import pytest

from batchgen.engines.base import estimate_tokens
from batchgen.errors import ConfigError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, write_jsonl
from tests.engines.endpoint.test_engine_openai import by_id, endpoint, overrides, rows

SYSTEM = "Answer briefly."
CHAT = (f"dataset.system_prompt={SYSTEM}", "engine.endpoint=chat")
NO_TOKENIZER = (*CHAT, "engine.tokenizer=null")


@pytest.fixture(scope="module")
def server(tiny_model):
    with endpoint(tiny_model) as url:
        yield url


def messages(prompt: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def test_a_chat_job_without_a_tokenizer_writes_every_row_with_the_servers_counts(tiny_model, tokenizer, server,
                                                                                tmp_path, caplog):
    asked = rows(6) + [{"id": "null", "prompt": "the old clock MANGLE:usage_null"}]  # r005 is rejected (HTTP 400)
    data = write_jsonl(tmp_path / "in.jsonl", asked)
    with caplog.at_level(logging.INFO, logger="batchgen.engines.endpoint"):
        summary = run_job(compose_job(overrides(tiny_model, data, tmp_path / "out", server, *NO_TOKENIZER)))
    run_job(compose_job(overrides(tiny_model, data, tmp_path / "ref", server, *CHAT)))  # with a tokenizer
    got, want = by_id(tmp_path / "out"), by_id(tmp_path / "ref")
    assert set(got) == {(r["id"], 0) for r in asked} and summary.totals.errors == {"endpoint_rejected": 1}
    assert "generated" in summary.render() and "(the server's usage counts: no engine.tokenizer)" in summary.render()
    rejected = got[("r005", 0)]
    assert rejected["error"].startswith("endpoint_rejected: HTTP 400") and rejected["generation"] is None
    for row in asked[:5]:
        key, text = (row["id"], 0), tokenizer.apply_chat_template(messages(row["prompt"]), add_generation_prompt=True,
                                                                  tokenize=False)
        assert got[key]["num_prompt_tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"])
        same = ("generation", "finish_reason", "num_prompt_tokens", "num_generated_tokens")
        assert [got[key][k] for k in same] == [want[key][k] for k in same], key
    unsaid = got[("null", 0)]  # the server sent no usage: estimates from characters, said once in the log
    assert unsaid["generation"] and unsaid["num_generated_tokens"] == estimate_tokens(unsaid["generation"])
    assert unsaid["num_prompt_tokens"] == estimate_tokens(json.dumps(messages(asked[-1]["prompt"])))
    said = [r.getMessage() for r in caplog.records]
    assert any("no engine.tokenizer: the token counts" in m and "are the server's usage" in m for m in said), said
    assert sum("without usage token counts" in m for m in said) == 1, said


def test_plan_without_a_tokenizer_estimates_and_the_probe_sends_the_messages(tiny_model, server, tmp_path, capsys):
    from batchgen.commands.compose import compose_checked
    from batchgen.commands.plan import main

    data = write_jsonl(tmp_path / "in.jsonl", rows(3, rejected=()) + [{"id": "long", "prompt": "word " * 300}])
    out = tmp_path / "plan"
    args = overrides(tiny_model, data, out, server, *NO_TOKENIZER, "engine.max_model_len=64", "run.too_long=fail")
    assert main(["--show", "1", "--calibrate", *args], compose_checked) == 0  # the job would send the long row too
    printed = capsys.readouterr().out
    plan = json.loads((out / "_plan.json").read_text())
    first = json.dumps(messages(rows(1)[0]["prompt"]), ensure_ascii=False)
    assert plan["prompt_tokens_estimated"] and plan["shown"][0]["prompt"] == first
    assert plan["shown"][0]["prompt_tokens"] == estimate_tokens(first) and plan["too_long"]["rows"] == 1
    assert "run.too_long is not checked before sending" in plan["too_long"]["what_happens"]
    assert f"about {estimate_tokens(first)} prompt tokens (estimated from characters" in printed
    assert plan["calibration"]["probe_rows"] == 4 and plan["calibration"]["probe_tok_s"] > 0


def test_the_completions_endpoint_without_a_tokenizer_is_refused_naming_the_keys(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", rows(2, rejected=()))
    with pytest.raises(ConfigError) as refused:
        run_job(compose_job(overrides(tiny_model, data, tmp_path / "out", "http://127.0.0.1:9/v1",
                                      "engine.tokenizer=null")))
    assert "engine.endpoint=completions needs engine.tokenizer" in str(refused.value)
    assert "or engine.endpoint=chat" in str(refused.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["dataset.chat_template=own.jinja", "dataset.chat_template_kwargs={a: 1}"])
@pytest.mark.parametrize("tokenizer", ["local", "none"])
def test_a_local_chat_template_or_its_variables_with_the_chat_endpoint_are_refused(tiny_model, tmp_path, key,
                                                                                   tokenizer):
    """The chat endpoint's server renders the messages with its own template: a job's template or template
    variables would be silently ignored, so the job stops before writing, naming the key and the way out."""
    data = write_jsonl(tmp_path / "in.jsonl", rows(2, rejected=()))
    (tmp_path / "own.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    key = key.replace("own.jinja", str(tmp_path / "own.jinja"))
    extra = (*CHAT, key) + (("engine.tokenizer=null",) if tokenizer == "none" else ())
    with pytest.raises(ConfigError) as refused:
        run_job(compose_job(overrides(tiny_model, data, tmp_path / "out", "http://127.0.0.1:9/v1", *extra)))
    assert f"{key.split('=')[0]}: with engine.endpoint=chat the server renders" in str(refused.value)
    assert "engine.endpoint=completions" in str(refused.value) and not (tmp_path / "out").exists()
