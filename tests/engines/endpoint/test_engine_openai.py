"""engine=openai against a real model behind an OpenAI-compatible HTTP server (tests/endpoint_server.py: transformers'
generate on the tiny model, faults injected on purpose): the rows equal the hf engine's, faults cost nothing but
time, a rejected request costs its row, a SIGKILL or SIGTERM and a rerun equal an uninterrupted run, a server that
stays down stops the job with exit 1 and the rerun resumes, and a resume against another served model is refused.
The same engine against a real `vllm serve`: tests/vllm_tier/test_vllm_server.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from batchgen.errors import ConfigError, ResumeMismatchError
from batchgen.run.runner import run_job
from tests.conftest import REPO, compose_job, corpus, read_output, run_cli, write_jsonl

ROWS = 24


@contextmanager
def endpoint(model: str, *args: str, log: Path | None = None, name: str = "tiny"):
    """The test server on 127.0.0.1, its base URL yielded; killed at the end."""
    command = [sys.executable, "-m", "tests.endpoint_server", "--model", model, "--name", name, *args]
    proc = subprocess.Popen(command + (["--log", str(log)] if log else []), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("port "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}/v1"
    finally:
        proc.kill()
        proc.wait()


def rows(n: int = ROWS, rejected: tuple[int, ...] = (5,)) -> list[dict]:
    """Keyed rows; those in `rejected` ask the server to reject them (HTTP 400)."""
    return [{"id": f"r{i:03d}", "prompt": p + (" REJECT" if i in rejected else "")}
            for i, p in enumerate(corpus(n, seed=3))]


def overrides(model: str, data: Path, out: Path, url: str | None, *extra: str) -> list[str]:
    engine = ([f"engine.model={model}", "engine.dtype=float32"] if url is None else
              ["engine=openai", "engine.model=tiny", f"engine.tokenizer={model}", f"engine.base_url={url}"])
    return ["name=t", f"output_dir={out}", f"dataset.path={data}", "dataset.format=auto", "dataset.id_column=id",
            "run.progress=false", "sampling.max_new_tokens=12", "run.rows_per_part=6", *engine, *extra]


def by_id(out: Path) -> dict[tuple[str, int], dict]:
    table = read_output(out).to_pylist()
    keys = [(r["id"], r["sample_index"]) for r in table]
    assert len(keys) == len(set(keys)), "an (id, sample_index) written twice"
    return {(r["id"], r["sample_index"]): r for r in table}


def columns(table: dict, *names: str) -> dict:
    return {k: tuple(r[n] for n in names) for k, r in table.items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("openai") / "in.jsonl", rows())


@pytest.fixture(scope="module")
def reference(tiny_model, data, tmp_path_factory) -> dict:
    """The job on the in-process hf engine."""
    out = tmp_path_factory.mktemp("openai") / "hf"
    run_job(compose_job(overrides(tiny_model, data, out, None)))
    return by_id(out)


def test_greedy_rows_through_an_endpoint_equal_the_hf_engines_and_a_rejected_request_costs_its_row(
        tiny_model, data, reference, tmp_path):
    out = tmp_path / "out"
    with endpoint(tiny_model) as url:
        summary = run_job(compose_job(overrides(tiny_model, data, out, url)))
    got = by_id(out)
    assert set(got) == set(reference) and summary.totals.errors == {"endpoint_rejected": 1}
    rejected = got.pop(("r005", 0))
    assert rejected["generation"] is None and rejected["finish_reason"] == "error"
    assert rejected["error"].startswith("endpoint_rejected: HTTP 400: the prompt asks to be rejected")
    assert columns(got, "generation", "finish_reason", "num_prompt_tokens", "num_generated_tokens") == columns(
        {k: reference[k] for k in got}, "generation", "finish_reason", "num_prompt_tokens", "num_generated_tokens")
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["engine_resolved"]["served_model"] == {"id": "tiny", "root": tiny_model, "max_model_len": 2048}


def test_faults_cost_time_not_rows_and_the_concurrency_backs_off_and_recovers(tiny_model, data, reference, tmp_path,
                                                                             caplog):
    out, log = tmp_path / "out", tmp_path / "server.jsonl"
    faults = "429=0.2,503=0.15,drop=0.1,slow=0.05"
    with endpoint(tiny_model, "--faults", faults, "--fault-requests", "20", "--seed", "1", log=log) as url, \
            caplog.at_level(logging.INFO, logger="batchgen.engines.endpoint"):
        run_job(compose_job(overrides(tiny_model, data, out, url, "engine.max_concurrency=4")))
    outcomes = [json.loads(line)["outcome"] for line in log.read_text().splitlines()]
    assert {"429", "503", "drop"} <= set(outcomes), outcomes
    got = by_id(out)
    assert columns(got, "generation", "error") == {
        k: (None, got[k]["error"]) if k == ("r005", 0) else (r["generation"], None) for k, r in reference.items()}
    messages = [r.getMessage() for r in caplog.records]
    assert any("concurrency 4 -> 2" in m for m in messages), messages
    assert any("concurrency back to 4" in m for m in messages), messages


def slow_job(model: str, data: Path, out: Path, url: str, *extra: str) -> subprocess.Popen:
    args = overrides(model, data, out, url, "engine.max_concurrency=2", *extra)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "batchgen", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def answered(log: Path) -> int:
    return sum('"200"' in line for line in log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_job_rerun_equals_an_uninterrupted_one_and_resends_only_what_was_not_journaled(
        tiny_model, data, reference, tmp_path, signum):
    """Each answer takes 2 s (--faults slow=1), two in flight: the job is stopped after the first part is committed
    and more answers came back; SIGTERM lets the requests in flight finish and journals them (exit 143)."""
    out, log = tmp_path / "out", tmp_path / "server.jsonl"
    with endpoint(tiny_model, "--faults", "slow=1", log=log) as url:
        job = slow_job(tiny_model, data, out, url)
        wait_for(lambda: (out / "part-00000.parquet").exists() and answered(log) >= 8)
        job.send_signal(signum)
        text = job.communicate(timeout=120)[0]
    assert job.returncode == (143 if signum == signal.SIGTERM else -9), text
    first = answered(log)
    if signum == signal.SIGTERM:
        assert "waiting up to 30 s for" in text and "still in flight" not in text, text
    with endpoint(tiny_model, log=log) as url:
        run_job(compose_job(overrides(tiny_model, data, out, url)))
    assert columns(by_id(out), "generation", "finish_reason") == columns(reference, "generation", "finish_reason") | {
        ("r005", 0): (None, "error")}
    # the rerun asks only for what no run journaled: every answer once, plus at most those in flight at a SIGKILL
    assert answered(log) <= ROWS - 1 + (2 if signum == signal.SIGKILL else 0), (first, answered(log))


def test_a_server_that_stays_down_stops_the_job_with_exit_1_and_the_rerun_resumes(tiny_model, data, reference,
                                                                                  tmp_path):
    out, log = tmp_path / "out", tmp_path / "server.jsonl"
    with endpoint(tiny_model, "--faults", "slow=1", log=log) as url:
        job = slow_job(tiny_model, data, out, url, "engine.max_retries=2")
        wait_for(lambda: (out / "part-00000.parquet").exists())
    text = job.communicate(timeout=120)[0]  # the server is gone: two retries, then exit 1
    assert job.returncode == 1, text
    assert "failed request" in text and "rerun the same command to resume" in text, text
    with endpoint(tiny_model) as url:  # back, on another port: engine.base_url is not part of the job's identity
        run_job(compose_job(overrides(tiny_model, data, out, url)))
    assert columns(by_id(out), "generation") == columns(reference, "generation") | {("r005", 0): (None,)}


def test_batchgen_retry_sends_the_rejected_rows_again(tiny_model, data, reference, tmp_path):
    """endpoint_rejected is a retryable kind (a default one): once the server takes them, the latest-attempt view has
    every row, equal to the hf engine's."""
    from batchgen.output.view import latest

    out = tmp_path / "out"
    with endpoint(tiny_model) as url:
        run_job(compose_job(overrides(tiny_model, data, out, url)))
    with endpoint(tiny_model, "--reject", "") as url:
        done = run_cli(["retry", str(out), f"engine.base_url={url}"])
    assert done.returncode == 0, done.stderr
    view = {(r["id"], r["sample_index"]): r for r in latest(out).to_pylist()}
    assert {k: r["generation"] for k, r in view.items()} == {k: r["generation"] for k, r in reference.items()}
    assert view[("r005", 0)]["attempt"] == 1 and view[("r005", 0)]["error"] is None


