"""`batchgen head`: the first rows of an output's latest-attempt view, one line each as make demo prints them,
after a header with the view's row count; a retried row shows its mended attempt; --expect-rows checks the count.
engine=dummy: too_long rows are the planner's, mended by a retry with a larger engine.max_model_len."""

from __future__ import annotations

from batchgen.commands.compose import config_from
from batchgen.commands.head import main
from batchgen.commands.retry import main as retry_main
from batchgen.output.view import latest
from batchgen.run.runner import run_job
from tests.conftest import compose_job, dummy_overrides, job_overrides, keyed_rows, write_parquet


def test_head_prints_the_first_rows_of_the_latest_attempt_view(tiny_model, tmp_path, capsys):
    rows = keyed_rows(7, "r", 5)
    rows[1]["prompt"] = " ".join(["long"] * 300)  # too long for max_model_len=64: an error row, then retried
    data = write_parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out"
    run_job(compose_job(dummy_overrides(tiny_model, data, out, "dataset.id_column=uid", "engine.max_model_len=64",
                                        "run.too_long=skip", "sampling.max_new_tokens=6", "run.rows_per_part=3",
                                        "run.max_error_rate=1")))
    assert main([str(out), "-n", "2"]) == 0
    header, first, second = capsys.readouterr().out.splitlines()
    assert header.startswith(f"{out}: 7 rows, columns: id, sample_index, generation, finish_reason")
    view = latest(out).to_pylist()
    text = view[0]["generation"].replace("\n", " ")[:70]
    assert first == (f"  {view[0]['id']:<12} {view[0]['finish_reason']:<7} prompt={view[0]['num_prompt_tokens']:<4} "
                     f"gen={view[0]['num_generated_tokens']:<4} {text!r}")
    assert second.split()[1:3] == ["error", "prompt=0"] and "'too_long: " in second  # the error stands for the text

    assert retry_main([str(out), "--kinds", "too_long", "engine.max_model_len=2000"], config_from) == 0
    capsys.readouterr()
    assert main([str(out), "-n", "3", "--expect-rows", "7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and " attempt=1 " in lines[2] and lines[2].split()[1] in ("stop", "length")
    assert main([str(out), "-n", "0", "--expect-rows", "8"]) == 1
    assert capsys.readouterr().err.strip() == "batchgen head: expected 8 rows, found 7"


def test_head_refuses_what_is_not_an_output(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2 and "no _manifest.json" in capsys.readouterr().err
    (tmp_path / "_manifest.json").write_text("{}")
    assert main([str(tmp_path)]) == 2 and "holds no committed part" in capsys.readouterr().err
    assert main([str(tmp_path), "-n", "-1"]) == 2 and "0 or more" in capsys.readouterr().err


def test_head_escapes_ids_errors_and_column_names_from_the_rows(tiny_model, tmp_path, capsys):
    """An id, an error quoting a row's value and an input column's name holding terminal escapes (a window title, a
    clear screen), a bidi override and a line that looks like a row of head's own reach the terminal escaped, one
    line per row."""
    from tests.commands.test_terminal import HOSTILE, assert_safe

    rows = [{"uid": f"r0{HOSTILE}", "prompt": "the river town", f"note{HOSTILE}": 1, "temp": None},
            {"uid": "r1", "prompt": "a quiet night", f"note{HOSTILE}": 2, "temp": HOSTILE}]
    data = write_parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out"
    run_job(compose_job(dummy_overrides(tiny_model, data, out, "dataset.id_column=uid",
                                        "dataset.temperature_column=temp", "sampling.max_new_tokens=4",
                                        "run.max_error_rate=1")))
    assert main([str(out)]) == 0
    printed = capsys.readouterr().out
    assert_safe(printed)
    header, first, second = printed.splitlines()
    assert "notex\\x1b]0;pwned\\x07" in header and first.split()[0].startswith("r0x\\x1b]0;pwned\\x07\\x1b[2J\\u202e")
    assert second.split()[:2] == ["r1", "error"]


def test_head_shows_an_invalid_outputs_error_not_only_its_finish_reason(tiny_model, tmp_path, capsys):
    """A constrained sample cut before its match ends (the tiny model on engine=hf, a 20-digit regex, 3 tokens) is
    error=invalid_output, its text kept and its finish reason the engine's: the line shows the error where it showed
    the text after the finish reason `length`, as if the row had succeeded."""
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(2, "r", 5))
    out = tmp_path / "out"
    run_job(compose_job(job_overrides(tiny_model, data, out, "dataset.id_column=uid", "sampling.max_new_tokens=3",
                                      "sampling.regex='[0-9]{20}'")))
    row = latest(out).to_pylist()[0]
    assert row["error"].startswith("invalid_output: ") and row["generation"] and row["finish_reason"] == "length"
    assert main([str(out), "-n", "1"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.split()[1] == "length" and "'invalid_output: " in line and repr(row["generation"]) not in line, line
