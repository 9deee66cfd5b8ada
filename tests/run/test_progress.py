"""run/progress.py: the bar and the status move per journaled sample, so a part's progress (and an ETA) shows long
before it commits."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, job_overrides, keyed_rows, write_parquet


@pytest.mark.parametrize("launcher", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_progress_moves_before_the_first_part_commits(tiny_model, tmp_path, launcher):
    """One 24-row part on the dummy engine at 25 ms a token (about 1 s of decoding: at 4 ms the part was done in
    0.16 s, too soon for the Ray driver's status to show it in flight on a fast CPU): while it is in flight,
    _status.json counts journaled
    samples and gives an ETA with no row committed; the bar (on stderr) shows row counts between 0 and 24 before
    the part commits; `batchgen status` shows the ETA and the samples journaled. Under launcher=ray the driver
    counts what its worker journals."""
    if launcher == "ray":
        pytest.importorskip("ray", reason="launcher=ray needs ray: pip install 'batchgen[ray]'")
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(24, "r", 5))
    out = tmp_path / "out"
    ray = ["launcher=ray", "launcher.num_workers=1"] if launcher == "ray" else []
    args = [*job_overrides(tiny_model, data, out, "engine=dummy", "+engine.extra_args.delay_s=0.025",
                           "+engine.extra_args.eos_rate=0.0", "sampling.max_new_tokens=40", "run.rows_per_part=24",
                           "dataset.id_column=uid", *ray), "run.progress=true"]
    job = subprocess.Popen([sys.executable, "-m", "batchgen", *args], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    seen, status_line = None, ""
    deadline = time.monotonic() + 240
    while job.poll() is None and time.monotonic() < deadline:
        try:
            status = json.loads((out / "_status.json").read_text())
        except (OSError, ValueError):
            status = None
        flight = (status or {}).get("parts_in_flight") or []
        if status and status["rows_done"] == 0 and flight and flight[0]["samples_journaled"] and status["eta_s"]:
            seen = status
            shown = subprocess.run([sys.executable, "-m", "batchgen", "status", str(out)], capture_output=True,
                                   text=True, cwd=REPO)
            status_line = shown.stdout
            break
        time.sleep(0.05)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err[-3000:]
    assert seen is not None, "no status with journaled samples and an ETA before the part committed"
    assert 0 < seen["parts_in_flight"][0]["samples_journaled"] < 24 and seen["eta_s"] > 0
    assert "ETA" in status_line and "samples journaled" in status_line, status_line
    counts = [int(n) for n in re.findall(r"\| *(\d+)/24 rows", err)]
    assert counts and counts[-1] == 24, err[-2000:]
    assert any(0 < n < 24 for n in counts), counts  # frames drawn while the only part was in flight
