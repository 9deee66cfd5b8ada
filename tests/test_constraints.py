"""Structured outputs (sampling.json_schema, regex, choice, grammar): checked before load, applied by the hf engine
through xgrammar, every output validated, constrained and free rows sharing a decode step, resume after SIGKILL."""

from __future__ import annotations

import json

import jsonschema
import pyarrow.parquet as pq
import pytest

from batchgen.constraints import Constraint, check, from_sampling
from batchgen.errors import ConfigError, ResumeMismatchError
from batchgen.records import Request
from batchgen.run.runner import run_job
from batchgen.sampling import SampleParams, SamplingConfig
from tests.conftest import compose_job, corpus, generate_generic, job_overrides, read_output, run_cli, write_parquet

# bounded: an enum label and a boolean; random weights cannot fail it
TICKET = {"type": "object", "properties": {"label": {"enum": ["billing", "bug", "feature", "account", "other"]},
                                           "urgent": {"type": "boolean"}},
          "required": ["label", "urgent"], "additionalProperties": False}
OPEN = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ["yes", "no", "not sure"]


@pytest.fixture
def prompts(tmp_path):
    return write_parquet(tmp_path / "in.parquet", [{"prompt": p} for p in corpus(40, seed=3)])


def constrained(tiny_model, prompts, out, *extra):
    return compose_job(job_overrides(tiny_model, prompts, out, "sampling.max_new_tokens=48", *extra))


def schema_file(tmp_path, schema, name="schema.json"):
    path = tmp_path / name
    path.write_text(json.dumps(schema))
    return path


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice"])
def test_every_stop_row_of_a_constrained_job_parses_and_validates(tiny_model, prompts, tmp_path, kind):
    value = {"json_schema": str(schema_file(tmp_path, TICKET)), "regex": f"'{REGEX}'",  # quoted for Hydra: {2,6}
             "choice": json.dumps(CHOICES)}[kind]
    summary = run_job(constrained(tiny_model, prompts, tmp_path / "out", f"sampling.{kind}={value}"))
    t = read_output(tmp_path / "out").to_pylist()
    assert len(t) == 40 and summary.totals.invalid_outputs == 0
    for row in t:
        assert row["finish_reason"] == "stop" and row["error"] is None, row  # 100%: bounded constraints
        parsed = row["parsed"]  # a schema's JSON text; a choice's or regex's value itself, not JSON text
        if kind == "json_schema":
            jsonschema.validate(json.loads(parsed), TICKET)
            assert row["generation"] == parsed  # compact: no whitespace the model could loop on
        elif kind == "choice":
            assert parsed == row["generation"] and parsed in CHOICES
        else:
            import re

            assert parsed == row["generation"] and re.fullmatch(REGEX, parsed)


def test_a_truncated_constrained_row_is_invalid_output_and_keeps_its_text(tiny_model, prompts, tmp_path):
    """A free string field and a cap of 6 tokens: the JSON cannot close; each such row keeps its text and says why,
    and the job goes on (invalid outputs are not input errors: run.max_error_rate does not count them)."""
    cfg = compose_job(job_overrides(tiny_model, prompts, tmp_path / "out", "sampling.max_new_tokens=6",
                                    f"sampling.json_schema={schema_file(tmp_path, OPEN)}", "run.max_error_rate=0"))
    summary = run_job(cfg)
    rows = read_output(tmp_path / "out").to_pylist()
    assert summary.state == "done" and summary.totals.invalid_outputs == 40 and summary.totals.error_rows == 0
    for row in rows:
        assert row["finish_reason"] == "length" and row["generation"].startswith('{"')
        assert row["error"].startswith("invalid_output: truncated") and row["parsed"] is None
    stats = json.loads(pq.read_metadata(next((tmp_path / "out").glob("part-*.parquet"))).metadata[b"batchgen.stats"])
    assert stats["invalid_outputs"] == 40 and stats["errors"] == {}
    assert "invalid outputs: 40 constrained samples" in summary.render()
    status = json.loads((tmp_path / "out" / "_status.json").read_text())
    assert status["invalid_outputs"] == 40 and status["rows_failed"] == 0
    proc = run_cli(["status", str(tmp_path / "out")])
    assert "invalid outputs: 40" in proc.stdout, proc.stdout + proc.stderr


