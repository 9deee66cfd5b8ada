"""engine=dummy: the engine contract without a model (deterministic per request, caps, EOS, stop strings, results
as they finish), and the pipeline's exactly-once rules exercised through it: sharded and killed-then-resumed runs
write what an uninterrupted run writes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from batchgen.engines.dummy import DummyConfig, DummyEngine
from batchgen.records import Request
from batchgen.run.runner import run_job
from batchgen.sampling import SampleParams
from tests.conftest import REPO, compose_job, job_overrides, read_output, write_jsonl


def params(cap=8, stop=(), ignore_eos=False):
    return SampleParams(max_new_tokens=cap, temperature=1.0, top_p=1.0, top_k=0, stop=stop, ignore_eos=ignore_eos)


def test_the_engine_contract(tokenizer):
    engine = DummyEngine(DummyConfig(model="x", extra_args={"eos_rate": 0.0}), tokenizer)
    reqs = [Request(key=k, prompt_ids=[5, 6, 7 + k % 2], params=params(cap=3 + k), seed=k % 2) for k in range(4)]
    seen = []
    results = engine.generate(reqs, on_result=seen.append)
    assert [r.key for r in results] == [0, 1, 2, 3] and seen == results
    assert [r.num_generated_tokens for r in results] == [3, 4, 5, 6] and {r.finish_reason for r in results} == {
        "length"}
    again = engine.generate(reqs)
    assert [r.text for r in again] == [r.text for r in results]  # a pure function of the request
    other = engine.generate([Request(key=0, prompt_ids=[5, 6, 7], params=params(cap=3), seed=99)])[0]
    assert other.text != results[0].text  # another seed, another sample
    eos = DummyEngine(DummyConfig(model="x", extra_args={"eos_rate": 1.0}), tokenizer)
    assert eos.generate(reqs[:1])[0].finish_reason == "stop"
    assert eos.generate([Request(key=0, prompt_ids=[1], params=params(ignore_eos=True), seed=0)])[0] \
        .finish_reason == "length"
    text = results[3].text
    stop = text[len(text) // 2:][:2]
    cut = engine.generate([Request(key=3, prompt_ids=reqs[3].prompt_ids, params=params(cap=6, stop=(stop,)),
                                   seed=1)])[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.find(stop)]


def dummy_job(tiny_model, data, out, *extra):
    return job_overrides(tiny_model, data, out, "engine=dummy", "sampling=sample", "sampling.n=2",
                         "sampling.max_new_tokens=6", "run.rows_per_part=5", *extra)


def test_sharded_and_killed_runs_write_what_an_uninterrupted_run_writes(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"the river town {i}"} for i in range(40)])
    whole = tmp_path / "whole"
    run_job(compose_job(dummy_job(tiny_model, data, whole)))
    want = read_output(whole).sort_by([("id", "ascending"), ("sample_index", "ascending")])

    sharded = tmp_path / "sharded"
    for shard in (1, 0, 2):
        run_job(compose_job(dummy_job(tiny_model, data, sharded, "run.num_shards=3", f"run.shard={shard}")))
    assert (sharded / "_SUCCESS").exists()
    assert read_output(sharded).sort_by([("id", "ascending"), ("sample_index", "ascending")]).equals(want)

    killed = tmp_path / "killed"
    args = [sys.executable, "-m", "batchgen", *dummy_job(tiny_model, data, killed, "+engine.extra_args.delay_s=0.01")]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "part-00002.parquet").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "_SUCCESS").exists()
    assert subprocess.run(args, cwd=REPO, capture_output=True, timeout=300).returncode == 0
    assert read_output(killed).sort_by([("id", "ascending"), ("sample_index", "ascending")]).equals(want)


def test_a_row_constraint_the_dummy_cannot_apply_is_that_rows_error(tiny_model, tmp_path):
    """An OpenAI batch request with a response_format on engine=dummy (which does not constrain): that row is a
    bad_schema error naming the engine, not a generation left unconstrained and judged 'truncated'; the other row
    is generated."""
    import json

    lines = [{"custom_id": "plain", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}},
             {"custom_id": "json", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "response_format": {"type": "json_object"}}}]
    data = write_jsonl(tmp_path / "batch.jsonl", [json.dumps(line) for line in lines])
    out = tmp_path / "out"
    cfg = compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "dataset.format=openai_batch",
                                    "run.max_error_rate=1"))
    run_job(cfg)
    errors = dict(zip(*(read_output(out).column(c).to_pylist() for c in ("id", "error"))))
    assert errors["plain"] is None
    assert errors["json"] == ("bad_schema: response_format json_object: engine=dummy does not constrain its output; "
                              "use engine=hf or engine=vllm")
