"""Annotation outputs beside the text: token log-probabilities (sampling.logprobs), the reasoning split
(sampling.reasoning) and per-row sampling parameters from columns."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from batchgen.runner import run_job
from tests.conftest import compose_job, corpus, job_overrides, read_output, write_parquet


@pytest.fixture
def prompts(tmp_path):
    return write_parquet(tmp_path / "in.parquet", [{"prompt": p} for p in corpus(12, seed=5)])


def test_logprobs_are_the_models_own_and_the_top_k_are_ranked(tiny_model, tokenizer, prompts, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    run_job(compose_job(job_overrides(tiny_model, prompts, out, "sampling.max_new_tokens=8", "sampling.logprobs=3",
                                      "sampling.ignore_eos=true")))
    rows = read_output(out).to_pylist()
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for row, text in zip(rows, [r["prompt"] for r in pq.read_table(prompts).to_pylist()]):
        assert len(row["token_logprobs"]) == len(row["top_logprobs"]) == row["num_generated_tokens"] == 8
        prompt = tokenizer(text)["input_ids"]
        generated = [pos[0]["token_id"] for pos in row["top_logprobs"]]  # greedy: the likeliest token each step
        assert tokenizer.decode(generated, skip_special_tokens=True) == row["generation"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + generated])).logits[0].float(), dim=-1)
        for i, (picked, top) in enumerate(zip(row["token_logprobs"], row["top_logprobs"])):
            expected = logp[len(prompt) - 1 + i]
            assert picked == pytest.approx(float(expected[generated[i]]), abs=1e-4)
            values, ids = torch.topk(expected, 3)
            assert [t["token_id"] for t in top] == ids.tolist()
            assert [t["logprob"] for t in top] == pytest.approx(values.tolist(), abs=1e-4)
            assert [t["token"] for t in top] == [tokenizer.decode([i]) for i in ids.tolist()]


def test_without_logprobs_the_output_has_no_logprob_columns(tiny_model, prompts, tmp_path):
    run_job(compose_job(job_overrides(tiny_model, prompts, tmp_path / "out", "sampling.max_new_tokens=4")))
    names = read_output(tmp_path / "out").schema.names
    assert "token_logprobs" not in names and "top_logprobs" not in names and "parsed" not in names
