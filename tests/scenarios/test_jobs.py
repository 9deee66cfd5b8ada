"""jobs/: the Python job with its own rendering and the status poller, run as a user would (the scheduled jobs'
scripts, nightly.sh and increment.sh: tests/commands/test_scheduled.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import read_output, run_cli, write_jsonl, write_parquet

JOBS = Path(__file__).resolve().parents[2] / "jobs"


def test_python_job_renders_rows_with_its_own_function(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "reviews.parquet", [
        {"review_id": "r1", "title": "Great kettle", "body": "boils fast"},
        {"review_id": "r2", "title": None, "body": "broke after a week"},
        {"review_id": "r3", "title": "  ", "body": None},  # nothing to render: its row errs, the job goes on
    ])
    out = tmp_path / "out"
    args = [sys.executable, str(JOBS / "label_reviews.py"), "--data", str(data), "--model", tiny_model, "--out",
            str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["id"]: r for r in read_output(out).to_pylist()}
    assert rows["r1"]["error"] is None and rows["r2"]["error"] is None and rows["r2"]["num_prompt_tokens"] > 0
    assert rows["r3"]["error"] == "bad_render: ValueError: the review has neither a title nor a body"
    assert rows["r1"]["title"] == "Great kettle"  # every input column passes through
    again = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already done" in again.stdout
    bad = subprocess.run(args[:4] + ["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "engine.model" in bad.stderr


def test_the_status_poller(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "instruction": "Say", "input": f"the river {i}",
                                                "max_new_tokens": 2} for i in range(5)])
    out = tmp_path / "out"
    done = run_cli(["job=demo", f"engine.model={tiny_model}", f"dataset.path={data}", f"output_dir={out}",
                    "engine.dtype=float32", "run.progress=false"])
    assert done.returncode == 0, done.stderr[-2000:]

    poll = [sys.executable, str(JOBS / "wait_for_job.py"), str(out), "--timeout", "5", "--every", "1"]
    assert subprocess.run(poll, capture_output=True, text=True, timeout=60).returncode == 0
    (out / "_SUCCESS").unlink()
    status = out / "_status.json"
    status.write_text(json.dumps(json.loads(status.read_text()) | {"state": "running"}))  # a killed run's last word
    dead = subprocess.run(poll, capture_output=True, text=True, timeout=60)
    assert dead.returncode == 1 and "without a live writer" in dead.stdout
