"""`batchgen view`: the latest-attempt view from the shell, the same rows as output.view.latest, as Parquet, JSONL
or JSON lines on stdout."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from batchgen.output.view import latest
from tests.conftest import dummy_overrides, keyed_rows, run_cli, write_parquet


def test_view_exports_the_latest_attempts_as_the_published_directory_shows_them(tiny_model, tmp_path):
    rows = keyed_rows(12, "r", 4)
    rows[3]["prompt"] = rows[7]["prompt"] = " ".join(["long"] * 300)  # too long for max_model_len=64
    data = write_parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out"
    job = dummy_overrides(tiny_model, data, out, "dataset.id_column=uid", "engine.max_model_len=64",
                          "run.too_long=skip", "sampling.max_new_tokens=8", "run.rows_per_part=5")
    assert run_cli(job).returncode == 0
    retried = run_cli(["retry", str(out), "--kinds", "too_long", "run.too_long=truncate_left"])
    assert retried.returncode == 0, retried.stderr[-3000:]
    assert pq.read_table(out).column("error").null_count == 12  # the directory: published, the 2 errors mended
    assert pq.read_table(out / "_attempts" / "original").column("error").null_count == 8  # parts 0, 1 as committed

    expected = latest(out)
    assert expected.column("error").null_count == 12
    for name in ("view.parquet", "view.jsonl"):
        done = run_cli(["view", str(out), "--to", str(tmp_path / name)])
        assert done.returncode == 0 and "12 rows written" in done.stderr, done.stderr
    assert pq.read_table(tmp_path / "view.parquet").equals(expected)
    lines = [json.loads(line) for line in (tmp_path / "view.jsonl").read_text().splitlines()]
    assert [(r["id"], r["generation"], r["error"]) for r in lines] == list(zip(
        *(expected.column(c).to_pylist() for c in ("id", "generation", "error"))))
    shown = run_cli(["view", str(out), "--columns", "id,attempt", "--limit", "5"])
    assert [json.loads(line) for line in shown.stdout.splitlines()] == expected.select(["id", "attempt"]).slice(
        0, 5).to_pylist()
    assert list(tmp_path.glob(".view*")) == []  # no temporary file left
    refused = run_cli(["view", str(tmp_path), "--to", str(tmp_path / "v.csv")])
    assert refused.returncode == 2 and "no _manifest.json" in refused.stderr


def test_view_on_stdout_writes_controls_and_bidi_overrides_as_json_escapes_and_a_file_keeps_them(tiny_model,
                                                                                                  tmp_path):
    from tests.commands.test_terminal import HOSTILE, assert_safe

    rows = [{"uid": f"u{i}\x9b2J\u202e{HOSTILE}", "prompt": f"say {i}\x9b\u202e\x7f"} for i in range(3)]
    out = tmp_path / "out"
    job = dummy_overrides(tiny_model, write_parquet(tmp_path / "in.parquet", rows), out, "dataset.id_column=uid",
                          "output.include_prompt=true", "sampling.max_new_tokens=4")
    assert run_cli(job).returncode == 0
    expected = latest(out).select(["id", "prompt"]).to_pylist()
    assert {r["id"] for r in expected} == {r["uid"] for r in rows}

    shown = run_cli(["view", str(out), "--columns", "id,prompt"])
    assert shown.returncode == 0, shown.stderr
    assert_safe(shown.stdout)
    assert "\\u009b2J\\u202e" in shown.stdout
    assert [json.loads(line) for line in shown.stdout.splitlines()] == expected  # the same values
    assert run_cli(["view", str(out), "--columns", "id,prompt", "--to", str(tmp_path / "v.jsonl")]).returncode == 0
    assert "\x9b2J\u202e" in (tmp_path / "v.jsonl").read_text(encoding="utf-8")  # a file holds the rows as they are
