"""A hostile dataset: every kind of bad row costs one row (an error row with its reason), duplicate ids are
kept and counted, over-long prompts follow run.too_long, and unreadable or empty inputs behave (docs/contract.md
section 7). On engine=dummy: every case is the reader's, the planner's or the runner's, none a model's."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import BatchgenError, TooLongError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, dummy_overrides, read_output, write_jsonl

LONG = "the river " * 400
HOSTILE = [  # (line, expected id, expected error prefix or None)
    ({"id": "a", "prompt": "the river town"}, "a", None),
    ({"id": "b", "prompt": None}, "b", "empty_prompt"),
    ({"id": "c", "prompt": ""}, "c", "empty_prompt"),
    ({"id": "d", "prompt": "  \n\t "}, "d", "empty_prompt"),
    ({"id": "e", "prompt": 42}, "e", "non_string_prompt: got int"),
    ({"id": "f", "prompt": ["a", "list"]}, "f", "non_string_prompt: got list"),
    (b'{"id": "g", "prompt": "caf\xe9 au lait"}', "in.jsonl:6", "invalid_utf8: line 7"),
    ('{"id": "h", "prompt": "unclosed', "in.jsonl:7", "malformed_json: line 8"),
    ("[1, 2, 3]", "in.jsonl:8", "malformed_json: line 9"),
    ({"id": "a", "prompt": "old clock"}, "a", None),  # duplicate id
    ({"id": "a", "prompt": "quiet harbour"}, "a", None),  # and again
    ({"id": 7, "prompt": "a numeric id"}, "7", None),
    ({"id": "long", "prompt": LONG}, "long", "too_long"),  # an error only under run.too_long=skip
]
TRUNCATED = b'{"id": "z", "prompt": "the last line was cut'  # no newline: the writer died mid-line
N = 2


def hostile_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [line for line, _, _ in HOSTILE])
    with open(path, "ab") as f:
        f.write(TRUNCATED)
    return path


def run(tiny_model, data, out, *extra):
    cfg = compose_job(dummy_overrides(tiny_model, data, out, "dataset.id_column=id", "sampling=sample",
                                      f"sampling.n={N}", "sampling.max_new_tokens=4", "engine.max_model_len=64",
                                      "run.rows_per_part=5", "run.max_error_rate=1.0", *extra))
    return run_job(cfg)


@pytest.mark.parametrize("policy", ["truncate_left", "skip"])
def test_every_hostile_row_gets_one_output_row_per_sample(tiny_model, tmp_path, policy):
    data = hostile_jsonl(tmp_path)
    out = tmp_path / "out"
    summary = run(tiny_model, data, out, f"run.too_long={policy}")
    assert summary.state == "done" and summary.duplicate_ids == 2
    rows = read_output(out).to_pylist()
    want_ids = [i for _, i, _ in HOSTILE] + ["in.jsonl:13"]
    assert [r["id"] for r in rows] == [i for i in want_ids for _ in range(N)]  # input order, ids as given
    assert Counter((r["id"], r["sample_index"]) for r in rows)[("a", 1)] == 3  # duplicates are separate rows
    want_errors = [e for _, _, e in HOSTILE] + ["malformed_json: line 14"]
    if policy == "truncate_left":
        want_errors[-2] = None
    for r, want in zip(rows, [e for e in want_errors for _ in range(N)]):
        if want is None:
            assert r["error"] is None and r["finish_reason"] in ("stop", "length") and r["generation"] is not None
        else:
            assert r["error"].startswith(want) and r["finish_reason"] == "error" and r["generation"] is None, r
    long_row = rows[2 * (len(HOSTILE) - 1)]
    assert long_row["num_prompt_tokens"] == (60 if policy == "truncate_left" else 0)
    status = json.loads((out / "_status.json").read_text())
    assert status["state"] == "done" and status["duplicate_ids"] == 2 and status["rows_done"] == len(HOSTILE) + 1
    assert status["rows_failed"] == sum(e is not None for e in want_errors)
    assert "2 rows repeat an earlier row's id" in summary.render()


def test_a_too_long_prompt_under_fail_stops_the_job_naming_the_row(tiny_model, tmp_path):
    data = hostile_jsonl(tmp_path)
    with pytest.raises(TooLongError, match="row long: too_long.*run.too_long=fail") as err:
        run(tiny_model, data, tmp_path / "out", "run.too_long=fail")
    assert err.value.exit_code == 1
    assert sorted(p.name for p in (tmp_path / "out").glob("part-*")) == ["part-00000.parquet", "part-00001.parquet"]


def test_unreadable_inputs_stop_before_generation_with_exit_2(tiny_model, tmp_path):
    corrupt = tmp_path / "corrupt.parquet"
    pq.write_table(pa.table({"prompt": ["the river"] * 50}), corrupt)
    corrupt.write_bytes(corrupt.read_bytes()[:-30])  # footer cut off
    for path, message in ((corrupt, "corrupt.parquet"), (tmp_path / "missing.jsonl", "missing.jsonl")):
        with pytest.raises(BatchgenError, match=message) as err:
            run_job(compose_job(dummy_overrides(tiny_model, path, tmp_path / "out")))
        assert err.value.exit_code == 2
        assert not (tmp_path / "out" / "_manifest.json").exists()


def test_an_empty_parquet_dataset_gives_a_valid_empty_result(tiny_model, tmp_path):
    data = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), data)
    summary = run_job(compose_job(dummy_overrides(tiny_model, data, tmp_path / "out")))
    assert summary.state == "done" and read_output(tmp_path / "out").num_rows == 0
    assert json.loads((tmp_path / "out" / "_status.json").read_text())["rows_done"] == 0