def test_the_output_check_names_what_is_wrong():
    schema = Constraint("json_schema", json.dumps(TICKET, sort_keys=True))
    assert check(schema, '{"label": "bug", "urgent": true}', "stop") == ('{"label":"bug","urgent":true}', None)
    assert check(schema, '{"label": "bug"', "stop")[1].startswith("invalid_output: not JSON")
    assert check(schema, '{"label": "cat", "urgent": true}', "stop")[1].startswith("invalid_output: schema: at label")
    assert check(schema, '{"label": "bug", "urgent": true}', "length")[1].startswith("invalid_output: truncated")
    choice = Constraint("choice", json.dumps(CHOICES))
    assert check(choice, "not sure", "stop") == ("not sure", None)  # the label itself, not the JSON '"not sure"'
    assert "none of the choices" in check(choice, "nope", "stop")[1]
    regex = Constraint("regex", REGEX)
    assert check(regex, "ab-12", "stop") == ("ab-12", None) and check(regex, "ab-123", "stop")[1] is not None
    grammar = Constraint("grammar", 'root ::= "a" [0-9]+')
    assert check(grammar, "a12", "stop") == ("a12", None) and check(grammar, "b12", "stop")[1] is not None


@pytest.mark.parametrize(("settings", "expect"), [
    ({"regex": "a+", "choice": ["a"]}, "sampling: set one constraint at a time, not sampling.regex and sampling.ch"),
    ({"json_schema": {"type": "objec"}}, "sampling.json_schema: not a valid JSON schema"),
    ({"json_schema": "/no/such/schema.json"}, "sampling.json_schema: cannot read the schema file /no/such"),
    ({"regex": "[a-"}, "sampling.regex: does not compile"),
    ({"grammar": "root ::= undefined_rule"}, "sampling.grammar: does not compile"),
    ({"choice": ["a", "a"]}, "sampling.choice: the choices repeat"),
    ({"choice": []}, None),  # an empty list is no constraint
])
def test_constraint_problems_name_the_key(settings, expect):
    constraint, problems = from_sampling(SamplingConfig(**settings))
    if expect is None:
        assert constraint is None and problems == []
    else:
        assert constraint is None and len(problems) == 1 and problems[0].startswith(expect), problems


def test_a_bad_schema_exits_2_before_anything_loads(tiny_model, prompts, tmp_path):
    bad = schema_file(tmp_path, {"type": "object", "properties": {"x": {"type": 5}}})
    proc = run_cli(job_overrides(tiny_model, prompts, tmp_path / "out", f"sampling.json_schema={bad}"))
    assert proc.returncode == 2 and "sampling.json_schema: not a valid JSON schema at properties/x/type" in proc.stderr
    assert not (tmp_path / "out").exists()
    both = run_cli(job_overrides(tiny_model, prompts, tmp_path / "out", "sampling.regex=a+", "sampling.choice=[a]",
                                 "sampling.ignore_eos=true"))
    assert both.returncode == 2 and "set one constraint at a time" in both.stderr


def test_a_vllm_without_the_structured_output_api_exits_2(tiny_model, prompts, tmp_path):
    """An old vLLM (here a stand-in package: version 0.9, no StructuredOutputsParams) must refuse a constrained job
    before loading, never run it unconstrained."""
    fake = tmp_path / "old-vllm" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "0.9.2"\n')
    (fake / "sampling_params.py").write_text("class SamplingParams:\n    pass\n")
    proc = run_cli(job_overrides(tiny_model, prompts, tmp_path / "out", "engine=vllm", "sampling.choice=[a,b]"),
                   env={"PYTHONPATH": str(fake.parent)})
    assert proc.returncode == 2, proc.stderr
    assert "engine=vllm 0.9.2 has no structured-output API" in proc.stderr


def test_resume_with_another_schema_is_refused_and_the_same_schema_by_another_path_is_not(tiny_model, prompts,
                                                                                          tmp_path):
    out = tmp_path / "out"
    run_job(constrained(tiny_model, prompts, out, f"sampling.json_schema={schema_file(tmp_path, TICKET)}"))
    copy = schema_file(tmp_path, TICKET, "copy.json")  # same content, another file
    assert run_job(constrained(tiny_model, prompts, out, f"sampling.json_schema={copy}")).state == "already_done"
    other = schema_file(tmp_path, {**TICKET, "required": ["label"]}, "other.json")
    with pytest.raises(ResumeMismatchError, match="sampling"):
        run_job(constrained(tiny_model, prompts, out, f"sampling.json_schema={other}"))


