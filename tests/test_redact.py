"""redact.py: one rule for every secret batchgen knows, masked in every text it stores or prints: a server's text
that echoes a request (its bearer token, credential headers, `key=` values), the values under secret names, and the
secret values a config holds, verbatim wherever they appear; control characters named, never quoted."""

from __future__ import annotations

import pytest

from batchgen.redact import MASK, control_character, redact, redact_text, remember_secrets, secret_name


def test_a_server_error_echoing_the_request_keeps_no_credential_and_still_says_what_happened():
    echoed = ("endpoint_rejected: HTTP 400: bad request to /v1/completions?key=QK-echo-11&region=eu "
              "(authorization: Bearer sk-echo-22abcdef) x-api-key: XK-echo-33 api-key=AK-echo-44 "
              "token=TK-echo-55; password=PW-echo-66 {\"api_token\": \"BT-echo-77\", \"n\": 1} "
              "{'client_secret': 'CS-echo-88'} retried with bearer sk-echo-99abcdef")
    clean = redact_text(echoed)
    for secret in ("QK-echo-11", "sk-echo-22", "XK-echo-33", "AK-echo-44", "TK-echo-55", "PW-echo-66", "BT-echo-77",
                   "CS-echo-88", "sk-echo-99"):
        assert secret not in clean, (secret, clean)
    for kept in ("endpoint_rejected: HTTP 400: bad request to /v1/completions?key=***", "region=eu",
                 "(authorization: Bearer ***)", "\"n\": 1"):
        assert kept in clean, (kept, clean)


def test_what_only_looks_like_a_secret_is_kept():
    text = ("sampling.max_new_tokens=12 engine.api_key_env=OPENAI_API_KEY sampling.stop_token_ids=[2] "
            "a Bearer key: drop one of them; the key 'x' of logit_bias")
    assert redact_text(text) == text


@pytest.mark.parametrize("name", ["AWS_SECRET_ACCESS_KEY", "s3.secret-access-key", "token", "credential", "apiKey",
                                  "aws_session_token", "X-Amz-Signature", "password", "authorization", "key"])
def test_secret_names(name):
    assert secret_name(name)


@pytest.mark.parametrize("name", ["max_tokens", "api_key_env", "token_ids", "tokenizer", "id_column", "AWS_REGION",
                                  "s3.endpoint", "uri", "warehouse", "type"])
def test_names_that_are_not_secret(name):
    assert not secret_name(name)


def test_values_under_secret_names_are_masked_in_a_json_like_value_and_the_rest_kept():
    config = {"output": {"storage_options": {"AWS_SECRET_ACCESS_KEY": "S3-SECRET", "AWS_REGION": "eu-west-1"},
                         "catalog": {"type": "rest", "token": "CAT-TOKEN", "s3.secret-access-key": "ICE-KEY"}},
              "engine": {"extra_body": {"api_token": 12345678, "top_k": 5, "auth": {"user": "u", "session": "S"}},
                         "api_key_env": "OPENAI_API_KEY"},
              "sampling": {"json_schema": {"properties": {"token": {"type": "string"}}}, "max_tokens": 9}}
    got = redact(config)
    assert got["output"]["storage_options"] == {"AWS_SECRET_ACCESS_KEY": MASK, "AWS_REGION": "eu-west-1"}
    assert got["output"]["catalog"] == {"type": "rest", "token": MASK, "s3.secret-access-key": MASK}
    assert got["engine"]["extra_body"] == {"api_token": MASK, "top_k": 5, "auth": {"user": "u", "session": MASK}}
    assert got["engine"]["api_key_env"] == "OPENAI_API_KEY" and got["sampling"] == config["sampling"]


def test_the_secrets_a_config_holds_are_masked_verbatim_in_any_text():
    remember_secrets({"output": {"storage_options": {"AWS_SESSION_TOKEN": "verbatim-S3-tok"},
                                 "catalog": {"credential": "client:verbatim-cat"}},
                      "engine": {"extra_body": {"api_token": "verbatim-xb"},
                                 "base_url": "http://verbatim-user:verbatim-pw@h:1/v1?key=verbatim-qk&region=verbatim"}})
    said = ("the server said verbatim-S3-tok, client:verbatim-cat and verbatim-xb; Basic for verbatim-user with "
            "verbatim-pw, and verbatim-qk")
    clean = redact_text(said)
    for secret in ("verbatim-S3-tok", "client:verbatim-cat", "verbatim-xb", "verbatim-user", "verbatim-pw",
                   "verbatim-qk"):
        assert secret not in clean, (secret, clean)
    assert redact_text("region=verbatim of a name not secret") == "region=verbatim of a name not secret"


def test_a_control_character_is_named_and_the_value_never_quoted():
    said = control_character("sk-control-secret\r")
    assert said == "a carriage return (\\r) at its end" and "sk-" not in said
    assert control_character("a\x1bb") == "a control character (0x1b) at character 2"
    assert control_character("clean value") is None
