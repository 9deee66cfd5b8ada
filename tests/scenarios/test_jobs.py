"""jobs/: the Python job with its own rendering, the nightly wrapper and the status poller, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import read_output, write_jsonl, write_parquet

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


def test_nightly_wrapper_and_the_status_poller(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "instruction": "Say", "input": f"the river {i}",
                                                "max_new_tokens": 2} for i in range(5)])
    out = tmp_path / "out"
    env = os.environ | {"BATCHGEN_PYTHON": sys.executable, "BATCHGEN_LOG_DIR": str(tmp_path / "logs")}
    cmd = ["bash", str(JOBS / "nightly.sh"), "demo", f"engine.model={tiny_model}", f"dataset.path={data}",
           f"output_dir={out}", "engine.dtype=float32"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr[-2000:] + first.stdout[-2000:]
    assert "nightly demo: done" in first.stdout and "complete" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)  # tomorrow: a no-op
    assert second.returncode == 0 and "nightly demo: already done" in second.stdout
    broken = subprocess.run(cmd[:3] + ["dataset.path=/nonexistent.jsonl", f"output_dir={tmp_path / 'o2'}"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert broken.returncode == 2 and "config or input error" in broken.stderr

    poll = [sys.executable, str(JOBS / "wait_for_job.py"), str(out), "--timeout", "5", "--every", "1"]
    assert subprocess.run(poll, capture_output=True, text=True, timeout=60).returncode == 0
    (out / "_SUCCESS").unlink()
    status = out / "_status.json"
    status.write_text(json.dumps(json.loads(status.read_text()) | {"state": "running"}))  # a killed run's last word
    dead = subprocess.run(poll, capture_output=True, text=True, timeout=60)
    assert dead.returncode == 1 and "without a live writer" in dead.stdout


def test_increment_wrapper_generates_only_each_nights_new_rows(tiny_model, tmp_path):
    root = tmp_path / "nights"
    env = os.environ | {"BATCHGEN_PYTHON": sys.executable, "BATCHGEN_LOG_DIR": str(tmp_path / "logs")}
    for day, n in (("2026-11-30", 6), ("2026-12-01", 9)):
        data = write_jsonl(tmp_path / f"{day}.jsonl", [{"id": f"r{i}", "instruction": "Say", "input": f"river {i}",
                                                        "max_new_tokens": 2} for i in range(n)])
        proc = subprocess.run(["bash", str(JOBS / "increment.sh"), "demo", str(data), str(root),
                               f"engine.model={tiny_model}", "engine.dtype=float32"], capture_output=True, text=True,
                              timeout=300, env=env | {"BATCHGEN_TODAY": day})
        assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    import pyarrow.dataset as ds

    ids = [ds.dataset(str(root / d), format="parquet").to_table().column("id").to_pylist()
           for d in ("2026-11-30", "2026-12-01")]
    assert sorted(ids[0]) == [f"r{i}" for i in range(6)] and sorted(ids[1]) == ["r6", "r7", "r8"]


def test_nightly_wrapper_under_cron_finds_the_checkouts_python(tiny_model, tmp_path):
    """Under cron (`env -i`, PATH=/usr/bin:/bin, no venv active) the wrapper runs the job with the checkout's own
    .venv; with no interpreter that has batchgen it says so and exits 2 (a failure every night is not 'the next
    run resumes')."""
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "instruction": "Say", "input": f"river {i}",
                                                "max_new_tokens": 2} for i in range(3)])
    cron = ["env", "-i", "PATH=/usr/bin:/bin", f"HOME={tmp_path}", f"BATCHGEN_LOG_DIR={tmp_path / 'logs'}"]
    job = ["bash", str(JOBS / "nightly.sh"), "demo", f"engine.model={tiny_model}", f"dataset.path={data}",
           f"output_dir={tmp_path / 'out'}", "engine.dtype=float32"]
    venv = JOBS.parent / ".venv" / "bin" / "python"
    proc = subprocess.run(cron + job, capture_output=True, text=True, timeout=300)
    if venv.exists():  # the Makefile's venv (make test made it): the job runs
        assert proc.returncode == 0 and "nightly demo: done" in proc.stdout, proc.stderr[-2000:]
    else:
        assert proc.returncode == 2 and "no Python with batchgen installed" in proc.stderr, proc.stderr[-2000:]
    broken = subprocess.run([*cron, "BATCHGEN_PYTHON=/bin/false", *job], capture_output=True, text=True, timeout=60)
    assert broken.returncode == 2 and "set BATCHGEN_PYTHON to the interpreter" in broken.stderr
    assert "the next run resumes" not in broken.stderr
