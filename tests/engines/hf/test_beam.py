"""Beam search (sampling.num_beams): greedy float32 output of a real job equals transformers' generate(num_beams=4)
for every row of a 32-row test, the best n hypotheses come out as samples in rank order, and the settings that
beam search cannot honour are refused."""

from __future__ import annotations

import pytest
import torch

from batchgen.errors import ConfigError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, job_overrides, read_output, write_parquet

NEW = 12


def hf_beams(model, tokenizer, text, *, num_beams, n, **kwargs):
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=num_beams,
                             num_return_sequences=n, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id, **kwargs)
    seqs = []
    for seq in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(seq) if t == tokenizer.eos_token_id), len(seq))
        seqs.append(tokenizer.decode(seq[:cut], skip_special_tokens=True))
    return seqs


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.mark.parametrize("n, extra", [(1, ()), (4, ("sampling.length_penalty=0.5", "sampling.early_stopping=true"))])
def test_beam_search_equals_hf_generate_for_every_row(tiny_model, tokenizer, hf_model, tmp_path, n, extra):
    texts = corpus(32, seed=31)
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in texts])
    out = tmp_path / "out"
    summary = run_job(compose_job(job_overrides(tiny_model, data, out, "sampling.num_beams=4", f"sampling.n={n}",
                                                f"sampling.max_new_tokens={NEW}", "run.rows_per_part=8", *extra)))
    assert summary.state == "done"
    rows = read_output(out).to_pylist()
    assert len(rows) == 32 * n and [r["sample_index"] for r in rows[:n]] == list(range(n))
    kwargs = {"length_penalty": 0.5, "early_stopping": True} if extra else {}
    for i, text in enumerate(texts):
        ours = [r["generation"] for r in rows[i * n:(i + 1) * n]]
        assert ours == hf_beams(hf_model, tokenizer, text, num_beams=4, n=n, **kwargs), f"row {i}"
    assert all(r["finish_reason"] in ("stop", "length") and r["num_generated_tokens"] <= NEW for r in rows)
    if n == 1:  # beam search is in effect: most rows differ from greedy decoding
        greedy = [hf_beams(hf_model, tokenizer, text, num_beams=1, n=1)[0] for text in texts]
        assert sum(g != r["generation"] for g, r in zip(greedy, rows)) >= 16


def test_settings_beam_search_cannot_honour_are_refused(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    base = job_overrides(tiny_model, data, tmp_path / "o", "sampling.num_beams=2")
    for extra, message in ((["sampling.n=3"], "sampling.n=3 > sampling.num_beams=2"),
                           (["sampling=sample", "sampling.temperature=0.7"], "set sampling.temperature=0"),
                           (["sampling.stop=[x]"], "cannot go with sampling.stop"),
                           (["sampling.early_stopping=maybe"], "sampling.early_stopping must be")):
        with pytest.raises(ConfigError, match=message):
            compose_job(base + extra)
