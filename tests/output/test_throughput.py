"""output/throughput.py: one throughput figure, defined once (what a run did per second of generation after load),
said the same by the summary, `batchgen status` and `batchgen report`; rows and prompt tokens per second for a
scoring task, which generates nothing. The summary keeps the internals out (they go to the log) and names the
model's numerics."""

from __future__ import annotations

import logging

from batchgen.commands.report import _summary_rows, gather
from batchgen.commands.status import describe
from batchgen.output.throughput import RunWork, throughput
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, dummy_overrides, job_overrides, keyed_rows, write_jsonl


def test_the_figure_is_generated_tokens_over_generation_time_or_rows_for_a_scoring_task():
    assert throughput(RunWork("generate", rows=3, prompt_tokens=90, generated_tokens=50, generation_s=2.0)) == (
        "25.0 generated tok/s after load")
    assert throughput(RunWork("loglik", rows=3, prompt_tokens=90, generation_s=2.0)) == (
        "1.5 rows/s, 45.0 prompt tok/s scored after load")
    assert throughput(RunWork("generate", generated_tokens=50)) == "0.0 generated tok/s after load"  # before load


def test_the_summary_status_and_report_say_the_same_figure_and_the_log_keeps_the_internals(tiny_model, tmp_path,
                                                                                           caplog):
    """A JSONL input (a typing pass) in several parts in flight: the summary's figure is the one the status file
    recorded last, which `batchgen status` and `batchgen report` say word for word; the typing pass and the parts in
    flight are in the log, not the summary."""
    data = write_jsonl(tmp_path / "in.jsonl", keyed_rows(12, "r", 2))
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="batchgen"):
        summary = run_job(compose_job(dummy_overrides(tiny_model, data, out, "dataset.id_column=uid",
                                                      "run.rows_per_part=3", "sampling.max_new_tokens=6")))
    figure = throughput(summary.work)
    assert summary.work.generated_tokens == summary.totals.generated_tokens > 0 and summary.work.generation_s > 0
    assert figure.endswith("generated tok/s after load") and f", {figure}" in summary.render()
    assert "one pass over" not in summary.render() and "parts in flight" not in summary.render()
    assert "one pass over 12 lines for the column types" in caplog.text and "parts in flight" in caplog.text
    assert f"{summary.totals.generated_tokens} generated tokens, {figure}" in describe(out)
    said = dict(_summary_rows(gather(out)))["throughput (the last run of each shard, after load)"]
    assert said == f"_status.json: {figure}"


def test_a_scoring_task_says_rows_and_prompt_tokens_per_second_and_the_models_numerics(tiny_model, tmp_path):
    """task=loglik generates nothing: its figure is rows/s and prompt tokens scored per second (it said `0.0
    generated tok/s after load`), in the summary and `batchgen status` alike; the summary names the model's dtype."""
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": t} for i, t in enumerate(corpus(6, seed=3))])
    out = tmp_path / "out"
    summary = run_job(compose_job(job_overrides(tiny_model, data, out, "task=loglik", "dataset.id_column=id",
                                                "run.rows_per_part=3")))
    figure = throughput(summary.work)
    text = summary.render()
    assert "generated tok/s" not in text and "rows/s" in figure and "prompt tok/s scored" in figure, text
    assert "this run: 6 rows scored in " in text and f", {figure}" in text and "  model: dtype float32" in text
    assert summary.work.prompt_tokens == summary.totals.prompt_tokens > 0
    assert f"{summary.totals.prompt_tokens} prompt tokens scored, {figure}" in describe(out)
