"""Issue 28, round 2: the latest-attempt view and what reads through it. Duplicate ids keep one view row per input
row through retries of retries (latest() and duckdb_sql agree row for row, retried or not); adjacent duplicate
custom_ids keep one OpenAI results line per request; a retry refuses what changes the samples per row, and a torn
manifest is exit 2 naming it. engine=dummy throughout: too_long rows are the planner's, mended by a retry with a
larger engine.max_model_len."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from batchgen.commands.compose import config_from
from batchgen.commands.retry import INPUT_FILE
from batchgen.commands.retry import main as retry_main
from batchgen.output.view import OCCURRENCE, duckdb_sql, latest
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, job_overrides, write_jsonl, write_parquet

MAX_LEN, NEW = 64, 6
# uid per input row; "mid" rows fit max_model_len=400, "long" ones 2000; both are too long for MAX_LEN
ROWS = [("a", "short"), ("a", "mid"), ("b", "long"), ("c", "short"), ("d", "short"), ("e", "short"),
        ("f", "short"), ("b", "short"), ("g", "short"), ("a", "short"), ("b", "mid")]
PICK = ["id", "sample_index", "generation", "error", "attempt", "topic"]


def prompt(i: int, size: str) -> str:
    words = {"short": 3, "mid": 120, "long": 600}[size]
    return " ".join(" ".join(corpus(60, seed=300 + i)).split()[:words])


def dup_job(tiny_model: str, tmp_path: Path) -> Path:
    rows = [{"uid": uid, "prompt": prompt(i, size), "topic": f"row{i}"} for i, (uid, size) in enumerate(ROWS)]
    data = write_parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out"
    summary = run_job(compose_job(job_overrides(
        tiny_model, data, out, "engine=dummy", "dataset.id_column=uid", f"engine.max_model_len={MAX_LEN}",
        "sampling=sample", "sampling.n=2", f"sampling.max_new_tokens={NEW}", "run.too_long=skip",
        "run.rows_per_part=3", "run.max_error_rate=0.9")))
    assert summary.state == "done" and summary.totals.errors == {"too_long": 3}
    return out


def sql_rows(out: Path, pick: list[str]) -> list[dict]:
    import duckdb

    got = duckdb.sql(duckdb_sql(out)).arrow()
    got = got.read_all() if hasattr(got, "read_all") else got
    return got.select(pick).to_pylist()


def as_multiset(rows: list[dict], pick: list[str]) -> Counter:
    return Counter(tuple(r[c] for c in pick) for r in rows)


def test_case5_duplicate_ids_survive_retry(tiny_model, tmp_path):
    out = dup_job(tiny_model, tmp_path)
    own = pq.read_table(out).select([c for c in PICK if c != "attempt"]).to_pylist()  # the job's rows, input order
    assert [r["topic"] for r in own[::2]] == [f"row{i}" for i in range(len(ROWS))]
    view = latest(out).to_pylist()
    assert [(r["id"], r["topic"]) for r in view] == [(r["id"], r["topic"]) for r in own]
    assert as_multiset(sql_rows(out, PICK), PICK) == as_multiset(view, PICK)  # never retried: duckdb reads it too

    # attempt 1 mends the "mid" rows only; attempt 2 (a retry of a retry) the "long" one
    assert retry_main([str(out), "--kinds", "too_long", "engine.max_model_len=400"], config_from) == 0
    first = pq.read_table(out / "_attempts" / "attempt-001" / INPUT_FILE).to_pylist()
    assert [(r["uid"], r["topic"], r[OCCURRENCE]) for r in first] == [("a", "row1", 1), ("b", "row2", 0),
                                                                       ("b", "row10", 2)]
    assert retry_main([str(out), "--kinds", "too_long", "engine.max_model_len=2000"], config_from) == 0
    second = pq.read_table(out / "_attempts" / "attempt-002" / INPUT_FILE).to_pylist()
    assert [(r["uid"], r["topic"], r[OCCURRENCE]) for r in second] == [("b", "row2", 0)]

    view = latest(out).to_pylist()
    assert len(view) == len(own) and OCCURRENCE not in latest(out).column_names
    assert [r["topic"] for r in view[::2]] == [f"row{i}" for i in range(len(ROWS))]  # each row where it stood
    want_attempt = {1: 1, 2: 2, 10: 1}
    for i, (before, after) in enumerate(zip(own, view)):
        row = i // 2
        assert after["attempt"] == want_attempt.get(row, 0), (row, after)
        if row in want_attempt:
            assert after["error"] is None and after["generation"]
        else:  # a good row of a duplicated id is untouched
            assert {c: after[c] for c in before} == before
    assert as_multiset(sql_rows(out, PICK), PICK) == as_multiset(view, PICK)
    assert OCCURRENCE not in pq.read_schema(out / "part-00000.parquet").names


def test_case5_retry_parts_without_occurrences_read_as_before(tiny_model, tmp_path):
    """A retry written before occurrences were recorded: its rows match every row of their id (id-only), and
    duckdb_sql still gives latest()'s rows."""
    out = dup_job(tiny_model, tmp_path)
    assert retry_main([str(out), "--kinds", "too_long", "engine.max_model_len=2000"], config_from) == 0
    for part in (out / "_attempts" / "attempt-001").glob("part-*.parquet"):
        table = pq.read_table(part)
        pq.write_table(table.drop_columns([OCCURRENCE]), part)
    view = latest(out).to_pylist()
    assert {r["attempt"] for r in view if r["id"] in ("a", "b")} == {1}  # id-only: every row of a retried id
    assert {r["attempt"] for r in view if r["id"] not in ("a", "b")} == {0}
    assert as_multiset(sql_rows(out, PICK), PICK) == as_multiset(view, PICK)


