"""No credential on disk or on screen: distinct secrets planted in every secret-bearing key (the API key, the base
URL's user, password and query, output.storage_options, output.catalog, engine.extra_body) never reach a file under
the output directory (parts, manifest, status, journals, `_logs/` with Hydra's saved config and the job's log, the
report) nor the console, though the endpoint echoes the request with its credential headers in a row's error and in
the error that stops the job; a key with a control character (a key file saved with CRLF) is refused at start."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.conftest import corpus, read_output, run_cli, write_jsonl
from tests.engines.endpoint.test_engine_openai import endpoint, overrides

KEY, USER, PASSWORD, QUERY = "sk-APIKEY-1a2b3c4d", "urluser-8b9c", "URLPASS-6f7a", "QUERYKEY-4d5e"
PLANTED = {"output.storage_options": ("S3SECRET-0d1e", "S3TOKEN-2f3a"),
           "output.catalog": ("CATTOKEN-4b5c", "CATCRED-6d7e", "ICEKEY-8f9a"), "engine.extra_body": ("XBODY-0b1c",)}
SECRETS = (KEY, USER, PASSWORD, QUERY, *(s for group in PLANTED.values() for s in group),
           base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode())
KEYS = ("output.storage_options={AWS_SECRET_ACCESS_KEY: S3SECRET-0d1e, AWS_SESSION_TOKEN: S3TOKEN-2f3a, "
        "AWS_REGION: eu-west-1}",
        "output.catalog={type: rest, uri: 'https://cat.example/api', token: CATTOKEN-4b5c, "
        "credential: 'client:CATCRED-6d7e', s3.secret-access-key: ICEKEY-8f9a}",
        "engine.extra_body={api_token: XBODY-0b1c, top_k: 5}")


def leaks(root: Path, *streams: str) -> list[tuple[str, str]]:
    """(secret, where) for every planted secret found in a file under `root` or in a console stream."""
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "batchgen.log" for p in files) and any(p.name == "config.yaml" for p in files)
    found = [(s, str(p.relative_to(root))) for p in files for s in SECRETS if s.encode() in p.read_bytes()]
    return found + [(s, f"console {i}") for i, text in enumerate(streams) for s in SECRETS if s in text]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Four rows, the third asking the server to answer 400 quoting the request (its credentials among it)."""
    rows = [{"id": f"r{i}", "prompt": p + (" ECHO:400" if i == 2 else "")} for i, p in enumerate(corpus(4, seed=9))]
    return write_jsonl(tmp_path_factory.mktemp("secrets") / "in.jsonl", rows)


def test_no_planted_secret_reaches_any_file_or_the_console(tiny_model, data, tmp_path):
    stopping = write_jsonl(tmp_path / "stop.jsonl", [{"id": "s0", "prompt": "quote me ECHO:401"}])
    with endpoint(tiny_model, log=tmp_path / "server.jsonl") as url:
        bearer = f'"{url}?key={QUERY}"'
        done = run_cli(overrides(tiny_model, data, tmp_path / "bearer", bearer, *KEYS,
                                 "engine.api_key_env=BATCHGEN_TEST_KEY"), env={"BATCHGEN_TEST_KEY": KEY})
        basic = f'"{url.replace("http://", f"http://{USER}:{PASSWORD}@")}?key={QUERY}"'
        stopped = run_cli(overrides(tiny_model, stopping, tmp_path / "basic", basic, *KEYS))
    report = run_cli(["report", str(tmp_path / "bearer")])
    assert done.returncode == 0, done.stderr
    sent = [json.loads(line) for line in (tmp_path / "server.jsonl").read_text().splitlines()]
    assert {r["auth"] for r in sent} == {f"Bearer {KEY}", "Basic " + SECRETS[-1]}  # every credential was used
    echoed = read_output(tmp_path / "bearer").to_pylist()[2]["error"]
    assert echoed.startswith("endpoint_rejected: HTTP 400: bad request to /v1/completions?key=***"), echoed
    assert "(authorization: Bearer ***)" in echoed and '"api_token": "***"' in echoed, echoed
    assert stopped.returncode == 2 and "HTTP 401" in stopped.stderr, stopped.stderr  # the server's text, masked
    status = json.loads((tmp_path / "basic" / "_status.json").read_text())
    assert status["state"] == "failed" and "authorization: Basic ***" in status["error"], status
    assert report.returncode == 0 and (tmp_path / "bearer" / "_report.html").exists(), report.stderr
    assert not leaks(tmp_path / "bearer", done.stdout, done.stderr, report.stdout, report.stderr)
    assert not leaks(tmp_path / "basic", stopped.stdout, stopped.stderr)


def test_a_key_with_a_carriage_return_is_refused_at_start_naming_the_variable_never_the_key(tiny_model, data,
                                                                                           tmp_path):
    refused = run_cli(overrides(tiny_model, data, tmp_path / "out", "http://127.0.0.1:9/v1",
                                "engine.api_key_env=BATCHGEN_TEST_KEY"), env={"BATCHGEN_TEST_KEY": KEY + "\r"})
    assert refused.returncode == 2, refused.stderr
    assert "engine.api_key_env=BATCHGEN_TEST_KEY" in refused.stderr and "carriage return" in refused.stderr
    assert "APIKEY" not in refused.stderr + refused.stdout and not (tmp_path / "out").exists()


def test_a_storage_option_catalog_or_extra_body_value_with_a_control_character_is_refused_never_shown(tiny_model,
                                                                                                     data, tmp_path):
    """A value read from a CRLF file (or with an escape) in output.storage_options, output.catalog or
    engine.extra_body: exit 2 before anything runs, each key named, no value on the console."""
    keys = ("output.storage_options={AWS_SECRET_ACCESS_KEY: \"S3SECRET-0d1e\r\", AWS_REGION: eu-west-1}",
            "output.catalog={type: rest, uri: 'https://cat.example/api', token: \"CATTOKEN-4b5c\x1b\"}",
            "engine.extra_body={api_token: \"XBODY-0b1c\r\n\", top_k: 5}")
    refused = run_cli(overrides(tiny_model, data, tmp_path / "out", "http://127.0.0.1:9/v1", *keys))
    said = refused.stdout + refused.stderr
    assert refused.returncode == 2, said
    assert "output.storage_options.AWS_SECRET_ACCESS_KEY holds a carriage return (\\r) at its end" in said, said
    assert "output.catalog.token holds a control character (0x1b) at character 14" in said, said
    assert "engine.extra_body.api_token holds a carriage return (\\r) at its end" in said, said
    assert not [s for s in ("S3SECRET", "CATTOKEN", "XBODY") if s in said] and not (tmp_path / "out").exists()