def test_a_resume_against_another_served_model_is_refused(tiny_model, small_model, data, tmp_path):
    """The same served name and settings, another model behind them (vLLM reports the path it loaded as the root)."""
    out = tmp_path / "out"
    with endpoint(tiny_model) as url:
        run_job(compose_job(overrides(tiny_model, data, out, url)))
    for name in ("part-00003.parquet", "_SUCCESS"):  # a part still to generate
        (out / name).unlink()
    with endpoint(small_model, name="tiny") as url, pytest.raises(ResumeMismatchError) as err:
        run_job(compose_job(overrides(tiny_model, data, out, url)))
    assert f"engine.served_model.root: was {tiny_model!r}, now {small_model!r}" in str(err.value)


def test_what_an_endpoint_cannot_do_is_refused_before_anything_is_sent(tiny_model, data, tmp_path):
    with endpoint(tiny_model) as url:
        with pytest.raises(ConfigError) as err:
            run_job(compose_job(overrides(tiny_model, data, tmp_path / "a", url, "engine.model=other")))
        assert "serves 'tiny'; set engine.model to one of them" in str(err.value)
        with pytest.raises(ConfigError) as err:
            run_job(compose_job(overrides(tiny_model, data, tmp_path / "b", url, "engine.extensions=none",
                                          "sampling.regex='[a-z]+'", "sampling.top_k=5")))
        assert "sampling.regex: an OpenAI endpoint takes only a JSON schema" in str(err.value)
        assert "sampling.top_k: not an OpenAI API setting" in str(err.value)
    result = run_cli(overrides(tiny_model, data, tmp_path / "c", "http://127.0.0.1:9/v1", "engine.tokenizer=null",
                               "engine.api_key_env=BATCHGEN_TEST_NO_SUCH_KEY"))
    assert result.returncode == 2, result.stderr
    assert "engine.endpoint=completions needs engine.tokenizer" in result.stderr
    assert "the environment variable BATCHGEN_TEST_NO_SUCH_KEY is not set" in result.stderr


