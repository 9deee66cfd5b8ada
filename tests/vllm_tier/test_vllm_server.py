"""engine=openai against a real `vllm serve` (the CPU build) on 127.0.0.1: the same job's rows equal engine=vllm
in-process row for row (greedy and seeded rows side by side, two samples each, with logprobs), and structured
outputs through the server parse and validate.

Two vLLM start-ups: the server (shared by the tests here) and one in-process run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import compose_job, corpus, read_output, write_parquet
from tests.vllm_tier.test_vllm_jobs import EAGER, run_vllm

pytestmark = pytest.mark.vllm

SERVED = "stand-in"
JOB = ("dataset.id_column=uid", "dataset.temperature_column=temperature", "sampling.n=2", "sampling.seed=7",
       "sampling.logprobs=2", "sampling.max_new_tokens=16", "run.rows_per_part=8", "output.usage=true")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(vllm_model, tmp_path_factory):
    """`vllm serve` on the stand-in model (float32, eager, a 1 GiB KV cache, constrained JSON without free
    whitespace), its base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model,
               "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "1024", "--enforce-eager",  # and compact JSON, as engine=vllm sets it in-process
               "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 420
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "vllm serve did not start in 7 min:\n" + log.read_text()[-4000:]
            try:
                if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Greedy rows and sampled rows side by side (dataset.temperature_column)."""
    rows = [{"uid": f"u{i:02d}", "prompt": p, "temperature": 0.0 if i % 2 else 0.9}
            for i, p in enumerate(corpus(16, seed=31))]
    return write_parquet(tmp_path_factory.mktemp("server") / "in.parquet", rows)


def job(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    return ["name=t", f"output_dir={out}", f"dataset.path={data}", "run.progress=false", *JOB, *extra]


def server_job(vllm_model: str, url: str, data: Path, out: Path, *extra: str) -> list[str]:
    return job(vllm_model, data, out, "engine=openai", f"engine.model={SERVED}", f"engine.tokenizer={vllm_model}",
               f"engine.base_url={url}", *extra)


def rows_of(out: Path) -> dict:
    return {(r["id"], r["sample_index"]): r for r in read_output(out).to_pylist()}  # id: the uid column's


def test_rows_through_vllm_serve_equal_engine_vllm_in_process(server, vllm_model, data, tmp_path):
    from batchgen.run.runner import run_job

    run_job(compose_job(server_job(vllm_model, server, data, tmp_path / "served")))
    run_vllm(job(vllm_model, data, tmp_path / "inproc", "engine=vllm", f"engine.model={vllm_model}",
                 "engine.dtype=float32", EAGER))
    served, inproc = rows_of(tmp_path / "served"), rows_of(tmp_path / "inproc")
    assert set(served) == set(inproc) and len(served) == 32
    for key, want in inproc.items():
        got = served[key]
        assert (got["generation"], got["finish_reason"], got["seed"], got["num_generated_tokens"]) == (
            want["generation"], want["finish_reason"], want["seed"], want["num_generated_tokens"]), key
        assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4), key
        assert [[t["token_id"] for t in top] for top in got["top_logprobs"]] == [
            [t["token_id"] for t in top] for top in want["top_logprobs"]], key
    assert all(r["latency_s"] > 0 and r["cached_prompt_tokens"] is not None for r in inproc.values())  # vLLM's count
    assert all(r["latency_s"] > 0 for r in served.values())
    sampled = [k for k in served if int(k[0][1:]) % 2 == 0]
    assert any(served[(uid, 0)]["generation"] != served[(uid, 1)]["generation"] for uid, _ in sampled)
    manifest = json.loads((tmp_path / "served" / "_manifest.json").read_text())
    assert manifest["engine_resolved"]["served_model"] == {"id": SERVED, "root": vllm_model, "max_model_len": 1024}


def test_structured_outputs_through_vllm_serve_parse_and_validate(server, vllm_model, data, tmp_path):
    import jsonschema

    from batchgen.run.runner import run_job

    schema = {"type": "object", "properties": {"label": {"enum": ["billing", "bug", "other"]},
                                               "urgent": {"type": "boolean"}},
              "required": ["label", "urgent"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    greedy = ("dataset.temperature_column=null", "sampling.n=1", "sampling.logprobs=null",
              "sampling.max_new_tokens=48")
    for name, constraint in (("schema", f"sampling.json_schema={tmp_path / 'schema.json'}"),
                             ("regex", "sampling.regex='[a-z]{2,6}-[0-9]{2}'"),
                             ("choice", "sampling.choice=[yes,no,'not sure']")):
        run_job(compose_job(server_job(vllm_model, server, data, tmp_path / name, *greedy, constraint)))
        rows = read_output(tmp_path / name).to_pylist()
        assert len(rows) == 16 and all(r["error"] is None and r["finish_reason"] == "stop" for r in rows), rows[:2]
        if name == "schema":
            for r in rows:
                jsonschema.validate(json.loads(r["parsed"]), schema)
