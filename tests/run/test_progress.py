"""run/progress.py: the bar and the status move per journaled sample, so a part's progress (and an ETA) shows long
before it commits; a resumed run says what it resumes before the bar, which starts past it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from batchgen.output.journal import journal_path, read_journal
from tests.conftest import REPO, compose_job, dummy_overrides, job_overrides, keyed_rows, write_parquet


@pytest.mark.parametrize("launcher", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_progress_moves_before_the_first_part_commits(tiny_model, tmp_path, launcher):
    """One 24-row part on the dummy engine at 4 ms a generated token (960 tokens: about 4 s in flight; under Ray,
    whose driver looks at its worker's journal once a heartbeat, 15 ms: about 15 s): while it is in flight,
    _status.json counts journaled
    samples and gives an ETA with no row committed; the bar (on stderr) shows row counts between 0 and 24 before
    the part commits; `batchgen status` shows the ETA and the samples journaled. Under launcher=ray the driver
    counts what its worker journals."""
    if launcher == "ray":
        pytest.importorskip("ray", reason="launcher=ray needs ray: pip install 'batchgen[ray]'")
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(24, "r", 5))
    out = tmp_path / "out"
    ray = ["launcher=ray", "launcher.num_workers=1"] if launcher == "ray" else []
    delay = 0.015 if ray else 0.004
    args = [*job_overrides(tiny_model, data, out, "engine=dummy", f"+engine.extra_args.delay_s={delay}",
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


def test_a_resumed_run_says_so_first_and_its_bar_starts_past_the_earlier_work(tiny_model, tmp_path, monkeypatch,
                                                                             capsys):
    """A run stopped (as by SIGTERM) with part 0 committed and 2 samples of part 1 journaled, then the same job: one
    line before the bar says the parts committed, the samples journaled and the rows to go; the bar's first frame
    counts the committed rows and the journaled samples' rows (one row a sample here), not 0; the summary splits the
    rows committed before, the samples reused and those generated now."""
    from batchgen.run import feed
    from batchgen.run.runner import run_job
    from batchgen.run.stopping import StopRequested

    data = write_parquet(tmp_path / "in.parquet", keyed_rows(12, "r", 8))
    out = tmp_path / "out"
    args = dummy_overrides(tiny_model, data, out, "dataset.id_column=uid", "run.rows_per_part=3",
                           "sampling.max_new_tokens=8")
    journaled = []

    def stop_at_the_fifth(where: str) -> None:  # part 0's 3 samples committed, part 1's first 2 journaled
        journaled.append(where)
        if journaled.count("samples journaled") == 5:
            raise StopRequested(signal.SIGTERM)

    monkeypatch.setattr(feed, "kill_point", stop_at_the_fifth)
    with pytest.raises(StopRequested):
        run_job(compose_job(args))
    monkeypatch.undo()
    assert [p.name for p in out.glob("part-*.parquet")] == ["part-00000.parquet"]
    assert len(read_journal(journal_path(out, 1))[1]) == 2
    capsys.readouterr()
    summary = run_job(compose_job([*args, "run.progress=true"]))
    err = capsys.readouterr().err
    said = f"batchgen: resuming {out}: 1 parts committed, 2 samples journaled, 7 rows to go"
    assert said in err and err.index(said) < err.index("/12 rows"), err
    assert re.findall(r"\| *(\d+)/12 rows", err)[0] == "5", err  # 3 committed + 2 journaled, not 0
    assert ("resumed: 3 rows committed by earlier runs skipped, 2 samples reused from part journals, 7 samples "
            "generated now") in summary.render(), summary.render()



def _stop_in_part_1(tiny_model, tmp_path, monkeypatch) -> list[str]:
    """The scenario above: a run stopped with part 0 (3 rows) committed and 2 samples of part 1 journaled; returns
    the job's arguments for the run that resumes it."""
    from batchgen.run import feed
    from batchgen.run.runner import run_job
    from batchgen.run.stopping import StopRequested

    data = write_parquet(tmp_path / "in.parquet", keyed_rows(12, "r", 8))
    args = dummy_overrides(tiny_model, data, tmp_path / "out", "dataset.id_column=uid", "run.rows_per_part=3",
                           "sampling.max_new_tokens=8")
    journaled = []

    def stop_at_the_fifth(where: str) -> None:
        journaled.append(where)
        if journaled.count("samples journaled") == 5:
            raise StopRequested(signal.SIGTERM)

    with monkeypatch.context() as m:
        m.setattr(feed, "kill_point", stop_at_the_fifth)
        with pytest.raises(StopRequested):
            run_job(compose_job(args))
    return args


def test_a_resumed_runs_bar_never_moves_back(tiny_model, tmp_path, monkeypatch):
    """The bar starts with part 1's journaled samples as an estimate; when part 1 opens, its own count replaces the
    estimate. The bar went up by the count, then down by the estimate (3 committed + 2 journaled: 5 -> 7 -> 5; a
    20,000-row resume showed 5506 -> 5712 -> 5507): now every position it takes is at or past the one before, and it
    ends at 12."""
    from tqdm import tqdm

    from batchgen.run import progress
    from batchgen.run.runner import run_job

    args = _stop_in_part_1(tiny_model, tmp_path, monkeypatch)
    seen: list[float] = []

    class Recorded(tqdm):  # the real bar, its positions kept
        def update(self, n=1):
            shown = super().update(n)
            seen.append(self.n)
            return shown

    monkeypatch.setattr(progress, "tqdm", Recorded)
    run_job(compose_job([*args, "run.progress=true"]))
    assert seen and seen[-1] == pytest.approx(12), seen
    assert all(b >= a - 1e-9 for a, b in zip([5.0, *seen], seen)), seen


def test_a_resumed_output_has_one_token_total(tiny_model, tmp_path, monkeypatch):
    """Part 1's 2 journaled samples were generated by the stopped run and committed by the resumed one. The history
    (the report's "generated tokens") left their tokens out while the status file and the rows count them (a
    resumed 20,000-row output: 456,503 against 477,950): now the report's summary, the status and the rows give one
    total, and the throughput plot still spreads only what each run generated in its time in flight."""
    import pyarrow.parquet as pq

    from batchgen.commands.report import _summary_rows, gather, history
    from batchgen.run.runner import run_job

    args = _stop_in_part_1(tiny_model, tmp_path, monkeypatch)
    summary = run_job(compose_job(args))
    out = tmp_path / "out"
    rows = pq.read_table(out, columns=["num_generated_tokens"]).column(0).to_pylist()
    status = json.loads((out / "_status.json").read_text())
    said = dict((k, v) for k, v in _summary_rows(gather(out)))["generated tokens (history, retries included)"]
    assert said == status["generated_tokens"] == sum(rows) == summary.totals.generated_tokens
    part1 = next(h for h in history(out) if h["part"] == 1)
    assert 0 < part1["reused_tokens"] < part1["generated_tokens"]  # 2 of its 3 samples from the stopped run
    assert part1["made_tokens"] == part1["generated_tokens"] - part1["reused_tokens"]


def test_answers_the_engine_did_not_make_are_not_this_runs_work(tiny_model, tmp_path):
    """6 rows, 2 of them repeating another's prompt (run.dedupe answers them once): the output's token total counts
    every row's tokens, but this run's figure (the summary's "this run", the status file's this_run and its tok/s)
    counts the 4 samples the engine generated, not the 2 copies. A scoring task's summary and its rate say rows and
    prompt tokens scored, with no generated tokens and no generated tok/s."""
    from batchgen.run.runner import run_job

    prompts = ["alpha beta", "gamma", "alpha beta", "delta epsilon", "gamma", "zeta"]
    data = write_parquet(tmp_path / "in.parquet", [{"uid": f"r{i}", "prompt": p} for i, p in enumerate(prompts)])
    summary = run_job(compose_job(dummy_overrides(tiny_model, data, tmp_path / "gen", "dataset.id_column=uid",
                                                  "sampling.max_new_tokens=8", "+engine.extra_args.eos_rate=0.0")))
    assert summary.cache is not None and summary.cache.deduplicated == 2
    assert summary.totals.generated_tokens == 6 * 8 and summary.work.generated_tokens == 4 * 8
    assert "this run: 32 generated tokens" in summary.render(), summary.render()
    status = json.loads((tmp_path / "gen" / "_status.json").read_text())
    assert status["generated_tokens"] == 48 and status["this_run"]["generated_tokens"] == 32

    scored = run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "loglik", "dataset.id_column=uid",
                                               "task=loglik")))
    said = scored.render()
    assert scored.work.rows == 4 and "this run: 4 rows scored" in said, said
    assert "generated tok" not in said and ", generated 0" not in said and "prompt tok/s scored" in said, said
    assert "(task=loglik: scored, none generated)" in said