def test_the_api_key_goes_into_the_header_and_nowhere_else(tiny_model, data, tmp_path, monkeypatch):
    """engine.api_key_env names the variable; the key is sent as a bearer token and written to no file of the
    output (manifest, status, history, logs, part metadata)."""
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("BATCHGEN_TEST_KEY", secret)
    out, log = tmp_path / "out", tmp_path / "server.jsonl"
    with endpoint(tiny_model, log=log) as url:
        result = run_cli(overrides(tiny_model, data, out, url, "engine.api_key_env=BATCHGEN_TEST_KEY",
                                   "dataset.limit=6"), env={"BATCHGEN_TEST_KEY": secret})
    assert result.returncode == 0, result.stderr
    sent = {json.loads(line)["auth"] for line in log.read_text().splitlines()}
    assert sent == {f"Bearer {secret}"}
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) > 5 and not [p for p in files if secret.encode() in p.read_bytes()]
    assert secret not in result.stdout + result.stderr


def test_the_chat_endpoint_sends_the_messages_and_the_server_renders_them(tiny_model, tmp_path):
    """engine.endpoint=chat: each row's messages (the system prompt in) go to the server, whose chat template
    renders them: the rows equal the hf engine's, which renders with the same template locally."""
    data = write_jsonl(tmp_path / "in.jsonl", rows(8, rejected=()))
    chat = ["dataset.system_prompt=Answer briefly.", "engine.endpoint=chat"]
    with endpoint(tiny_model, log=tmp_path / "server.jsonl") as url:
        run_job(compose_job(overrides(tiny_model, data, tmp_path / "chat", url, *chat)))
    run_job(compose_job(overrides(tiny_model, data, tmp_path / "hf", None, chat[0])))
    sent = [json.loads(line)["messages"] for line in (tmp_path / "server.jsonl").read_text().splitlines()]
    assert all(m[0] == {"role": "system", "content": "Answer briefly."} and m[1]["role"] == "user" for m in sent)
    assert columns(by_id(tmp_path / "chat"), "generation") == columns(by_id(tmp_path / "hf"), "generation")


