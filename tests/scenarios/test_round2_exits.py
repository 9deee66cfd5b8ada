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

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, job_overrides, keyed_rows, run_cli, write_parquet

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


def described(pid: int) -> str:
    """A leftover process as a failure message names it: pid, command line, parent, and whether it carried the
    job's reaper mark (stopping.MARK_ENV)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        marked = b"BATCHGEN_REAPER_MARK=" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} ppid={ppid} reaper-marked={marked}: {cmd}"


def kill_leftovers(marker: str) -> list[str]:
    """SIGKILL what a failed check left behind (only processes carrying this test's marker), so that one failure
    does not hold 180 MB per process for the rest of the session; the processes it found, described."""
    left = processes_with(marker)
    found = [described(pid) for pid in left]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return found


def ray_worker_up(marker: str) -> bool:
    """A Ray actor of the job is running (the cluster's daemons and agents are up by then)."""
    for pid in processes_with(marker):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::PartWorker"):
                return True
        except OSError:
            continue
    return False


def signal_when(ready, args: list[str], sig: signal.Signals) -> tuple[int, str, list[str]]:
    """Run the job, send `sig` once `ready(marker)`; its exit code, its stderr, and the pids of what it started
    that still live 45 s after it exited (killed here, so that a failure leaks nothing into the session)."""
    marker = uuid.uuid4().hex
    job = start_job(args, marker)
    try:
        up = wait_until(lambda: ready(marker) or job.poll() is not None, 180)
        assert up and job.poll() is None, job.communicate()[1][-3000:] if job.poll() is not None else ""
        job.send_signal(sig)
        _, err = job.communicate(timeout=60)
        wait_until(lambda: not processes_with(marker), 45)
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


class NotAWeight:
    """Pickled into a checkpoint: a global torch.load(weights_only=True) refuses."""


def model_copy(tiny_model: str, where: Path, **config: object) -> Path:
    """The tiny model's config, tokenizer and weights under `where`, with `config` set in its config.json."""
    import shutil

    shutil.copytree(tiny_model, where)
    path = where / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    return where


def assert_named_exit_2(proc: subprocess.CompletedProcess, *named: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[-3000:]
    for text in named:
        assert text in proc.stderr, (text, proc.stderr[-3000:])


def test_case12a_pickled_weights_refused_by_weights_only_exit_2(tiny_model, tmp_path):
    """A pytorch_model.bin holding a pickled object that torch.load(weights_only=True) refuses: a ModelLoadError
    (exit 2) naming the file and what to do, not an UnpicklingError's traceback (exit 1)."""
    import torch
    from safetensors.torch import load_file

    model = model_copy(tiny_model, tmp_path / "pickled")
    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    torch.save({**weights, "extra": NotAWeight()}, model / "pytorch_model.bin")
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(4, "p", 1))
    proc = run_cli(job_overrides(str(model), data, tmp_path / "out", "dataset.id_column=uid"), timeout=300)
    assert_named_exit_2(proc, "pytorch_model.bin", "weights_only", "safetensors", "NotAWeight")


def test_case12b_plan_on_a_model_needing_remote_code_exits_2(tiny_model, tmp_path):
    """`batchgen plan` on a checkpoint whose config needs its own code (auto_map) or names a model type this
    transformers does not know: exit 2 naming engine.model and what to do, before anything is written."""
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(4, "p", 1))
    remote = model_copy(tiny_model, tmp_path / "remote", model_type="mystery_lm", auto_map={
        "AutoConfig": "configuration_mystery.MysteryConfig", "AutoModelForCausalLM": "modeling_mystery.Mystery"})
    unknown = model_copy(tiny_model, tmp_path / "unknown", model_type="mystery_lm")
    for model, hint in ((remote, "engine.trust_remote_code=true"), (unknown, "mystery_lm")):
        out = tmp_path / f"out-{model.name}"
        proc = run_cli(["plan", *job_overrides(str(model), data, out, "dataset.id_column=uid")], timeout=300)
        assert_named_exit_2(proc, "engine.model", str(model), hint)
        assert not out.exists()


@pytest.fixture(scope="module")
def s3(s3):
    """conftest's local S3 endpoint, with the bucket round2 (moto's store is per process: other buckets may be
    there too)."""
    fs, env = s3
    fs.makedirs("round2", exist_ok=True)
    return fs, env


TORN = '{"config": {"name": "t", "output_di'  # a manifest cut short by a crash (or a hand edit)


def test_case12c_torn_manifest_exits_2_naming_it(s3, tmp_path):
    """status, report and finalize on an output whose _manifest.json is torn: exit 2 naming the file (status said
    nothing and exited 0; report and finalize raised JSONDecodeError, exit 1); finalize reads a bucket's too."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "_manifest.json").write_text(TORN)
    for command in ("status", "report", "finalize"):
        proc = run_cli([command, str(out)], timeout=120)
        assert_named_exit_2(proc, f"{out / '_manifest.json'}: the manifest is not valid JSON", "new output_dir")
    fs, env = s3
    fs.pipe("round2/torn/_manifest.json", TORN.encode())
    proc = run_cli(["finalize", "s3://round2/torn"], timeout=120, env=env)
    assert_named_exit_2(proc, "s3://round2/torn/_manifest.json: the manifest is not valid JSON")


def test_case12c_the_job_on_a_torn_manifest_exits_2(tiny_model, tmp_path):
    """The job itself on that output: refused with exit 2 naming the file, before the model loads."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "_manifest.json").write_text(TORN)
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(4, "p", 1))
    proc = run_cli(job_overrides(tiny_model, data, out, "dataset.id_column=uid"), timeout=300)
    assert_named_exit_2(proc, str(out / "_manifest.json"))