def test_case6_adjacent_duplicate_custom_ids_keep_one_line_per_request(tiny_model, tmp_path):
    import json

    from batchgen.output.openai_out import RESULTS

    def request(cid: str, text: str, **body) -> dict:
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **body}}

    texts = corpus(4, seed=8)
    lines = [request("dup", texts[0], temperature=0.9, n=2), request("dup", texts[1], temperature=0),
             request("solo", texts[2], temperature=0), request("dup", texts[3], temperature=0)]
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out"
    summary = run_job(compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "dataset.format=openai_batch",
                                                "output.format=openai_batch", "run.rows_per_part=2")))
    assert summary.state == "done"
    results = [json.loads(x) for x in (out / RESULTS).read_text().splitlines()]
    assert [x["custom_id"] for x in results] == ["dup", "dup", "solo", "dup"]  # one line per request, in order
    assert len({x["id"] for x in results}) == 4 and len({x["response"]["request_id"] for x in results}) == 4
    choices = [x["response"]["body"]["choices"] for x in results]
    assert [[c["index"] for c in cs] for cs in choices] == [[0, 1], [0], [0], [0]]
    rows = pq.read_table(out).to_pylist()
    assert [[c["message"]["content"] for c in cs] for cs in choices] == [
        [rows[0]["generation"], rows[1]["generation"]], [rows[2]["generation"]], [rows[3]["generation"]],
        [rows[4]["generation"]]]
    usage = [x["response"]["body"]["usage"] for x in results]
    assert [u["completion_tokens"] for u in usage] == [rows[0]["num_generated_tokens"] + rows[1][
        "num_generated_tokens"], rows[2]["num_generated_tokens"], rows[3]["num_generated_tokens"],
        rows[4]["num_generated_tokens"]]


def test_case13b_retry_refuses_what_changes_the_samples_per_row(tiny_model, tmp_path, capsys):
    out = dup_job(tiny_model, tmp_path)
    for override, key in (("sampling.n=3", "sampling.n"), ("+sampling.n=1", "sampling.n"),
                          ("dataset.n_column=topic", "dataset.n_column"), ("sampling={n: 3}", "sampling")):
        assert retry_main([str(out), "--kinds", "too_long", "engine.max_model_len=2000", override], config_from) == 2
        err = capsys.readouterr().err
        assert f"{key}: " in err and "samples per row" in err, err
    assert not (out / "_attempts").exists()  # refused before anything is written


def test_case13b_a_torn_manifest_is_exit_2_naming_the_file(tiny_model, tmp_path, capsys):
    out = dup_job(tiny_model, tmp_path)
    manifest = out / "_manifest.json"
    manifest.write_text(manifest.read_text()[:40])  # torn mid-write
    assert retry_main([str(out), "--kinds", "too_long"], config_from) == 2
    err = capsys.readouterr().err
    assert str(manifest) in err and "torn" in err, err
    manifest.unlink()
    assert retry_main([str(out)], config_from) == 2
    assert "no batchgen output here" in capsys.readouterr().err