def test_logprobs_and_seeded_samples_through_an_endpoint(tiny_model, tmp_path):
    """sampling.logprobs: each token's log-probability and the top k by token id, against the hf engine's (float32,
    same model); seeded samples: a row's samples differ, and a rerun draws the same."""
    data = write_jsonl(tmp_path / "in.jsonl", rows(4, rejected=()))
    with endpoint(tiny_model) as url:
        run_job(compose_job(overrides(tiny_model, data, tmp_path / "lp", url, "sampling.logprobs=3")))
        sampled = ["sampling.temperature=1.0", "sampling.n=3", "sampling.seed=7"]
        run_job(compose_job(overrides(tiny_model, data, tmp_path / "s1", url, *sampled)))
        run_job(compose_job(overrides(tiny_model, data, tmp_path / "s2", url, *sampled)))
    run_job(compose_job(overrides(tiny_model, data, tmp_path / "hf", None, "sampling.logprobs=3")))
    got, want = by_id(tmp_path / "lp"), by_id(tmp_path / "hf")
    for key, row in want.items():
        assert got[key]["token_logprobs"] == pytest.approx(row["token_logprobs"], abs=1e-4)
        assert [[t["token_id"] for t in top] for top in got[key]["top_logprobs"]] == [
            [t["token_id"] for t in top] for top in row["top_logprobs"]]
    s1 = columns(by_id(tmp_path / "s1"), "generation", "seed")
    assert s1 == columns(by_id(tmp_path / "s2"), "generation", "seed")
    assert all(len({s1[(f"r{i:03d}", s)][0] for s in range(3)}) > 1 for i in range(4))



PROCESSORS = ("sampling.repetition_penalty=1.3", "sampling.presence_penalty=0.5", "sampling.frequency_penalty=0.5",
              "sampling.min_tokens=4", "sampling.logit_bias={1: 0.3, 9: -100}")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """One test server for the logits processor tests, its log of what each request carried."""
    log = tmp_path_factory.mktemp("processors") / "server.jsonl"
    with endpoint(tiny_model, log=log) as url:
        yield url, log


def test_the_logits_processors_arrive_and_the_rows_equal_the_hf_engines(tiny_model, server, tmp_path):
    """OpenAI's fields and vLLM's extras reach the server (which applies them as HF generate's processors), and the
    rows equal the hf engine's with the same keys; a sample without them sends none of the fields."""
    from batchgen.engines.endpoint.wire import processor_fields
    from batchgen.sampling import SampleParams

    data = write_jsonl(tmp_path / "in.jsonl", rows(6, rejected=()))
    url, log = server
    run_job(compose_job(overrides(tiny_model, data, tmp_path / "api", url, *PROCESSORS, "sampling.min_p=0.1")))
    run_job(compose_job(overrides(tiny_model, data, tmp_path / "hf", None, *PROCESSORS)))
    sent = [json.loads(line)["processors"] for line in log.read_text().splitlines()]
    assert sent == [{"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_p": 0.1,
                     "min_tokens": 4, "logit_bias": {"1": 0.3, "9": -100.0}}] * 6
    assert processor_fields(SampleParams(8, 0.0, 1.0, 0, (), False), vllm=True) == {}
    got, want = by_id(tmp_path / "api"), by_id(tmp_path / "hf")
    assert columns(got, "generation", "finish_reason", "num_generated_tokens") == columns(
        want, "generation", "finish_reason", "num_generated_tokens")
    ended = [r["num_generated_tokens"] for r in want.values() if r["finish_reason"] == "stop"]
    assert ended and min(ended) >= 5  # EOS (biased up) held off for 4 tokens, then taken


