"""rowparams.py, the logits processors' per-row columns: each value checked as its sampling.* key is (a bad one is
that row's bad_value, naming the column), a null value takes the job's setting, a logit_bias token id past the
tokenizer is refused (the job's: a config error; a row's: its row), and a job's rows with their own values generate
what a job with those values set for every row generates."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from batchgen.errors import ConfigError
from batchgen.prompts.rowparams import RowParams
from batchgen.reader import DatasetConfig
from batchgen.reader.values import JSON_TEXT
from batchgen.run.runner import run_job
from batchgen.sampling import SamplingConfig
from tests.conftest import compose_job, corpus, job_overrides, read_output, write_jsonl

COLUMNS = {"repetition_penalty_column": "rep", "presence_penalty_column": "pres", "frequency_penalty_column": "freq",
           "min_p_column": "minp", "min_tokens_column": "mint", "logit_bias_column": "bias"}


def settings(values: dict[str, list], sampling: SamplingConfig | None = None, vocab: int = 100):
    params = RowParams(DatasetConfig(path="unused", **COLUMNS), sampling or SamplingConfig(), vocab=vocab)
    n = len(next(iter(values.values())))
    errors = [None] * n
    rows = params.settings(pa.table({name: values.get(name, [None] * n) for name in COLUMNS.values()}), errors)
    return rows, errors


def test_row_values_replace_the_jobs_and_nulls_keep_it():
    job = SamplingConfig(repetition_penalty=1.1, logit_bias={4: 1.0})
    rows, errors = settings({"rep": [1.5, None], "pres": [0.5, None], "freq": [-1, None], "minp": [0.2, None],
                             "mint": [3, None], "bias": ['{"7": -100}', None]}, job)
    assert errors == [None, None]
    assert rows[0].processors == {"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": -1.0,
                                  "min_p": 0.2, "min_tokens": 3, "logit_bias": ((7, -100.0),), "bad_words": (),
                                  "allowed_token_ids": (), "stop_token_ids": ()}
    assert rows[1].processors == job.processors()


def test_a_bad_value_is_its_rows_bad_value_naming_the_column():
    rows, errors = settings({"rep": [0, None, None, None, None, None], "pres": [None, 2.5, None, None, None, None],
                             "minp": [None, None, "x", None, None, None], "mint": [None, None, None, 1.5, None, None],
                             "bias": [None, None, None, None, '{"100": 1}', "{not json"]})
    assert errors[0] == "bad_value: repetition_penalty must be a number > 0 (1 = off) (got 0) " \
                        "(dataset.repetition_penalty_column)"
    assert errors[1].startswith("bad_value: presence_penalty must be a number in [-2, 2]")
    assert "(dataset.min_p_column)" in errors[2] and "(dataset.min_tokens_column)" in errors[3]
    assert errors[4] == "bad_value: logit_bias has token id 100, not one of the tokenizer's 100 ids " \
                        "(dataset.logit_bias_column)"
    assert errors[5].startswith("bad_value: logit_bias must be a mapping")


def test_a_rows_min_tokens_with_a_constraint_is_its_bad_value():
    """min_tokens masks EOS, which a constrained sample needs once its constraint is complete."""
    params = RowParams(DatasetConfig(path="unused", min_tokens_column="mint", choice_column="c"), SamplingConfig())
    errors = [None] * 3
    params.settings(pa.table({"mint": [2, 2, None], "c": [["yes", "no"], None, ["yes", "no"]]}), errors)
    assert errors == ["bad_value: min_tokens=2 with a choice constraint: a constrained sample ends when its "
                      "constraint is complete", None, None]


def test_a_jobs_logit_bias_past_the_tokenizer_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        RowParams(DatasetConfig(path="unused"), SamplingConfig(logit_bias={500: 1.0}), vocab=385)
    assert "sampling.logit_bias has token id 500, not one of the tokenizer's 385 ids" in str(err.value)


def test_a_missing_column_is_a_config_error_naming_its_key():
    with pytest.raises(ConfigError) as err:
        RowParams(DatasetConfig(path="unused", min_p_column="minp"), SamplingConfig()).settings(
            pa.table({"prompt": ["a"]}), [None])
    assert "dataset.min_p_column: column 'minp' not found (columns: prompt)" in str(err.value)


def test_rows_with_their_own_values_generate_what_the_job_setting_would(tiny_model, tmp_path):
    """Rows 0 and 1 carry a repetition penalty and a logit bias; rows 2 and 3 leave them null."""
    own = {"rep": 1.3, "bias": {"5": 3.0}}
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": t, **(own if i < 2 else {})}
                                               for i, t in enumerate(corpus(4, seed=5))])

    def run(name: str, *extra: str) -> list[str]:
        out = tmp_path / name
        run_job(compose_job(job_overrides(tiny_model, data, out, "dataset.id_column=id", "sampling.max_new_tokens=12",
                                          *extra)))
        return read_output(out).column("generation").to_pylist()

    per_row = run("rows", "dataset.repetition_penalty_column=rep", "dataset.logit_bias_column=bias")
    everywhere = run("job", "sampling.repetition_penalty=1.3", "sampling.logit_bias={5: 3.0}")
    plain = run("plain")
    assert per_row[:2] == everywhere[:2] and per_row[2:] == plain[2:]
    assert per_row[:2] != plain[:2]  # the processors change those rows


def test_a_logit_bias_key_is_ascii_digits_and_each_token_once_or_the_rows_bad_value():
    """str.isdigit() takes "²" (int() refuses it: the job died) and "٣" (read as token 3); "1", "01" and "001" are
    one token whose biases added up to +300, past the documented bound."""
    rows, errors = settings({"bias": ['{"²": 1}', '{"٣": 5}', '{"1": 100, "01": 100, "001": 100}', '{"3": 1, "3": 2}',
                                      '{" 3": 1}', '{"9999999999999999999999": 1}', '{"3": 2.5}']})
    assert errors[0] == "bad_value: logit_bias has '²', which is not a token id (an integer >= 0, or its ASCII " \
                        "digits) (dataset.logit_bias_column)"
    assert errors[1].startswith("bad_value: logit_bias has '٣', which is not a token id")
    assert errors[2] == "bad_value: logit_bias gives token 1 two biases (key '01' spells it again); give each token " \
                        "id once (dataset.logit_bias_column)"
    assert errors[3].startswith("bad_value: logit_bias gives token 3 two biases")  # a key written twice in the text
    assert errors[4].startswith("bad_value: logit_bias has ' 3', which is not a token id")
    assert errors[5].startswith("bad_value: logit_bias has '9999999999999999999999', which is not a token id")
    assert errors[6] is None and rows[6].processors["logit_bias"] == ((3, 2.5),)


def test_any_exception_reading_a_rows_value_is_that_rows_error_not_the_jobs():
    """A whole number too large for a float (JSON keeps it exact) made math.isfinite raise OverflowError in the
    checks: the job died on every rerun. The logits processors' checks now refuse it by name; any other check that
    raises makes its row's bad_value (the temperature's, here)."""
    huge = "1" + "0" * 400
    params = RowParams(DatasetConfig(path="unused", logit_bias_column="bias", repetition_penalty_column="rep",
                                     temperature_column="temp"), SamplingConfig(), vocab=100)
    errors = [None] * 4
    mixed = [pa.field(name, pa.string(), metadata=JSON_TEXT) for name in ("rep", "temp")]  # JSONL's mixed types
    table = pa.table([pa.array([None, '{"3": ' + huge + '}', None, None]), pa.array([huge, None, None, "1.2"]),
                      pa.array([None, None, huge, None])], schema=pa.schema([pa.field("bias", pa.string()), *mixed]))
    rows = params.settings(table, errors)
    assert errors[0].startswith("bad_value: repetition_penalty must be a number > 0 (1 = off) (got 1000")
    assert errors[1].startswith("bad_value: logit_bias gives token 3 the bias 1000")
    assert errors[2].startswith("bad_value: column 'temp': 1000") and errors[2].endswith("(OverflowError)")
    assert errors[3] is None and rows[3].processors["repetition_penalty"] == 1.2


def test_a_logit_bias_as_a_struct_with_nulls_or_an_arrow_map_is_read_as_its_object():
    """JSONL objects with different keys read as one struct (a row's missing keys null), a Parquet struct, a Parquet
    map: each row's own pairs, nulls dropped, checked as the JSON text is."""
    struct = pa.array([{"5": 3.0, "7": None}, {"5": None, "7": -2.0}, {"5": None, "7": None}])
    as_map = pa.array([[("5", 3.0)], [("7", -2.0), ("9", None)], [("1", 1.0), ("01", 2.0)]],
                      pa.map_(pa.string(), pa.float64()))
    for column, third in ((struct, None), (as_map, "bad_value: logit_bias gives token 1 two biases")):
        params = RowParams(DatasetConfig(path="unused", logit_bias_column="bias"), SamplingConfig(), vocab=100)
        errors = [None] * 3
        rows = params.settings(pa.table({"bias": column}), errors)
        assert errors[:2] == [None, None], errors
        assert [r.processors["logit_bias"] for r in rows[:2]] == [((5, 3.0),), ((7, -2.0),)]
        assert errors[2] is None and rows[2].processors["logit_bias"] == () if third is None else \
            errors[2].startswith(third)


def test_a_job_reads_logit_bias_objects_with_different_keys_and_survives_a_bad_key(tiny_model, tmp_path):
    """JSONL objects with different keys (one struct column, nulls where a row lacks a key) generate what the same
    biases as JSON text do; a key "²" is its row's bad_value, the job finishes."""
    biases = [{"5": 3.0}, {"9": 4.0, "11": -1.0}, {"²": 1.0}, None]
    texts = corpus(4, seed=8)

    def run(name: str, value) -> list[dict]:
        rows = [{"id": f"r{i}", "prompt": t, "bias": value(b)} for i, (t, b) in enumerate(zip(texts, biases))]
        out = tmp_path / name
        summary = run_job(compose_job(job_overrides(tiny_model, write_jsonl(tmp_path / f"{name}.jsonl", rows), out,
                                                    "dataset.id_column=id", "sampling.max_new_tokens=8",
                                                    "dataset.logit_bias_column=bias", "run.max_error_rate=0.5")))
        assert summary.state == "done"
        return read_output(out).sort_by("id").to_pylist()

    objects = run("objects", lambda b: b)
    text = run("text", lambda b: None if b is None else json.dumps(b))
    assert [r["error"] for r in objects] == [None, None, objects[2]["error"], None]
    assert objects[2]["error"].startswith("bad_value: logit_bias has '²', which is not a token id")
    assert [r["generation"] for r in objects] == [r["generation"] for r in text]


def test_a_rows_token_lists_and_bad_words_replace_the_jobs_and_bad_ones_are_its_bad_value():
    """dataset.stop_token_ids_column, allowed_token_ids_column and bad_words_column: a list or its JSON text, the
    ids sorted and each once; a non-list, an id that is not a token id or past the tokenizer, an empty word, and
    allowed ids with the row's own constraint are that row's bad_value naming the column; the job's ids past the
    tokenizer are a ConfigError naming the key."""
    ds = DatasetConfig(path="unused", stop_token_ids_column="s", allowed_token_ids_column="a",
                       bad_words_column="b", choice_column="c")
    job = SamplingConfig(stop_token_ids=[2], bad_words=["no"])
    params = RowParams(ds, job, vocab=100)
    table = pa.table({"s": ["[7, 3, 7]", None, "[100]", None, None, None],
                      "a": [[5, 4], None, None, [-1], [4], None],
                      "b": [["x y"], None, None, None, None, [" "]],
                      "c": [None, None, None, None, ["yes", "no"], None]})
    errors = [None] * 6
    rows = params.settings(table, errors)
    assert errors[:2] == [None, None]
    assert {k: rows[0].processors[k] for k in ("stop_token_ids", "allowed_token_ids", "bad_words")} == {
        "stop_token_ids": (3, 7), "allowed_token_ids": (4, 5), "bad_words": ("x y",)}
    assert {k: rows[1].processors[k] for k in ("stop_token_ids", "allowed_token_ids", "bad_words")} == {
        "stop_token_ids": (2,), "allowed_token_ids": (), "bad_words": ("no",)}
    assert errors[2] == ("bad_value: stop_token_ids has token id 100, not one of the tokenizer's 100 ids "
                         "(dataset.stop_token_ids_column)")
    assert errors[3].startswith("bad_value: allowed_token_ids must be a list of token ids") and \
        errors[3].endswith("(dataset.allowed_token_ids_column)")
    assert errors[4] == ("bad_value: allowed_token_ids with a choice constraint: the constraint chooses the tokens")
    assert errors[5].startswith("bad_value: bad_words must be a list of words") and "(dataset.bad_words_column)" in \
        errors[5]
    with pytest.raises(ConfigError) as err:
        RowParams(DatasetConfig(path="unused"), SamplingConfig(stop_token_ids=[3, 400], allowed_token_ids=[500]),
                  vocab=385)
    assert "sampling.allowed_token_ids has token id 500, not one of the tokenizer's 385 ids" in str(err.value)
    assert "sampling.stop_token_ids has token id 400, not one of the tokenizer's 385 ids" in str(err.value)
