"""Issue 28, "Nothing silently wrong, round 2": exit codes the contract promises (docs/contract.md section 7) where a
traceback, a wrong code, a mangled URL, a leftover process or a leftover directory came before. One test per case."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, job_overrides, keyed_rows, write_parquet

OWNER_ENV = "BATCHGEN_TEST_ROUND2_OWNER"  # set on the job under test only: every process it starts inherits it


def processes_with(marker: str) -> list[int]:
    """The pids whose environment carries OWNER_ENV=marker: the job and everything it started, whatever their
    process group, name or parent (Ray's agents rename themselves and are re-parented to init)."""
    needle = f"{OWNER_ENV}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry))
    return pids


def wait_until(predicate, timeout: float, step: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def start_job(args: list[str], marker: str) -> subprocess.Popen:
    env = os.environ | {"PYTHONUNBUFFERED": "1", OWNER_ENV: marker}
    return subprocess.Popen([sys.executable, "-m", "batchgen", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def kill_leftovers(marker: str) -> list[int]:
    """SIGKILL what a failed check left behind (only processes carrying this test's marker), so that one failure
    does not hold 180 MB per process for the rest of the session; the pids it found."""
    left = processes_with(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


def ray_worker_up(marker: str) -> bool:
    """A Ray actor of the job is running (the cluster's daemons and agents are up by then)."""
    for pid in processes_with(marker):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::PartWorker"):
                return True
        except OSError:
            continue
    return False


def signal_when(ready, args: list[str], sig: signal.Signals) -> tuple[int, str, list[int]]:
    """Run the job, send `sig` once `ready(marker)`; its exit code, its stderr, and the pids of what it started
    that still live 30 s after it exited (killed here, so that a failure leaks nothing into the session)."""
    marker = uuid.uuid4().hex
    job = start_job(args, marker)
    try:
        up = wait_until(lambda: ready(marker) or job.poll() is not None, 180)
        assert up and job.poll() is None, job.communicate()[1][-3000:] if job.poll() is not None else ""
        job.send_signal(sig)
        _, err = job.communicate(timeout=60)
        wait_until(lambda: not processes_with(marker), 30)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        left = kill_leftovers(marker)
    return job.returncode, err, left


@pytest.mark.ray
def test_case11_ray_driver_sigterm_exits_143(tiny_model, tmp_path):
    """SIGTERM to a launcher=ray driver with a part in flight: journaled, "stopped", exit 143 (it aborted with 134
    after Ray's own SIGTERM handler ran), and nothing it started lives on; a SIGKILLed driver leaves nothing behind
    either (Ray's DashboardAgent and RuntimeEnvAgent stayed, re-parented to init)."""
    pytest.importorskip("ray", reason="launcher=ray needs ray: pip install 'batchgen[ray]'")
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(24, "r", 13))
    out = tmp_path / "out"
    args = job_overrides(tiny_model, data, out, "dataset.id_column=uid", "run.rows_per_part=4", "engine.threads=1",
                         "sampling.max_new_tokens=400", "launcher=ray", "launcher.num_workers=1")
    code, err, left = signal_when(lambda _: list(out.glob("_part-*.journal")), args, signal.SIGTERM)
    assert code == 143, (code, err[-3000:])
    assert "stopped by SIGTERM" in err and "SIGTERM received at time" not in err, err[-3000:]
    assert json.loads((out / "_status.json").read_text())["state"] == "stopped"
    assert not left, f"SIGTERM: processes left behind: {left}"
    code, err, left = signal_when(ray_worker_up, args, signal.SIGKILL)  # the resume, killed outright
    assert code == -signal.SIGKILL and not left, f"SIGKILL: processes left behind: {left}"
