"""batchgen nightly and batchgen increment (commands/nightly.py, commands/increment.py), run as a scheduler runs them:
the installed CLI in a project directory outside the checkout, with the user's preset in a --config-dir of theirs and
relative paths resolving there, on engine=dummy; and jobs/nightly.sh, jobs/increment.sh under cron's bare
environment. Three nights of a growing table (a..e, a..h, a..j): each night's dated output holds only its new ids,
a killed night resumes the same night, a finished night is a no-op; a fixed input's output is a no-op the second
night and is refused, naming `batchgen increment`, once its input changed."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from filelock import FileLock

from batchgen.commands.compose import compose_checked
from batchgen.commands.increment import hydra_value, other_nights, plan_night
from batchgen.errors import ConfigError
from tests.conftest import REPO, read_output, run_cli

JOBS = REPO / "jobs"
PRESET = """# @package _global_
defaults:
  - override /engine: dummy
  - override /dataset: parquet
name: tickets
dataset:
  path: tickets.parquet
  id_column: id
  template: "Label the ticket: {text}"
sampling:
  max_new_tokens: 4
run:
  rows_per_part: 2
"""
NIGHTS = "data/outputs/tickets"  # the preset's output_dir (data/outputs/${name}), relative to the project directory


@pytest.fixture
def project(tmp_path: Path, tiny_model: str) -> tuple[Path, list[str]]:
    """A project directory outside the checkout, its preset in presets/job/tickets.yaml; and the job's arguments."""
    home = tmp_path / "project"
    (home / "presets" / "job").mkdir(parents=True)
    (home / "presets" / "job" / "tickets.yaml").write_text(PRESET)
    return home, ["--config-dir", "presets", "job=tickets", f"engine.model={tiny_model}"]


def table(home: Path, last: str) -> None:
    """The growing input: tickets a..`last`."""
    ids = [chr(c) for c in range(ord("a"), ord(last) + 1)]
    pq.write_table(pa.table({"id": ids, "text": [f"ticket {i} about billing" for i in ids]}), home / "tickets.parquet")


def ids(out: Path) -> list[str]:
    return sorted(read_output(out).column("id").to_pylist())


def cron(home: Path, script: str, args: list[str], **env: str) -> subprocess.CompletedProcess:
    """jobs/SCRIPT as cron runs it: a bare environment, in the project directory; the interpreter the checkout's
    .venv where it has one (make test made it), else this one, named by BATCHGEN_PYTHON."""
    venv = (REPO / ".venv" / "bin" / "python").exists()
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(home), **({} if venv else {"BATCHGEN_PYTHON": sys.executable}), **env}
    return subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in bare.items()), "bash", str(JOBS / script), *args],
                          cwd=home, capture_output=True, text=True, timeout=180)


