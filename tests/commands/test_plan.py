"""`batchgen plan`: the input streamed and tokenized without the model; figures, _plan.json, the histogram PNG,
exit codes; `--calibrate` probes the engine on the longest prompts. The plan and its job run engine=dummy (the
figures are the tokenizer's and the planner's); the calibration probes the hf engine, whose speed it measures."""

from __future__ import annotations

import json

from tests.conftest import corpus, run_cli, write_parquet


def test_plan_counts_what_the_job_would_do_without_loading_the_model(tiny_model, tokenizer, tmp_path):
    texts = corpus(30, seed=2) + ["word " * 300]  # one prompt over max_model_len - max_new_tokens
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in texts] + [{"prompt": ""}])
    out = tmp_path / "out"
    args = ["plan", "name=p", f"output_dir={out}", f"dataset.path={data}", "engine=dummy",
            f"engine.model={tiny_model}", "engine.max_model_len=256", "sampling.max_new_tokens=16",
            "run.rows_per_part=8", "run.num_shards=3"]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((out / "_plan.json").read_text())
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    assert plan["rows"] == 32 and plan["generable_rows"] == 31 and plan["error_rows"] == {"empty_prompt": 1}
    assert plan["prompt_tokens"] == sum(lengths) and plan["prompt_length"]["max"] == max(lengths)
    assert plan["max_generated_tokens"] == 31 * 16
    assert plan["too_long"]["rows"] == sum(n > 256 - 16 for n in lengths) == 1
    assert sum(b["rows"] for b in plan["histogram"]) == 31
    assert plan["parts"] == 4 and plan["shards"]["parts_per_shard"] == [2, 1, 1]
    assert "1 rows over max_model_len - max_new_tokens" in proc.stdout and "prompt length histogram" in proc.stdout
    assert (out / "_plan.png").stat().st_size > 1000 and not (out / "_manifest.json").exists()
    job = run_cli([a for a in args if a not in ("plan", "run.num_shards=3")] + ["run.progress=false"])
    assert job.returncode == 0, job.stderr[-2000:]
    import pyarrow.dataset as ds

    written = ds.dataset(str(out), format="parquet").to_table().to_pylist()
    assert plan["prompt_tokens_after_fit"] == sum(r["num_prompt_tokens"] for r in written) < plan["prompt_tokens"]
    fail = run_cli([*args, "run.too_long=fail"])
    assert fail.returncode == 1 and "would stop" in fail.stderr  # the job would exit 1 at that row
    bad = run_cli([*args, "run.too_lng=skip"])
    assert bad.returncode == 2 and "did you mean run.too_long" in bad.stderr


def test_plan_calibrate_probes_the_longest_prompts_and_prints_an_eta(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(40, seed=3)])
    proc = run_cli(["plan", "--calibrate", "name=p", f"output_dir={tmp_path / 'out'}", f"dataset.path={data}",
                    f"engine.model={tiny_model}", "sampling.max_new_tokens=8"])
    assert proc.returncode == 0, proc.stderr
    calibration = json.loads((tmp_path / "out" / "_plan.json").read_text())["calibration"]
    assert calibration["probe_rows"] == 16 and calibration["probe_tok_s"] > 0 and calibration["eta_s"] > 0
    assert "ETA for the whole job" in proc.stdout