def test_a_constrained_row_and_a_free_row_in_one_decode_step_each_give_what_they_give_alone(tiny_model, tokenizer,
                                                                                            prompts):
    from batchgen.engines import build_engine

    cfg = compose_job(["name=t", f"engine.model={tiny_model}", "engine.dtype=float32", f"dataset.path={prompts}"])
    engine = build_engine(cfg.engine, tokenizer)
    schema = Constraint("json_schema", json.dumps(TICKET, sort_keys=True))
    ids = [tokenizer(p)["input_ids"] for p in corpus(6, seed=9)]
    reqs = [Request(key=k, prompt_ids=ids[k], seed=None,
                    params=SampleParams(max_new_tokens=40, temperature=0.0, top_p=1.0, top_k=0, stop=(),
                                        ignore_eos=False, constraint=schema if k % 2 == 0 else None))
            for k in range(len(ids))]
    together = engine.generate(reqs)
    alone = [engine.generate([r])[0] for r in reqs]
    assert [r.text for r in together] == [r.text for r in alone]
    assert engine.counters.decode_steps > 0
    # the generic path (any architecture: the model's own forward) constrains the same way
    assert [r.text for r in generate_generic(engine, reqs)] == [r.text for r in together]
    for r in together[0::2]:
        jsonschema.validate(json.loads(r.text), TICKET)
    assert not any(r.text.startswith("{") for r in together[1::2])  # the free rows are not constrained
    with pytest.raises(ConfigError, match="engine=dummy does not constrain"):
        compose_job(["name=t", "engine=dummy", f"engine.model={tiny_model}", f"dataset.path={prompts}",
                     "sampling.regex=a+"])


@pytest.mark.slow
def test_greedy_constrained_output_is_identical_after_sigkills(tiny_model, tmp_path, capsys):
    from tests.scenarios.test_crash import load_harness

    schema = schema_file(tmp_path, TICKET)
    report = load_harness().run_harness(3, work=tmp_path, model=tiny_model, rows=24, seed=11, max_new_tokens=40,
                                        extra=(f"sampling.json_schema={schema}",))
    with capsys.disabled():
        print("\nconstrained " + report.render())
    assert report.kills >= 3 and report.rows_checked >= 24


def test_choice_scores_sum_to_one_and_equal_a_separate_forward_pass_of_each_choice(tiny_model, tokenizer, prompts,
                                                                                   tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    labels = ["billing", "bug", "bugfix", "feature request"]  # "bug" is a prefix of "bugfix": EOS tells them apart
    out = tmp_path / "out"
    summary = run_job(constrained(tiny_model, prompts, out, f"sampling.choice={json.dumps(labels)}",
                                  "sampling.choice_scores=true", "run.rows_per_part=16"))
    rows = read_output(out).to_pylist()
    assert summary.state == "done" and len(rows) == 40
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    texts = [r["prompt"] for r in pq.read_table(prompts).to_pylist()]
    for row, text in zip(rows, texts):
        scores = dict(row["choice_scores"])  # a map: (label, score) pairs in label order
        assert list(scores) == labels
        assert abs(sum(scores.values()) - 1) < 1e-4
        prompt = tokenizer(text)["input_ids"]
        logps = []
        for label in labels:  # each choice alone: one unpadded forward pass of prompt + choice + EOS
            tail = tokenizer(label, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tail])).logits[0].float()
            logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
            logps.append(float(logp.gather(-1, torch.tensor(tail)[:, None]).sum()))
        expected = torch.softmax(torch.tensor(logps, dtype=torch.float64), dim=0).tolist()
        assert list(scores.values()) == pytest.approx(expected, abs=1e-4)
        best = max(scores, key=scores.get)  # greedy: the answer is the top score, never generated
        assert row["generation"] == best and row["error"] is None and row["parsed"] == best
        assert row["num_generated_tokens"] == len(tokenizer(best, add_special_tokens=False)["input_ids"]) + 1