def test_case12d_retry_switching_a_config_group_exits_2(tiny_model, tmp_path):
    """`batchgen retry OUT sampling=sample` (or engine=..., launcher=..., job=...): a config group cannot be switched
    on a retry (the job's resolved config is its start); exit 2 naming the override and the keys to set instead,
    before anything is written, not OmegaConf's "Merge error ... str is not a subclass of SamplingConfig"."""
    rows = keyed_rows(6, "e", 1)
    rows[2]["prompt"] = ""  # an empty_prompt row to retry
    data = write_parquet(tmp_path / "in.parquet", rows)
    out = tmp_path / "out"
    done = run_cli(job_overrides(tiny_model, data, out, "dataset.id_column=uid", "sampling.max_new_tokens=4"))
    assert done.returncode == 0, done.stderr[-3000:]
    for override, named in (("sampling=sample", "sampling"),
                            ("engine=hf", "engine=hf: a retry cannot switch the config group engine"),
                            ("launcher=ray", "launcher=ray: a retry cannot switch the config group launcher"),
                            ("job=demo", "job=demo: a retry cannot switch the config group job")):
        proc = run_cli(["retry", str(out), "--kinds", "empty_prompt", override], timeout=120)
        assert_named_exit_2(proc, named)
        assert "Merge error" not in proc.stderr and "not in 'JobConfig'" not in proc.stderr, proc.stderr
        assert not (out / "_attempts").exists()
    proc = run_cli(["retry", str(out), "--kinds", "empty_prompt", "engine=hf"], timeout=120)
    assert "set the keys it would change instead: engine.dtype=auto" in proc.stderr  # the job ran in float32


def test_case13c_status_and_report_read_an_s3_output(s3, tiny_model, tmp_path):
    """`batchgen status` and `batchgen report` on an s3:// output read it through fsspec (they said "s3:/round2/x:
    no _manifest.json", the URL mangled by a local Path); a prefix without a run is named with its URL intact."""
    fs, env = s3
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(8, "s", 3))
    done = run_cli(job_overrides(tiny_model, data, "s3://round2/done", "dataset.id_column=uid", "run.rows_per_part=4",
                                 "sampling.max_new_tokens=4"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    status = run_cli(["status", "s3://round2/done"], timeout=120, env=env)
    assert status.returncode == 0, status.stderr[-3000:]
    assert status.stdout.startswith("s3://round2/done: complete\n"), status.stdout
    assert "_status.json: done: rows 8/8" in status.stdout and "committed parts: 2" in status.stdout, status.stdout
    page = tmp_path / "report.html"
    report = run_cli(["report", "s3://round2/done", "--out", str(page)], timeout=120, env=env)
    assert report.returncode == 0 and page.exists(), report.stderr[-3000:]
    text = page.read_text()
    assert "batchgen report: s3://round2/done" in text and "<td>rows</td><td>8</td>" in text
    assert_named_exit_2(run_cli(["report", "s3://round2/done"], timeout=120, env=env), "--out")
    for command in (["status", "s3://round2/none"], ["report", "s3://round2/none", "--out", str(page)]):
        proc = run_cli(command, timeout=120, env=env)
        assert_named_exit_2(proc, "s3://round2/none: no batchgen")
        assert "s3:/round2" not in proc.stdout + proc.stderr
    with fs.open("round2/done/part-00009.parquet", "wb") as f:  # a foreign file under a part's name
        pq.write_table(pa.table({"x": [1, 2]}), f)
    proc = run_cli(["report", "s3://round2/done", "--out", str(page)], timeout=120, env=env)
    assert_named_exit_2(proc, "s3://round2/done/part-00009.parquet: not a batchgen part: no column id")


def test_case13d_refused_skip_existing_creates_nothing(tiny_model, tmp_path):
    """A job refused at start (run.skip_existing naming a directory that holds no output) in a new output_dir leaves
    no output_dir: Hydra's run folder (`_logs/<time>`) was made before the refusal and stayed, with output_dir. (In
    an output_dir that was there before, a refused run leaves nothing either: tests/commands/test_cli.py.)"""
    data = write_parquet(tmp_path / "in.parquet", keyed_rows(4, "p", 1))
    (tmp_path / "not-an-output").mkdir()
    out = tmp_path / "out"
    skip = f"run.skip_existing={tmp_path / 'not-an-output'}"
    refused = job_overrides(tiny_model, data, out, "dataset.id_column=uid", skip)
    proc = run_cli(refused, timeout=300)
    assert_named_exit_2(proc, "run.skip_existing")
    assert not out.exists(), sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