def test_a_field_the_server_refuses_names_the_key_that_set_it(tiny_model, server, tmp_path):
    """The server answers 400 naming logit_bias (as OpenAI does for a model that takes none): the row's error says
    which key set it; a row whose request carries no such field is generated."""
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "the river REFUSE:logit_bias"},
                                               {"id": "b", "prompt": "the river REFUSE:min_p"}])
    run_job(compose_job(overrides(tiny_model, data, tmp_path / "out", server[0], "sampling.logit_bias={9: -100}",
                                  "run.max_error_rate=1")))
    got = by_id(tmp_path / "out")
    assert got[("a", 0)]["error"] == (
        "endpoint_rejected: HTTP 400: the server refused logit_bias (sampling.logit_bias / "
        "dataset.logit_bias_column): Unsupported parameter: 'logit_bias' is not supported with this model.")
    assert got[("b", 0)]["error"] is None and got[("b", 0)]["generation"]


def test_a_retry_refuses_a_base_url_whose_credential_the_manifest_masks(tiny_model, data, tmp_path):
    """The manifest keeps engine.base_url with its user and password masked: a retry sent `***` as the user name.
    It is refused (exit 2) naming the key to give again; given again, the retry runs."""
    out = tmp_path / "out"
    with endpoint(tiny_model) as url:
        secret = url.replace("://", "://alice:s3cret-pw@")
        run_job(compose_job(overrides(tiny_model, data, out, secret)))
    assert "s3cret-pw" not in (out / "_manifest.json").read_text()
    with endpoint(tiny_model, "--reject", "") as url:
        secret = url.replace("://", "://alice:s3cret-pw@")
        refused = run_cli(["retry", str(out)])
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "records engine.base_url with its credential masked (***)" in refused.stderr
        assert f"batchgen retry {out} engine.base_url=..." in refused.stderr
        assert not (out / "_attempts").exists()
        done = run_cli(["retry", str(out), f"engine.base_url={secret}"])
    assert done.returncode == 0, done.stderr[-3000:]


def test_vllms_token_knobs_arrive_and_the_rows_equal_the_hf_engines(tiny_model, server, tmp_path):
    """bad_words, allowed_token_ids and stop_token_ids (sampling.* and a row's own column) reach a vLLM server as
    its fields, and the rows equal the hf engine's; without engine.extensions=vllm they are refused before anything
    is sent, each key named."""
    data = write_jsonl(tmp_path / "in.jsonl", [dict(r, stops=[9] if i % 2 else None)
                                               for i, r in enumerate(rows(4, rejected=()))])
    url, log = server
    keys = ("sampling.bad_words=[ab,the]", "sampling.stop_token_ids=[12]", "dataset.stop_token_ids_column=stops",
            f"sampling.allowed_token_ids=[{','.join(map(str, range(1, 200)))}]")
    before = len(log.read_text().splitlines()) if log.exists() else 0
    run_job(compose_job(overrides(tiny_model, data, tmp_path / "api", url, "engine.extensions=vllm", *keys)))
    run_job(compose_job(overrides(tiny_model, data, tmp_path / "hf", None, *keys)))
    sent = [json.loads(line)["processors"] for line in log.read_text().splitlines()[before:]]
    assert sorted(s["stop_token_ids"] for s in sent) == [[9]] * 2 + [[12]] * 2
    assert all(s["bad_words"] == ["ab", "the"] and s["allowed_token_ids"] == list(range(1, 200)) for s in sent)
    got, want = by_id(tmp_path / "api"), by_id(tmp_path / "hf")
    assert columns(got, "generation", "finish_reason", "num_generated_tokens") == columns(
        want, "generation", "finish_reason", "num_generated_tokens")
    with pytest.raises(ConfigError) as err:
        compose_job(overrides(tiny_model, data, tmp_path / "x", url, "engine.extensions=none", *keys,
                              "sampling.include_stop_str_in_output=true"))
    for key in ("sampling.bad_words", "sampling.stop_token_ids", "dataset.stop_token_ids_column",
                "sampling.allowed_token_ids", "sampling.include_stop_str_in_output"):
        assert f"{key}: not an OpenAI API setting; set engine.extensions=vllm" in str(err.value)
