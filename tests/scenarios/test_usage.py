"""output.usage and output.prices: per-row usage columns on every engine (hf, dummy, openai here; vllm in the vLLM
tier), a cost per sample whose total is the summary's, the history's and the report's, and `batchgen plan`'s
estimate beside the run's cost."""

from __future__ import annotations

import json

import pytest

from batchgen.commands.plan import run_plan
from batchgen.errors import ResumeMismatchError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, dummy_overrides, job_overrides, read_output, write_jsonl
from tests.engines.endpoint.test_engine_openai import endpoint

PRICES = "output.prices={input: 0.15, cached_input: 0.075, output: 0.6}"
SYSTEM = ("dataset.system_prompt='You label support tickets for a small shop. Read the ticket, decide what it is "
          "about, and answer with one short phrase and nothing else at all.'")


def expected_cost(row: dict) -> float:
    cached = row["cached_prompt_tokens"] or 0
    return ((row["num_prompt_tokens"] - cached) * 0.15 + cached * 0.075 + row["num_generated_tokens"] * 0.6) / 1e6


def test_usage_columns_and_cost_on_the_hf_engine_with_a_shared_prefix(tiny_model, tmp_path):
    """The system prompt's blocks come from the prefix cache (cached_prompt_tokens, priced at cached_input); each
    sample's cost follows the formula, and the totals agree: summary, history, report."""
    data = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in corpus(12, seed=4)])
    out = tmp_path / "out"
    summary = run_job(compose_job(job_overrides(tiny_model, data, out, "output.usage=true", PRICES, SYSTEM,
                                                "sampling.max_new_tokens=8", "run.rows_per_part=4")))
    rows = read_output(out).to_pylist()
    assert all(r["cached_prompt_tokens"] >= 32 and r["cached_prompt_tokens"] % 32 == 0 for r in rows[1:])
    assert all(r["latency_s"] > 0 and r["reasoning_tokens"] is None for r in rows)
    assert [r["cost"] for r in rows] == pytest.approx([expected_cost(r) for r in rows], rel=1e-12)
    total = sum(r["cost"] for r in rows)
    assert summary.totals.cost == pytest.approx(total, rel=1e-9) and f"cost: {total:.6g}" in summary.render()
    history = [json.loads(line) for line in (out / "_history.jsonl").read_text().splitlines()]
    assert sum(h["cost"] for h in history) == pytest.approx(total, rel=1e-6)


def test_usage_on_the_dummy_engine_and_a_resume_that_changes_it_is_refused(tokenizer, tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in corpus(6, seed=5)])
    out = tmp_path / "out"
    run_job(compose_job(dummy_overrides(tiny_model, data, out, "output.usage=true", "run.rows_per_part=2")))
    rows = read_output(out).to_pylist()
    assert all(r["cached_prompt_tokens"] == 0 and r["latency_s"] >= 0 for r in rows) and "cost" not in rows[0]
    (out / "part-00002.parquet").unlink()
    (out / "_SUCCESS").unlink()
    with pytest.raises(ResumeMismatchError) as err:
        run_job(compose_job(dummy_overrides(tiny_model, data, out, "run.rows_per_part=2")))
    assert "output" in str(err.value)


def test_an_endpoints_usage_and_plans_estimate_within_ten_percent_of_the_runs_cost(tiny_model, tmp_path):
    """engine=openai: usage from the server's answers and the latency from the first attempt; `batchgen plan` before
    the run estimates its cost from the prompts and caps (every sample at its cap, no cache): within 10% of what the
    run then costs on this workload (rows mostly run to their cap; some stop early)."""
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": p} for i, p in enumerate(corpus(16, 6))])
    out = tmp_path / "out"
    with endpoint(tiny_model) as url:
        args = ["name=t", f"output_dir={out}", f"dataset.path={data}", "dataset.format=auto", "dataset.id_column=id",
                "run.progress=false", "engine=openai", "engine.model=tiny", f"engine.tokenizer={tiny_model}",
                f"engine.base_url={url}", "sampling.max_new_tokens=10", "sampling.n=2", "sampling.temperature=0.8",
                "output.usage=true", PRICES]
        plan, _ = run_plan(compose_job(args))
        summary = run_job(compose_job(args))
    rows = read_output(out).to_pylist()
    assert len(rows) == 32 and all(r["latency_s"] > 0 and r["cached_prompt_tokens"] is None for r in rows)
    assert summary.totals.cost == pytest.approx(sum(expected_cost(r) for r in rows), rel=1e-9)
    assert plan["cost_estimate"] >= summary.totals.cost
    assert plan["cost_estimate"] == pytest.approx(summary.totals.cost, rel=0.10), (plan["cost_estimate"],
                                                                                   summary.totals.cost)
