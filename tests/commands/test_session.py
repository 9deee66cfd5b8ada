"""batchgen.Session (commands/session.py): each call reports its own engine work. The held engine's counters add up
over the session's life; a call's status and summary count only what that call did. Loading once and the results of
many calls: tests/run/test_api.py."""

from __future__ import annotations

import json

import batchgen
from tests.conftest import corpus


def test_a_sessions_second_call_reports_the_engine_work_of_a_fresh_run_not_the_sum(tiny_model, tmp_path):
    overrides = ["name=t", f"engine.model={tiny_model}", "engine.dtype=float32", "sampling.max_new_tokens=4",
                 "run.progress=false"]
    rows = [{"prompt": "one instruction shared by every row, long enough to be cached: " + p}
            for p in corpus(6, seed=1)]
    with batchgen.Session(overrides=overrides) as s:
        s.generate(rows, output_dir=tmp_path / "first")
        s.generate(rows, output_dir=tmp_path / "second")
    batchgen.generate(rows, batchgen.load_job(overrides=overrides), output_dir=tmp_path / "fresh")
    said = {name: json.loads((tmp_path / name / "_status.json").read_text()) for name in ("first", "second", "fresh")}
    fresh = said["fresh"]["engine"]
    assert fresh["decode_steps"] > 0 and fresh["prefix_tokens_reused"] > 0
    for name in ("first", "second"):
        engine = said[name]["engine"]
        for key in ("decode_steps", "decode_row_steps", "prefill_rows", "prefix_tokens_reused", "oom_backoffs"):
            assert engine[key] == fresh[key], (name, key, engine, fresh)
        assert engine["kv_slots"] == fresh["kv_slots"] and engine["kv_cache_bytes"] == fresh["kv_cache_bytes"]
        assert said[name]["generated_tokens"] == said["fresh"]["generated_tokens"]


def test_a_held_engines_second_run_summarizes_its_own_prefix_cache_reuse(tiny_model, tmp_path):
    from batchgen.run.prepare import HeldEngine
    from batchgen.run.runner import run_job
    from tests.conftest import compose_job, job_overrides, write_jsonl

    rows = [{"prompt": "one instruction shared by every row, long enough to be cached: " + p}
            for p in corpus(6, seed=2)]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    fresh = run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "fresh", "sampling.max_new_tokens=4")))
    held = HeldEngine()
    try:
        said = [run_job(compose_job(job_overrides(tiny_model, data, tmp_path / name, "sampling.max_new_tokens=4")),
                        held=held) for name in ("first", "second")]
    finally:
        held.close()
    assert fresh.prefix_tokens_reused > 0
    assert [s.prefix_tokens_reused for s in said] == [fresh.prefix_tokens_reused] * 2