def kill_when_a_part_is_in(home: Path, args: list[str], out: Path) -> tuple[int, str]:
    """`batchgen ARGS` (slowed: each token sleeps), sent SIGTERM once its first part is committed."""
    cmd = [sys.executable, "-m", "batchgen", *args, "+engine.extra_args.delay_s=0.15"]
    proc = subprocess.Popen(cmd, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not (out / "part-00000.parquet").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_increment_generates_each_nights_new_ids_in_a_dated_output(project):
    home, job = project
    root = home / NIGHTS
    table(home, "e")  # night 1, killed after its first part; rerun the same night, it resumes
    night1 = ["increment", "--date", "2026-12-05", *job]
    code, err = kill_when_a_part_is_in(home, night1, root / "2026-12-05")
    assert code == 143 and "rerun the same command to resume" in err, err[-2000:]
    resumed = run_cli(night1, cwd=home)
    assert resumed.returncode == 0 and "started earlier tonight, resumed" in resumed.stdout, resumed.stderr[-2000:]
    assert ids(root / "2026-12-05") == list("abcde")
    parts = {p.name: p.stat().st_mtime_ns for p in (root / "2026-12-05").glob("part-*.parquet")}
    again = run_cli(night1, cwd=home)  # the same night once more: complete, nothing runs
    assert again.returncode == 0 and "is complete (_SUCCESS); nothing to do" in again.stdout, again.stderr[-2000:]
    assert {p.name: p.stat().st_mtime_ns for p in (root / "2026-12-05").glob("part-*.parquet")} == parts

    table(home, "h")  # night 2, as cron runs the example script
    night2 = cron(home, "increment.sh", ["--date", "2026-12-06", *job])
    assert night2.returncode == 0, night2.stderr[-2000:] + night2.stdout[-2000:]
    assert ids(root / "2026-12-06") == list("fgh")
    table(home, "j")  # night 3: the chain goes back through night 2 to night 1
    night3 = run_cli(["increment", "--date", "2026-12-07", *job], cwd=home)
    assert night3.returncode == 0, night3.stderr[-2000:]
    assert f"only ids not generated by the 2 finished night(s) under {NIGHTS}" in night3.stdout
    assert ids(root / "2026-12-07") == list("ij") and "skipped: 8 rows" in night3.stdout
    assert sorted(p.name for p in root.iterdir()) == ["2026-12-05", "2026-12-06", "2026-12-07", "_lock.increment"]
    assert not (REPO / NIGHTS / "2026-12-05").exists()  # relative paths resolved in the project, not the checkout


def test_nightly_is_a_noop_on_a_fixed_input_and_refuses_a_changed_one(project):
    home, job = project
    table(home, "e")
    first = run_cli(["nightly", *job, "output_dir=fixed"], cwd=home)
    assert first.returncode == 0 and "batchgen: done: fixed" in first.stdout, first.stderr[-2000:]
    second = cron(home, "nightly.sh", [*job, "output_dir=fixed"])  # the next night, as cron runs the example
    assert second.returncode == 0 and "batchgen: already done: fixed" in second.stdout, second.stderr[-2000:]
    assert ids(home / "fixed") == list("abcde")
    table(home, "h")  # the input changed under the same output
    refused = run_cli(["nightly", *job, "output_dir=fixed"], cwd=home)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "wants `batchgen increment`" in refused.stderr and "Traceback" not in refused.stderr
    assert "batchgen increment --config-dir presets job=tickets" in refused.stderr  # the line to run instead
    printed = re.search(r"the new ids generated: batchgen (increment .*?) \(docs/", refused.stderr, re.S)
    assert printed, refused.stderr[-2000:]
    instead = run_cli(shlex.split(printed.group(1)), cwd=home)  # run as printed: it was refused (exit 2) before
    assert instead.returncode == 0, instead.stderr[-2000:]
    assert ids(next((home / "fixed-nights").glob("20*"))) == list("abcdefgh")  # its first night: every row
    broken = cron(home, "nightly.sh", [*job], BATCHGEN_PYTHON="/bin/false")
    assert broken.returncode == 2 and "set BATCHGEN_PYTHON to the interpreter" in broken.stderr


def test_a_nights_ledger_is_every_finished_night_whatever_its_date_and_passes_over_an_unfinished_one(tmp_path):
    root = tmp_path / "nights"
    for night, done in (("2026-12-01", True), ("2026-12-02", True), ("2026-12-03", False), ("2026-12-05", True)):
        (root / night).mkdir(parents=True)
        if done:
            (root / night / "_SUCCESS").write_text("")
    (root / "notes").mkdir()
    ledger, abandoned = other_nights(root, "2026-12-04")
    assert ledger == [root / "2026-12-01", root / "2026-12-02", root / "2026-12-05"]  # a later night counts too
    assert abandoned == [root / "2026-12-03"]
    assert other_nights(root, "2026-12-01") == ([root / "2026-12-02", root / "2026-12-05"], [root / "2026-12-03"])
    assert other_nights(tmp_path / "none-yet", "2026-12-01") == ([], [])


def test_increment_refuses_a_bad_date_and_the_keys_it_sets(project, monkeypatch):
    home, job = project
    monkeypatch.chdir(home)  # the preset's relative paths, as the command resolves them
    monkeypatch.setenv("BATCHGEN_CONF_DIR", str(home / "presets"))
    table(home, "e")
    overrides = job[2:]
    with pytest.raises(ConfigError, match=r"--date 2026-13-01: not a date as YYYY-MM-DD"):
        plan_night(overrides, "2026-13-01", compose_checked)
    with pytest.raises(ConfigError, match=r"run.skip_existing: set by batchgen increment"):
        plan_night([*overrides, "run.skip_existing=data/outputs/old"], "2026-12-05", compose_checked)
    (home / "fixed").mkdir()
    (home / "fixed" / "_manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"output_dir=fixed holds a job's output itself"):
        plan_night([*overrides, "output_dir=fixed"], "2026-12-05", compose_checked)
    night = plan_night([*overrides, f"output_dir={hydra_value(str(home / 'it s'))}"], "2026-12-05", compose_checked)
    assert night.previous == str(home / "it s")  # the ledger: every finished night under the root (none yet)
    assert f"output_dir='{home / 'it s' / '2026-12-05'}'" in night.overrides
    assert hydra_value("data/outputs/tickets/2026-12-05") == "data/outputs/tickets/2026-12-05"


def test_increment_refuses_ids_that_are_positions_and_a_night_being_written(project):
    home, job = project
    root = home / NIGHTS
    table(home, "e")
    positions = run_cli(["increment", "--date", "2026-12-05", *job, "dataset.id_column=null"], cwd=home)
    assert positions.returncode == 2 and "Traceback" not in positions.stderr, positions.stderr[-2000:]
    assert "batchgen increment: dataset.id_column is not set" in positions.stderr
    assert "run.skip_by_position=true" in positions.stderr
    (root / "2026-12-04").mkdir(parents=True)
    with FileLock(str(root / "2026-12-04" / "_lock")):  # another night's writer lives (a late rerun of it)
        busy = run_cli(["increment", "--date", "2026-12-05", *job], cwd=home)
    assert busy.returncode == 2, busy.stderr[-2000:]
    assert f"{NIGHTS}/2026-12-04 is being written now" in busy.stderr and "add --wait to wait for it" in busy.stderr
    with FileLock(str(root / "_lock.increment")):  # another increment of the same root
        other = run_cli(["increment", "--date", "2026-12-05", *job], cwd=home)
    assert other.returncode == 2 and "another batchgen increment runs a night of it" in other.stderr
    assert not (root / "2026-12-05").exists()


@pytest.mark.slow
def test_increment_waits_for_a_night_being_written_with_wait(project):
    home, job = project
    root = home / NIGHTS
    table(home, "e")
    (root / "2026-12-04").mkdir(parents=True)
    lock = FileLock(str(root / "2026-12-04" / "_lock"))
    lock.acquire()
    cmd = [sys.executable, "-m", "batchgen", "increment", "--wait", "--date", "2026-12-05", *job]
    proc = subprocess.Popen(cmd, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "batchgen increment: waiting for" in line and "2026-12-04" in line, line
        assert proc.poll() is None and not (root / "2026-12-05").exists()
    finally:
        lock.release()
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-2000:]
    assert ids(root / "2026-12-05") == list("abcde")
