"""output_dir on object storage: a real S3 API served locally (moto's server mode, started here) reached through
s3fs. A job writes there exactly once; killed and resumed it still does, and `_SUCCESS` is written once, at the end;
a resume under another config is refused from the manifest in the bucket. On engine=dummy: the storage is what is
tested."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pyarrow.dataset as ds
import pytest

from batchgen.errors import ResumeMismatchError
from batchgen.run.runner import run_job
from tests.conftest import REPO, compose_job, dummy_overrides, keyed_rows, read_output, write_parquet

pytest.importorskip("moto.server", reason="the S3 tests need moto[server]")
s3fs = pytest.importorskip("s3fs", reason="the S3 tests need s3fs")
ROWS, PART = 40, 5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("s3in") / "in.parquet", keyed_rows(ROWS, "s", 23))


def args(model, data, out, *extra):
    return dummy_overrides(model, data, out, "dataset.id_column=uid", f"run.rows_per_part={PART}",
                           "sampling=sample", "sampling.max_new_tokens=10", *extra)


def read_s3(fs, prefix):
    fs.invalidate_cache()  # the listing as it is now, not as this process last saw it
    return ds.dataset(f"bucket/{prefix}", format="parquet", filesystem=fs).to_table()


def names(fs, prefix):
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"bucket/{prefix}", detail=False, refresh=True))


def test_a_job_writes_its_parts_to_s3_once_and_nothing_else(s3, tiny_model, data, tmp_path):
    fs, _ = s3
    run_job(compose_job(args(tiny_model, data, tmp_path / "local")))
    summary = run_job(compose_job(args(tiny_model, data, "s3://bucket/once")))
    assert summary.state == "done" and str(summary.output_dir) == "s3://bucket/once"
    assert names(fs, "once") == ["_SUCCESS", "_manifest.json", "_status.json"] + [
        f"part-{k:05d}.parquet" for k in range(ROWS // PART)]  # no temp object, no journal, no lock
    assert read_s3(fs, "once").equals(read_output(tmp_path / "local"))
    again = run_job(compose_job(args(tiny_model, data, "s3://bucket/once")))
    assert again.state == "already_done"
    with pytest.raises(ResumeMismatchError, match="sampling.max_new_tokens"):
        run_job(compose_job(args(tiny_model, data, "s3://bucket/once", "sampling.max_new_tokens=11")))


def test_killed_and_resumed_on_s3_every_id_exactly_once(s3, tiny_model, data, tmp_path):
    fs, env = s3
    run_job(compose_job(args(tiny_model, data, tmp_path / "local")))
    cmd = [sys.executable, "-m", "batchgen", *args(tiny_model, data, "s3://bucket/killed")]
    slow = os.environ | env | {"BATCHGEN_TEST_CRASH_WINDOW_S": "0.02"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=slow, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not any(n.startswith("part-") for n in (names(fs, "killed") if fs.exists("bucket/killed") else [])):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "no part reached the bucket"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = names(fs, "killed")
    assert "_SUCCESS" not in before and len([n for n in before if n.startswith("part-")]) < ROWS // PART
    resumed = subprocess.run(cmd, cwd=REPO, env=os.environ | env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = read_s3(fs, "killed")
    pairs = Counter(zip(got.column("id").to_pylist(), got.column("sample_index").to_pylist()))
    assert set(pairs.values()) == {1} and len(pairs) == ROWS
    assert got.equals(read_output(tmp_path / "local"))
    assert "_SUCCESS" in names(fs, "killed")
    assert not (REPO / "s3:").exists()  # Hydra's logs went to the staging directory, not to a local "s3:" folder
    fs.rm("bucket/killed/_SUCCESS")
    done = subprocess.run([sys.executable, "-m", "batchgen", "finalize", "s3://bucket/killed"], cwd=REPO,
                          env=os.environ | env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "all 8 parts committed" in done.stdout, done.stderr
    fs.invalidate_cache()
    assert "_SUCCESS" in names(fs, "killed")
