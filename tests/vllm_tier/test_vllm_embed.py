"""task=embed on engine=vllm (its pooling runner: runner=pooling, convert=embed, MEAN pooling, normalized): each
row's embedding equals an unbatched Hugging Face forward's mean-pooled, L2-normalised final hidden state within
1e-3 (float32; vLLM's kernels sum in their own order). One vLLM start-up."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import corpus, job_overrides, read_output, write_parquet
from tests.vllm_tier.test_vllm_jobs import EAGER, run_vllm

pytestmark = pytest.mark.vllm


def test_embeddings_on_vllm_equal_an_unbatched_forwards_pooled_state(vllm_model, tmp_path):
    rows = [{"uid": f"e{i}", "prompt": p} for i, p in enumerate(corpus(12, seed=41))]
    data = write_parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out"
    run_vllm(job_overrides(vllm_model, data, out, "engine=vllm", EAGER, "task=embed", "dataset.id_column=uid",
                           "run.rows_per_part=5"))
    got = {r["id"]: r for r in read_output(out).to_pylist()}  # id: the uid column's
    tok = AutoTokenizer.from_pretrained(vllm_model)
    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32).eval()
    for r in rows:
        with torch.no_grad():
            states = model.model(torch.tensor([tok(r["prompt"])["input_ids"]])).last_hidden_state[0].double()
        want = states.mean(dim=0)
        want = want / want.norm()
        row = got[r["uid"]]
        assert row["finish_reason"] == "scored" and row["generation"] is None
        assert row["embedding"] == pytest.approx(want.tolist(), abs=1e-3)
