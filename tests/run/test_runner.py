"""Jobs end to end, in process: identity, layout, bad rows, error rate, resume rules, read-back. The first test runs
the real hf engine; the rest run engine=dummy (no model: the pipeline is what they test)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from batchgen.errors import ConfigError, ErrorRateExceeded, ResumeMismatchError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, job_overrides, read_output, write_jsonl, write_parquet


def rows_of(n: int, seed: int = 0) -> list[dict]:
    return [{"uid": f"u{i:03d}", "prompt": text, "score": i * 0.5} for i, text in enumerate(corpus(n, seed))]


def test_every_output_row_maps_back_to_its_input(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", rows_of(37))
    out = tmp_path / "out"
    cfg = compose_job(job_overrides(tiny_model, data, out, "dataset.id_column=uid", "run.rows_per_part=10",
                                    "sampling=sample", "sampling.n=3", "sampling.max_new_tokens=4"))
    summary = run_job(cfg)
    assert summary.state == "done" and summary.totals.rows == 37 and summary.totals.samples == 111
    parts = sorted(out.glob("part-*.parquet"))
    assert [p.name for p in parts] == [f"part-{k:05d}.parquet" for k in range(4)]
    expected_ids = [r["uid"] for r in rows_of(37)]
    for k, path in enumerate(parts):
        table = pq.read_table(path)
        ids = table.column("id").to_pylist()
        assert ids == [i for i in expected_ids[10 * k: 10 * k + 10] for _ in range(3)]  # input order, n consecutive
        assert table.column("sample_index").to_pylist() == [0, 1, 2] * (len(ids) // 3)
        meta = table.schema.metadata
        assert b"batchgen.config_hash" in meta and b"batchgen.model" in meta
        assert json.loads(meta[b"batchgen.engine"])["dtype"] == "float32"
    table = read_output(out)
    assert table.column("score").to_pylist()[:3] == [0.0, 0.0, 0.0]  # passthrough column, input type kept
    seeds = table.column("seed").to_pylist()
    assert len(set(seeds)) == len(seeds)  # every sample has its own seed
    for name in ("_manifest.json", "_status.json", "_SUCCESS"):
        assert (out / name).exists()
    status = json.loads((out / "_status.json").read_text())
    assert status["rows_done"] == 37
    assert status["engine"]["decode_steps"] > 0 and status["engine"]["oom_backoffs"] == 0


def test_output_reads_back_with_pyarrow_pandas_and_datasets(tiny_model, tmp_path):
    import datasets
    import pandas as pd

    data = write_jsonl(tmp_path / "in.jsonl", rows_of(12))
    out = tmp_path / "out"
    run_job(compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "run.rows_per_part=5",
                                      "sampling.max_new_tokens=3")))
    assert read_output(out).num_rows == 12
    assert len(pd.read_parquet(out)) == 12  # the directory as a whole: _files and _logs are skipped
    files = sorted(str(p) for p in out.glob("*.parquet"))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == 12 and ds[0]["id"] == "in.jsonl:0"


def test_bad_rows_become_error_rows_and_the_job_finishes(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [
        {"q": "the river", "ctx": "town"}, {"q": None, "ctx": "x"}, {"q": "", "ctx": "x"}, {"q": "   ", "ctx": "x"},
        {"q": 42, "ctx": "x"}, {"q": "old clock"}, "{broken json", {"q": "the sun", "ctx": "rain"},
    ])
    out = tmp_path / "out"
    cfg = compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "dataset.template='Q: {q} C: {ctx}'",
                                    "sampling.max_new_tokens=3", "run.max_error_rate=1.0"))
    summary = run_job(cfg)
    rows = read_output(out).to_pylist()
    assert len(rows) == 8 and summary.state == "done"
    errors = [r["error"] for r in rows]
    assert errors[0] is None and errors[7] is None
    assert errors[1].startswith("bad_template") and errors[5].startswith("bad_template: field 'ctx'")
    assert errors[6].startswith("malformed_json: line 7")
    assert errors[2] is None and errors[4] is None  # a template renders "" and 42 into a non-empty prompt
    assert all(rows[i]["finish_reason"] == "error" and rows[i]["generation"] is None for i in (1, 5, 6))

    plain = compose_job(job_overrides(tiny_model, data, tmp_path / "plain", "engine=dummy", "dataset.prompt_column=q",
                                      "sampling.max_new_tokens=3", "run.max_error_rate=1.0"))
    run_job(plain)
    errors = [r["error"] for r in read_output(tmp_path / "plain").to_pylist()]
    assert errors[1:5] == ["empty_prompt", "empty_prompt", "empty_prompt", "non_string_prompt: got int"]


def test_too_long_policies(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "the river " * 200}, {"prompt": "sun"}])
    common = ("engine.max_model_len=64", "sampling.max_new_tokens=8", "run.max_error_rate=1.0")
    run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "a", "engine=dummy", *common)))
    truncated = read_output(tmp_path / "a").to_pylist()
    assert truncated[0]["error"] is None and truncated[0]["num_prompt_tokens"] == 56
    run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "b", "engine=dummy", *common, "run.too_long=skip")))
    skipped = read_output(tmp_path / "b").to_pylist()
    assert skipped[0]["error"].startswith("too_long") and skipped[1]["error"] is None


def test_error_rate_stops_the_job_after_the_current_part(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": None}] * 30)
    out = tmp_path / "out"
    cfg = compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "run.rows_per_part=10",
                                    "run.max_error_rate=0.5"))
    with pytest.raises(ErrorRateExceeded, match="run.max_error_rate"):
        run_job(cfg)
    assert [p.name for p in out.glob("part-*")] == ["part-00000.parquet"]
    assert json.loads((out / "_status.json").read_text())["state"] == "failed"


def test_empty_dataset_gives_a_valid_empty_result(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [])
    (tmp_path / "in.jsonl").write_text("")
    out = tmp_path / "out"
    summary = run_job(compose_job(job_overrides(tiny_model, data, out, "engine=dummy")))
    assert summary.state == "done" and read_output(out).num_rows == 0 and (out / "_SUCCESS").exists()


def test_rerun_of_a_finished_job_does_nothing_and_a_changed_one_is_refused(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", rows_of(6))
    out = tmp_path / "out"
    base = job_overrides(tiny_model, data, out, "engine=dummy", "sampling.max_new_tokens=3")
    run_job(compose_job(base))
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*")}
    assert run_job(compose_job(base)).state == "already_done"
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-*")} == before
    with pytest.raises(ResumeMismatchError, match=r"output_config.sampling.max_new_tokens: was 3, now 4"):
        run_job(compose_job(base[:-1] + ["sampling.max_new_tokens=4"]))
    write_parquet(tmp_path / "in.parquet", rows_of(7))
    with pytest.raises(ResumeMismatchError, match=r"input\[0\].size"):
        run_job(compose_job(base))


def test_sharded_runs_together_make_the_whole_result(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", rows_of(25))
    out = tmp_path / "out"
    for shard in (1, 0):
        summary = run_job(compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "run.rows_per_part=5",
                                                    "run.num_shards=2", f"run.shard={shard}",
                                                    "sampling.max_new_tokens=2")))
    assert summary.state == "done" and (out / "_SUCCESS").exists()
    assert read_output(out).column("id").to_pylist() == [f"in.parquet:{i}" for i in range(25)]


def test_chat_rendering_uses_the_chat_template(tiny_model, tokenizer, tmp_path):
    msgs = [{"role": "user", "content": "the river town"}]
    data = write_parquet(tmp_path / "in.parquet", [{"messages": msgs}, {"messages": []}])
    out = tmp_path / "out"
    run_job(compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "dataset.messages_column=messages",
                                      "dataset.system_prompt='be brief'", "sampling.max_new_tokens=2",
                                      "run.max_error_rate=1.0")))
    rows = read_output(out).to_pylist()
    text = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"}, *msgs], tokenize=False,
                                         add_generation_prompt=True)
    assert rows[0]["num_prompt_tokens"] == len(tokenizer(text, add_special_tokens=False).input_ids)
    assert rows[1]["error"] == "empty_prompt"


def test_a_chat_template_looping_for_ever_costs_its_row_and_the_job_goes_on(tiny_model, tmp_path):
    """A chat template whose loops never end for one row (nested loops over range, 10^10 steps) makes that row a
    bad_template error row after dataset.render_timeout_s; the job finishes and generates the other rows."""
    import time

    template = tmp_path / "spin.jinja"
    template.write_text("{% if messages[0].content == 'spin' %}{% for i in range(100000) %}"
                        "{% for j in range(100000) %}x{% endfor %}{% endfor %}{% endif %}"
                        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<bot>")
    prompts = ["the river town", "spin", "a quiet night", "the bridge"]
    data = write_parquet(tmp_path / "in.parquet", [{"uid": f"u{i}", "prompt": p} for i, p in enumerate(prompts)])
    start = time.monotonic()
    summary = run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "out", "engine=dummy",
                                                "dataset.id_column=uid", f"dataset.chat_template={template}",
                                                "dataset.render_timeout_s=0.5", "sampling.max_new_tokens=2",
                                                "run.max_error_rate=0.5")))
    assert time.monotonic() - start < 30 and summary.state == "done"
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert rows["u1"]["error"].startswith("bad_template: chat template: ran past dataset.render_timeout_s=0.5")
    assert all(rows[u]["error"] is None and rows[u]["generation"] is not None for u in ("u0", "u2", "u3"))
    again = run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "out", "engine=dummy",
                                              "dataset.id_column=uid", f"dataset.chat_template={template}",
                                              "dataset.render_timeout_s=1", "sampling.max_new_tokens=2",
                                              "run.max_error_rate=0.5")))
    assert again.state == "already_done"  # a limit, not part of the run's fingerprint


def test_chat_without_a_chat_template_is_a_config_error(tiny_model, tmp_path):
    import shutil

    model = tmp_path / "nochat"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").unlink()
    cfg_file = model / "tokenizer_config.json"
    kept = {k: v for k, v in json.loads(cfg_file.read_text()).items() if k != "chat_template"}
    cfg_file.write_text(json.dumps(kept))
    data = write_parquet(tmp_path / "in.parquet", rows_of(2))
    with pytest.raises(ConfigError, match="dataset.system_prompt asks for chat rendering.*no chat template"):
        run_job(compose_job(job_overrides(str(model), data, tmp_path / "out", "engine=dummy",
                                          "dataset.system_prompt=hi")))
