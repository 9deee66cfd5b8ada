"""engine=openai against a server that lies (tests/endpoint_server.py's MANGLE:KIND prompts and --models): a usage
that is not a count, two choices, a choice of another index, token ids outside the vocabulary cost their row (an
error row naming what was wrong) and never a wrong row or a wedged job; a null usage is batchgen's own count; a
/models answer that is not a model list is exit 2 naming engine.base_url; and credentials in engine.base_url reach
the server on every request and no file of the output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen.engines.endpoint.engine import EndpointError
from batchgen.errors import ConfigError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, run_cli, write_jsonl
from tests.engines.endpoint.test_engine_openai import by_id, endpoint, overrides

LIES = {1: "usage_str", 3: "usage_huge", 5: "usage_negative", 7: "two_choices", 9: "bad_index", 11: "bad_ids"}
WHY = {"usage_str": "usage prompt_tokens='", "usage_huge": "usage completion_tokens=1099511627776",
       "usage_negative": "usage prompt_tokens=-5", "two_choices": "2 choices for a request of n=1",
       "bad_index": "a choice of index 9", "bad_ids": "token id 1000000000 is not one of the tokenizer's"}
NULL_USAGE = 13


def lying_rows() -> list[dict]:
    marks = LIES | {NULL_USAGE: "usage_null"}
    return [{"id": f"r{i:03d}", "prompt": p + (f" MANGLE:{marks[i]}" if i in marks else "")}
            for i, p in enumerate(corpus(16, seed=5))]


def honest_rows(n: int) -> list[dict]:
    return [{"id": f"r{i:03d}", "prompt": p} for i, p in enumerate(corpus(n, seed=5))]


CHAT = ("dataset.system_prompt=Answer briefly.", "engine.endpoint=chat")


@pytest.mark.parametrize("chat", [(), CHAT], ids=["completions", "chat"])
def test_an_answer_that_lies_costs_its_row_and_names_why_and_a_null_usage_is_counted_here(tiny_model, tmp_path,
                                                                                          chat):
    data = write_jsonl(tmp_path / "in.jsonl", lying_rows())
    reference = tmp_path / "ref"
    run_job(compose_job(overrides(tiny_model, data, reference, None, *chat[:1])))
    with endpoint(tiny_model, log=tmp_path / "server.jsonl") as url:
        out = tmp_path / "out"
        summary = run_job(compose_job(overrides(tiny_model, data, out, url, "engine.max_retries=2",
                                                "engine.max_concurrency=2", *chat)))
    assert summary.state == "done"
    want, got = by_id(reference), by_id(out)
    assert set(got) == set(want)
    for (row_id, sample), row in got.items():
        index = int(row_id[1:])
        if index in LIES:  # never the lie's text, never an empty generation: an error row saying why
            assert row["finish_reason"] == "error" and row["generation"] is None, row
            assert row["error"].startswith("endpoint_failed: 3 attempts"), row["error"]
            assert WHY[LIES[index]] in row["error"], row["error"]
        else:
            same = ("generation", "finish_reason", "num_prompt_tokens", "num_generated_tokens")
            assert [row[k] for k in same] == [want[row_id, sample][k] for k in same], row_id
    assert sum(1 for r in got.values() if r["error"]) == len(LIES)


@pytest.mark.parametrize("answer,said", [("html", "text/html: '<html><body>Sign in to the gateway"),
                                         ("not_list", "application/json: '[1, 2]'"),
                                         ("str_items", "'{\"data\": [\"tiny\"]}'"),
                                         ("bad_len", "max_model_len='lots'")])
def test_a_models_answer_that_is_not_a_model_list_is_exit_2_naming_base_url(tiny_model, tmp_path, answer, said):
    data = write_jsonl(tmp_path / "in.jsonl", honest_rows(2))
    with endpoint(tiny_model, "--models", answer) as url:
        with pytest.raises(EndpointError) as raised:
            run_job(compose_job(overrides(tiny_model, data, tmp_path / "out", url)))
        assert raised.value.exit_code == 2
        assert f"engine.base_url={url}" in str(raised.value) and said in str(raised.value), str(raised.value)
        if answer == "bad_len":  # engine.max_model_len stands in for a length the server does not say right
            summary = run_job(compose_job(overrides(tiny_model, data, tmp_path / "out2", url,
                                                    "engine.max_model_len=256")))
            assert summary.state == "done"
        if answer == "html":  # the command line and `batchgen plan`: exit 2 and one line, no traceback
            for command in ([], ["plan"]):
                done = run_cli([*command, *overrides(tiny_model, data, tmp_path / "cli", url)])
                assert done.returncode == 2, done.stderr
                assert "Traceback" not in done.stderr and f"engine.base_url={url}" in done.stderr, done.stderr


def every_file(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_credentials_in_base_url_reach_the_server_on_every_request_and_no_file(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", honest_rows(4))
    server_log, out = tmp_path / "server.jsonl", tmp_path / "out"
    with endpoint(tiny_model, log=server_log) as url:
        secret_url = url.replace("http://", "http://alice:PASSWORD1@") + "?api_key=QUERYKEY2&region=eu"
        unquoted = run_cli(overrides(tiny_model, data, out, secret_url))  # `&` is Hydra's: refused, not echoed
        assert unquoted.returncode == 2 and "engine.base_url" in unquoted.stderr, unquoted.stderr
        quoted = f'"{secret_url}"'
        done = run_cli(overrides(tiny_model, data, out, quoted))
        assert done.returncode == 0, done.stderr
        both = run_cli(overrides(tiny_model, data, tmp_path / "refused", quoted, "engine.api_key_env=HOME"))
    down = run_cli(overrides(tiny_model, data, tmp_path / "down", quoted, "engine.max_retries=0"))
    requests = [json.loads(line) for line in server_log.read_text().splitlines()]
    assert requests and all("api_key=QUERYKEY2&region=eu" in r["path"] for r in requests)
    assert all(r["auth"].startswith("Basic ") for r in requests)  # the URL's user and password, as Basic auth
    assert both.returncode == 2 and "drop one of them" in both.stderr, both.stderr
    assert down.returncode == 1, down.stderr  # the server is gone: the job stops, its error written down
    status = json.loads((tmp_path / "down" / "_status.json").read_text())
    assert status["state"] == "failed" and "engine.base_url=http://127.0.0.1" in status["error"], status
    files = every_file(out) + every_file(tmp_path / "down")
    assert any(p.name == "config.yaml" for p in files) and any(p.name == "batchgen.log" for p in files)
    assert any(p.name == "_manifest.json" for p in files) and any(p.name.startswith("_status") for p in files)
    for secret in ("PASSWORD1", "QUERYKEY2", "alice"):
        leaked = [str(p.relative_to(tmp_path)) for p in files if secret.encode() in p.read_bytes()]
        assert not leaked, (secret, leaked)
        for stream in (unquoted.stderr, done.stdout, done.stderr, both.stderr, down.stderr):
            assert secret not in stream


def test_userinfo_beside_a_bearer_key_is_refused_without_showing_the_password(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_TEST_KEY", "sk-test")
    data = write_jsonl(tmp_path / "in.jsonl", honest_rows(2))
    with pytest.raises(ConfigError) as raised:
        compose_job(overrides(tiny_model, data, tmp_path / "out", "http://bob:HUNTER2@127.0.0.1:9/v1",
                              "engine.api_key_env=BATCHGEN_TEST_KEY")).validate()
    assert "drop one of them" in str(raised.value) and "HUNTER2" not in str(raised.value)