def test_plan_show_prints_the_prompts_as_the_engine_gets_them(tiny_model, tokenizer, tmp_path, capsys):
    """`--show N`: the first N rows' prompts from the job's own rendering, each with its id and token count: a chat
    job's is the tokenizer's apply_chat_template (generation prompt, system prompt first), a template job's the
    template's str.format; a prompt run.too_long would cut is marked, an error row says its error."""
    from batchgen.commands.compose import compose_checked
    from batchgen.commands.plan import main

    said = [[{"role": "user", "content": t}] for t in ["hello there", "word " * 300, "quiet night"]] + [[]]
    rows = [{"uid": f"u{i}", "topic": f"t{i}", "q": m[0]["content"] if m else None, "messages": m or None}
            for i, m in enumerate(said)]
    data = write_parquet(tmp_path / "in.parquet", rows)
    base = ["name=p", f"dataset.path={data}", "engine=dummy", f"engine.model={tiny_model}", "dataset.id_column=uid",
            "engine.max_model_len=128", "sampling.max_new_tokens=16"]
    chat = [*base, f"output_dir={tmp_path / 'chat'}", "dataset.messages_column=messages",
            "dataset.system_prompt=Be brief."]
    assert main(["--show", "4", *chat], compose_checked) == 0
    printed = capsys.readouterr().out
    shown = json.loads((tmp_path / "chat" / "_plan.json").read_text())["shown"]
    system = [{"role": "system", "content": "Be brief."}]
    want = [tokenizer.apply_chat_template(system + m, add_generation_prompt=True, tokenize=False) for m in said[:3]]
    assert [r["prompt"] for r in shown] == [*want, None] and [r["id"] for r in shown] == ["u0", "u1", "u2", "u3"]
    assert [r["prompt_tokens"] for r in shown[:3]] == [len(tokenizer(w, add_special_tokens=False)["input_ids"])
                                                       for w in want]
    assert shown[3]["error"] == "empty_prompt" and shown[0]["too_long"] is None
    assert shown[1]["too_long"] == "run.too_long=truncate_left: the engine gets its last 112 tokens (BOS kept)"
    margined = "\n".join(f"| {line}" for line in want[0].split("\n"))  # each prompt line after the margin
    assert f"--- row 0: id u0, {shown[0]['prompt_tokens']} prompt tokens ---\n{margined}\n--- row 1: id u1" in printed
    assert "--- row 3: id u3, empty_prompt ---\n--- end of the 4 rows shown ---\nrows 4 (3 to generate)" in printed
    template = [*base, f"output_dir={tmp_path / 'plain'}", 'dataset.template="Topic {topic}: {q}"']
    assert main([*template, "--show=2"], compose_checked) == 0
    shown = json.loads((tmp_path / "plain" / "_plan.json").read_text())["shown"]
    assert [r["prompt"] for r in shown] == ["Topic {topic}: {q}".format(**r) for r in rows[:2]]
    assert main(["--show", "many", *template], compose_checked) == 2


def test_plan_show_escapes_row_data_and_no_prompt_line_can_forge_a_frame(tiny_model, tmp_path, capsys):
    """Ids and prompts holding terminal escapes (a window title, a clear screen), a bidi override and lines that
    look like --show's own frames reach the terminal escaped, each prompt line after `| `; _plan.json keeps them
    exactly."""
    from batchgen.commands.compose import compose_checked
    from batchgen.commands.plan import main
    from tests.commands.test_terminal import HOSTILE, assert_safe

    rows = [{"uid": f"u0{HOSTILE}", "prompt": f"Summarize: {HOSTILE}"}, {"uid": f"u1{HOSTILE}", "prompt": None},
            {"uid": "u2", "prompt": "plain"}]
    data = write_parquet(tmp_path / "in.parquet", rows)
    assert main(["--show", "3", "name=p", f"dataset.path={data}", "engine=dummy", f"engine.model={tiny_model}",
                 "dataset.id_column=uid", f"output_dir={tmp_path / 'out'}", "run.max_error_rate=1"],
                compose_checked) == 0
    printed = capsys.readouterr().out
    assert_safe(printed)
    frames = [line for line in printed.splitlines() if line.startswith("---")]
    assert [f.split(":")[0] for f in frames] == ["--- row 0", "--- row 1", "--- row 2",
                                                 "--- end of the 3 rows shown ---"]
    assert "| === row 2 ===" in printed and "\\x1b]0;pwned\\x07" in frames[0] and "\\u202e" in printed
    shown = json.loads((tmp_path / "out" / "_plan.json").read_text())["shown"]
    assert shown[0]["prompt"] == f"Summarize: {HOSTILE}" and shown[1]["id"] == f"u1{HOSTILE}"


def test_the_calibrated_eta_is_called_an_estimate_not_a_bound():
    """A probe on an idle machine says nothing of a busy one's pace (a job took 59 s after an ETA of 36 s): the ETA
    is printed as an estimate on the machine as it is, never as an upper bound."""
    from batchgen.commands.plan import render

    plan = {"rows": 40, "generable_rows": 40, "error_rows": {}, "prompt_tokens": 400, "prompt_tokens_after_fit": 400,
            "max_generated_tokens": 320, "prompt_length": {"min": 5, "median": 10, "p95": 14, "max": 15},
            "max_model_len": 2048, "too_long": {"rows": 0, "policy": "truncate_left", "what_happens": "none"},
            "parts": 1, "rows_per_part": 256, "shards": {"num_shards": 1, "parts_per_shard": [1]}, "histogram": [],
            "calibration": {"probe_rows": 16, "probe_s": 2.0, "probe_tok_s": 64.0, "load_s": 1.0, "eta_s": 36.0}}
    line = render(plan).splitlines()[-1]
    assert "ETA for the whole job at that rate: 36 s (0.01 h)" in line
    assert "an estimate on this machine as it is now, not a bound" in line and "upper bound" not in line
