"""Crash safety end to end: random SIGKILLs (the kill harness, on the real hf engine), SIGTERM / SIGINT stops and
write failures (on engine=dummy: the runner, journal and committer are what they test)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from batchgen.output import committer as committer_module
from batchgen.output.committer import OutputWriteError
from batchgen.output.journal import read_journal
from batchgen.run.runner import run_job
from tests.conftest import REPO, compose_job, corpus, job_overrides, read_output, run_cli, write_parquet

KILLS = int(os.environ.get("BATCHGEN_KILLS", "5"))  # BATCHGEN_KILLS=20 pytest tests/scenarios/test_crash.py -k random


def load_harness():
    spec = importlib.util.spec_from_file_location("kill_harness", REPO / "scripts" / "kill_harness.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kill_harness"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_random_kills_never_lose_duplicate_or_tear_a_row(tiny_model, tmp_path, capsys):
    harness = load_harness()
    report = harness.run_harness(KILLS, work=tmp_path, model=tiny_model, rows=30, seed=7)
    with capsys.disabled():
        print("\n" + report.render())
    assert report.kills >= KILLS and report.rows_checked >= 30


def journaled_samples(out) -> int:
    return sum(len(read_journal(p)[1]) for p in out.glob("_part-*.journal"))


def wait_for_journal(out, proc, at_least: int, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while not (list(out.glob("_part-*.journal")) and journaled_samples(out) >= at_least):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "no journal appeared"
        time.sleep(0.02)


def test_sigterm_and_sigint_stop_within_10s_with_finished_rows_journaled(tiny_model, tmp_path):
    """Each signal lands mid-part: the job exits within 10 s (143 / 130), the status says stopped and counts
    what the journal holds, and the resumed job reuses all of it and equals an uninterrupted run."""
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(16, seed=3)])
    out = tmp_path / "out"
    args = job_overrides(tiny_model, data, out, "engine=dummy", "+engine.extra_args.delay_s=0.005",
                         "run.rows_per_part=8", "sampling.max_new_tokens=48", "sampling.ignore_eos=true")
    journaled = 0
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        wait_for_journal(out, proc, journaled + 2)
        sent = time.monotonic()
        os.kill(proc.pid, sig)
        proc.wait(timeout=10)
        waited = time.monotonic() - sent
        assert proc.returncode == code, proc.stderr[-3000:]
        last = proc.stderr.read().strip().splitlines()[-1]  # the last line says the command that resumes the run
        assert waited < 10 and last.endswith(f"rerun the same command to resume: {shlex.join(['batchgen', *args])}")
        status = json.loads((out / "_status.json").read_text())
        journaled = journaled_samples(out)
        assert status["state"] == "stopped" and status["pid"] == proc.pid
        assert sum(p["samples_journaled"] for p in status["parts_in_flight"]) == journaled > 0
        assert not (out / "part-00001.parquet").exists()
        print(f"{signal.Signals(sig).name}: exit {proc.returncode} {waited:.2f}s after the signal, "
              f"{journaled} samples journaled")
    cfg = compose_job(args)
    summary = run_job(cfg)
    assert summary.state == "done" and summary.reused_samples == journaled
    run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "clean", *args[7:])))  # the same job elsewhere
    assert read_output(out).equals(read_output(tmp_path / "clean"))


def test_a_write_failure_stops_the_job_and_keeps_committed_parts(tiny_model, tmp_path, monkeypatch):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(12, seed=5)])
    out = tmp_path / "out"
    cfg = compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "run.rows_per_part=4",
                                    "sampling.max_new_tokens=3"))
    real_write = committer_module.pq.write_table
    calls = {"n": 0}

    def full_disk(table, where, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second part's write hits a full disk
            raise OSError(28, "No space left on device")
        return real_write(table, where, **kwargs)

    monkeypatch.setattr(committer_module.pq, "write_table", full_disk)
    with pytest.raises(OutputWriteError, match=r"part-00001.parquet: No space left on device.*rerun the same"):
        run_job(cfg)
    assert [p.name for p in out.glob("part-*")] == ["part-00000.parquet"]
    assert read_output(out).num_rows == 4 and not list(out.glob(".part-*"))
    assert json.loads((out / "_status.json").read_text())["state"] == "failed"
    monkeypatch.setattr(committer_module.pq, "write_table", real_write)
    assert run_job(cfg).state == "done" and read_output(out).num_rows == 12



def test_an_int8_job_killed_and_resumed_equals_an_uninterrupted_one(small_model, tmp_path):
    """engine.quantization=int8 (W8A8 where this CPU's int8 GEMM is exact, else weight-only): a job SIGKILLed mid-part
    and rerun writes every row once and the same text as an uninterrupted run (per-token scales: a row's output does
    not depend on which rows share its batch, and the resumed run's batches differ); the manifest records what int8
    resolved to and the rerun resumes under it.

    One thread (OMP_NUM_THREADS=1) in every run: with two, about one run in six on the 2-core development CPU wrote a
    token differently at a near-tie of this random-weight model (a one-ulp difference whose source is not found yet:
    the stepper's logits are identical across thread counts and batches in-process), which is not what this test is
    about; with one thread six runs of six were identical."""
    from batchgen.engines.hf.quant import w8a8

    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(12, seed=5)])
    common = ["engine.quantization=int8", "run.rows_per_part=4", "sampling.max_new_tokens=24",
              "sampling.ignore_eos=true", "engine.max_batch_size=3"]
    one_thread = {"OMP_NUM_THREADS": "1"}
    whole = tmp_path / "whole"
    assert run_cli(job_overrides(small_model, data, whole, *common), env=one_thread).returncode == 0
    out = tmp_path / "out"
    args = job_overrides(small_model, data, out, *common)
    proc = subprocess.Popen([sys.executable, "-m", "batchgen", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ | one_thread)
    wait_for_journal(out, proc, 2)
    proc.kill()
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    rerun = run_cli(args, env=one_thread)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    columns = ["id", "sample_index", "generation"]
    got, want = (read_output(d).sort_by("id").select(columns).to_pylist() for d in (out, whole))
    assert len(got) == 12 and got == want
    resolved = json.loads((out / "_manifest.json").read_text())["engine_resolved"]
    assert resolved["quantization"] == "int8"
    assert resolved["quantization_scheme"] == (None if w8a8.probe() else "w8a8")
