"""Annotation outputs beside the text: token log-probabilities (sampling.logprobs), the reasoning split
(sampling.reasoning) and per-row sampling parameters from columns."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from batchgen.run.runner import run_job
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


THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n<think>\n{% endif %}"  # a reasoning model's: it opens the block
)


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """A tiny random Llama whose chat template opens a <think> block, with <think> and </think> as tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchgen.engines.toymodel import build_model

    path = tmp_path_factory.mktemp("models") / "thinking-llama"
    build_model(path, corpus(), size="tiny")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(path)
    return str(path)


def chats(tmp_path, n=10):
    rows = [{"messages": [{"role": "user", "content": t}]} for t in corpus(n, seed=8)]
    return write_parquet(tmp_path / "chats.parquet", rows)


def test_reasoning_split_with_a_constraint_after_the_block(thinking_model, tmp_path):
    """reasoning=auto: the template opens the block, so every row thinks first, free; past max_reasoning_tokens
    </think> is forced; from there the schema holds. `reasoning` holds the thinking, `generation` the JSON."""
    import json

    import jsonschema
    from transformers import AutoTokenizer

    from tests.test_constraints import TICKET

    schema = tmp_path / "ticket.json"
    schema.write_text(json.dumps(TICKET))
    out = tmp_path / "out"
    run_job(compose_job(job_overrides(thinking_model, chats(tmp_path), out, "dataset.messages_column=messages",
                                      "sampling.reasoning=auto", "sampling.max_reasoning_tokens=6",
                                      f"sampling.json_schema={schema}", "sampling.max_new_tokens=60")))
    tok = AutoTokenizer.from_pretrained(thinking_model)
    end = tok.convert_tokens_to_ids("</think>")
    rows = read_output(out).to_pylist()
    assert len(rows) == 10
    for row in rows:
        assert row["error"] is None and row["finish_reason"] == "stop", row
        jsonschema.validate(json.loads(row["parsed"]), TICKET)
        assert row["generation"] == row["parsed"]
        assert row["reasoning"] and "</think>" not in row["reasoning"] and "<think>" not in row["reasoning"]
        assert not row["reasoning"].startswith("{")  # the thinking was free: random text, not the schema's JSON
        answer = tok(row["generation"], add_special_tokens=False)["input_ids"]
        assert end not in answer and row["num_generated_tokens"] > 6 + 1  # thinking, </think>, the answer


def test_reasoning_split_without_a_constraint_and_off_by_default(thinking_model, tmp_path):
    out = tmp_path / "split"
    run_job(compose_job(job_overrides(thinking_model, chats(tmp_path, 6), out, "dataset.messages_column=messages",
                                      "sampling.reasoning=split", "sampling.max_reasoning_tokens=4",
                                      "sampling.max_new_tokens=12", "sampling.ignore_eos=true")))
    for row in read_output(out).to_pylist():
        assert row["reasoning"] is not None and "</think>" not in row["generation"]
        assert row["num_generated_tokens"] == 12
    off = tmp_path / "off"
    run_job(compose_job(job_overrides(thinking_model, chats(tmp_path, 6), off, "dataset.messages_column=messages",
                                      "sampling.max_new_tokens=4")))
    assert "reasoning" not in read_output(off).schema.names


def test_per_row_temperature_stop_choice_and_schema_from_columns_with_bad_values_as_error_rows(tiny_model, tmp_path):
    import json

    import jsonschema

    from tests.test_constraints import TICKET

    flag = {"type": "object", "properties": {"spam": {"type": "boolean"}}, "required": ["spam"],
            "additionalProperties": False}
    (tmp_path / "ticket.json").write_text(json.dumps(TICKET))
    texts = corpus(9, seed=4)
    rows = [  # (temperature, stop, choices, schema name)
        {"t": 0.0, "stop": None, "choices": ["yes", "no"], "schema": None},
        {"t": 0.9, "stop": ["the"], "choices": None, "schema": None},
        {"t": None, "stop": ["zq", "qz"], "choices": ["red", "green", "blue"], "schema": None},
        {"t": -1.0, "stop": None, "choices": None, "schema": None},  # bad_temperature
        {"t": None, "stop": None, "choices": ["x", "x"], "schema": None},  # bad_choice
        {"t": None, "stop": None, "choices": None, "schema": "ticket"},
        {"t": None, "stop": None, "choices": None, "schema": "flag"},
        {"t": None, "stop": None, "choices": None, "schema": "nope"},  # bad_schema
        {"t": None, "stop": None, "choices": None, "schema": None},  # free, greedy
    ]
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": p, **r, "choices": r["choices"]}
                                                   for p, r in zip(texts, rows)])
    # one file holds both per-row constraint kinds: choices and schema names are two jobs' columns
    out = tmp_path / "choices"
    run_job(compose_job(job_overrides(tiny_model, data, out, "dataset.temperature_column=t",
                                      "dataset.stop_column=stop", "dataset.choice_column=choices",
                                      "sampling.max_new_tokens=24",
                                      "sampling.choice_scores=true", "run.max_error_rate=1")))
    got = read_output(out).to_pylist()
    assert [r["error"] and r["error"].split(":")[0] for r in got] == [
        None, None, None, "bad_temperature", "bad_choice", None, None, None, None]
    assert got[0]["generation"] in ("yes", "no") and got[0]["seed"] is None
    assert got[2]["generation"] in ("red", "green", "blue") and got[2]["parsed"] == got[2]["generation"]
    assert [label for label, _ in got[2]["choice_scores"]] == ["red", "green", "blue"]  # the row's own labels
    assert got[1]["seed"] is not None and "the" not in got[1]["generation"]  # sampled, cut before its own stop
    assert got[5]["parsed"] is None and got[5]["choice_scores"] is None  # no choice list: a free row
    out = tmp_path / "schemas"
    run_job(compose_job(job_overrides(tiny_model, data, out, "dataset.schema_column=schema",
                                      f"+sampling.schemas.ticket={tmp_path / 'ticket.json'}",
                                      "+sampling.schemas.flag={type: object, properties: {spam: {type: boolean}}, "
                                      "required: [spam], additionalProperties: false}", "sampling.max_new_tokens=40")))
    got = read_output(out).to_pylist()
    assert got[7]["error"].startswith("bad_schema: 'nope' is not one of sampling.schemas (flag, ticket)")
    jsonschema.validate(json.loads(got[5]["parsed"]), TICKET)
    jsonschema.validate(json.loads(got[6]["parsed"]), flag)
    assert got[0]["parsed"] is None and got[0]["error"] is None  # no schema name: free