def test_choice_scores_count_the_logit_bias_the_answer_is_picked_with(tiny_model, tokenizer, tmp_path):
    """sampling.choice_scores scored each choice from the raw logits, ignoring logit_bias and the penalties: a bias
    that flips the label without scores answered the other label with them. Both now answer the biased label."""
    labels = ["billing", "feature"]
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": p} for p in corpus(4, seed=4)])

    def run(name: str, *extra: str) -> list[dict]:
        run_job(constrained(tiny_model, data, tmp_path / name, f"sampling.choice={json.dumps(labels)}", *extra))
        return read_output(tmp_path / name).to_pylist()

    plain = [r["generation"] for r in run("plain", "sampling.choice_scores=true")]
    usual = max(labels, key=plain.count)
    other = labels[1 - labels.index(usual)]
    first = {label: tokenizer(label, add_special_tokens=False)["input_ids"][0] for label in labels}
    assert first[usual] != first[other]
    bias = f"sampling.logit_bias={{{first[other]}: 100, {first[usual]}: -100}}"
    unscored = [r["generation"] for r in run("unscored", bias)]
    scored = run("scored", bias, "sampling.choice_scores=true", "sampling.repetition_penalty=1.2")
    assert unscored == [other] * 4
    assert [r["generation"] for r in scored] == [other] * 4
    assert all(dict(r["choice_scores"])[other] > 0.99 for r in scored)


def test_labels_are_values_read_by_the_recipes_pandas_and_duckdb_lines(tiny_model, tmp_path, monkeypatch):
    """A choice's `parsed` is the label itself (it was the JSON text '"bug"', so `df.parsed == "bug"` was all
    False) and choice_scores a map of label to probability: docs/recipes.md's "A label set" Python, run as written
    over a job=classify output, selects rows by label and reads one label's probability without a pivot."""
    import re

    from tests.conftest import REPO

    out = tmp_path / "data" / "outputs" / "classify"
    summary = run_job(compose_job(["job=classify", f"dataset.path={REPO / 'data/demo/tickets.parquet'}",
                                   f"engine.model={tiny_model}", f"output_dir={out}", "dataset.limit=6",
                                   "engine.dtype=float32", "run.progress=false"]))
    assert summary.state == "done"
    labels = ["billing", "bug", "feature", "account", "other"]
    recipes = (REPO / "docs" / "recipes.md").read_text()
    section = recipes[recipes.index("## A label set"):recipes.index("## A nightly job")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2 and "pd.read_parquet" in blocks[0] and "duckdb" in blocks[1]
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(blocks[0], names)  # noqa: S102 - the documentation's own lines
    df = names["df"]
    assert len(df) == 6 and set(df.parsed) <= set(labels) and (df.parsed == df.generation).all()
    for _, row in df.iterrows():
        scores = dict(row.choice_scores)
        assert list(scores) == labels and abs(sum(scores.values()) - 1) < 1e-4
        assert row.p_bug == scores["bug"] and row.parsed == max(scores, key=scores.get)  # greedy: the top label
    assert int((df.parsed == "bug").sum()) == sum(r.parsed == "bug" for r in df.itertuples())
    pytest.importorskip("duckdb")
    exec(blocks[1], names)  # noqa: S102
    by_id = {i: (p, b) for i, p, b in names["rows"]}
    assert by_id == {i: (p, b) for i, p, b in zip(df.id, df.parsed, df.p_bug)}


def test_an_output_with_quoted_labels_is_neither_resumed_nor_retried_into_the_new_form(tiny_model, prompts, tmp_path):
    """An output started when a choice's `parsed` was JSON text ('"yes"') and choice_scores a list of structs (its
    manifest has no `output.parsed: plain`) is refused on resume and by `batchgen retry`, exit 2, naming both forms
    and what to do, so that no output holds both; a new output resumes as usual."""
    out = tmp_path / "out"
    args = (f"sampling.choice={json.dumps(CHOICES)}", "run.rows_per_part=20", "sampling.choice_scores=true")
    run_job(constrained(tiny_model, prompts, out, *args))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["output_config"]["output"] == {"parsed": "plain"}
    (out / "_SUCCESS").unlink()
    (out / "part-00001.parquet").unlink()
    assert run_job(constrained(tiny_model, prompts, out, *args)).state == "done"  # the new form resumes
    del manifest["output_config"]["output"]  # as the batchgen before plain values wrote it
    (out / "_manifest.json").write_text(json.dumps(manifest))
    done = run_cli(["retry", str(out)])
    assert done.returncode == 2 and "whose `parsed` holds a choice, regex or grammar value as JSON text" in done.stderr
    assert "retry it with the batchgen install that started it, or write to a new output_dir" in done.stderr
    (out / "_SUCCESS").unlink()
    (out / "part-00001.parquet").unlink()
    with pytest.raises(ResumeMismatchError, match=r"one output never holds both: resume it with the batchgen"):
        run_job(constrained(tiny_model, prompts, out, *args))
    assert not (out / "part-00001.parquet").exists()
