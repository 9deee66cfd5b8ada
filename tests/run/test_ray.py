"""launcher=ray on a local Ray cluster (2 CPUs, 2 workers, engine=dummy): the output equals a single-process run's, a
worker whose engine raises has its part retried on the other worker, and a worker killed mid-job (ray.kill) loses
nothing and duplicates nothing. The hf engine on a Ray worker: tests/scenarios/test_round2_exits.py (case 11)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pyarrow as pa
import pytest

from batchgen.run.runner import run_job
from tests.conftest import compose_job, dummy_overrides, keyed_rows, read_output, write_parquet

ray = pytest.importorskip("ray", reason="launcher=ray needs ray: pip install 'batchgen[ray]'")
pytestmark = pytest.mark.ray
ROWS, PART = 24, 4  # 6 parts


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module. Its workers carry two test hooks: part 2's engine raises on its first
    attempt, and journal writes are slowed (crash-window hook) so that a kill lands mid-part."""
    from batchgen.output.journal import CRASH_WINDOW_ENV
    from batchgen.run.ray_job import FAIL_PART_ENV

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {FAIL_PART_ENV: "2", CRASH_WINDOW_ENV: "0.01"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("ray") / "in.parquet", keyed_rows(ROWS, "r", 13))


def overrides(model, data, out, *extra):
    return dummy_overrides(model, data, out, "dataset.id_column=uid", f"run.rows_per_part={PART}", "sampling.n=2",
                           "sampling=sample", "sampling.max_new_tokens=12", *extra)


@pytest.fixture(scope="module")
def single(tiny_model, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "out"
    run_job(compose_job(overrides(tiny_model, data, out)))
    return read_output(out)


def test_two_workers_equal_one_process_and_a_failing_engine_is_retried_elsewhere(cluster, tiny_model, data,
                                                                                  single, tmp_path):
    out = tmp_path / "out"
    summary = run_job(compose_job(overrides(tiny_model, data, out, "launcher=ray", "launcher.num_workers=2")))
    assert summary.state == "done" and (out / "_SUCCESS").exists()
    assert read_output(out).equals(single)
    status = json.loads((out / "_status.json").read_text())
    workers = status["engine"]["workers"]
    assert sum(w["failures"] for w in workers.values()) == 1  # part 2's first attempt
    assert sum(w["parts"] for w in workers.values()) == ROWS // PART and all(w["parts"] for w in workers.values())
    assert status["state"] == "done" and status["rows_done"] == ROWS


def test_a_worker_killed_mid_job_loses_and_duplicates_nothing(cluster, tiny_model, data, single, tmp_path):
    out = tmp_path / "out"
    cfg = compose_job(overrides(tiny_model, data, out, "launcher=ray", "launcher.num_workers=2"))
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(summary=run_job(cfg)))
    job.start()
    deadline = time.time() + 240
    while not list(out.glob("_part-*.journal")):  # a part in flight
        assert time.time() < deadline and job.is_alive(), "no part started"
        time.sleep(0.01)
    ray.kill(ray.get_actor("batchgen-worker-0"))
    job.join(timeout=300)
    assert result["summary"].state == "done"
    got = read_output(out)
    pairs = Counter(zip(got.column("id").to_pylist(), got.column("sample_index").to_pylist()))
    assert set(pairs.values()) == {1} and len(pairs) == 2 * ROWS  # every (id, sample) exactly once
    assert got.equals(single)
    workers = json.loads((out / "_status.json").read_text())["engine"]["workers"]
    assert workers["0"]["failures"] >= 1  # the killed worker's part was requeued


def test_ray_workers_commit_each_part_to_a_delta_table_once(cluster, tiny_model, data, single, tmp_path):
    """Each worker commits the parts it generates to the table output itself, racing the other worker's commits."""
    deltalake = pytest.importorskip("deltalake", reason="output.sink=delta needs deltalake")
    out = tmp_path / "out"
    summary = run_job(compose_job(overrides(tiny_model, data, out, "launcher=ray", "launcher.num_workers=2",
                                            "output.sink=delta", f"output.table={tmp_path / 'table'}")))
    assert summary.state == "done"
    table = deltalake.DeltaTable(str(tmp_path / "table")).to_pyarrow_table()
    keys = Counter(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()))
    assert len(keys) == ROWS * 2 and set(keys.values()) == {1}
    expected = single.append_column("attempt", pa.array([0] * single.num_rows, pa.int32()))
    order = ["id", "sample_index"]
    assert table.select(expected.column_names).sort_by([(c, "ascending") for c in order]).to_pylist() == \
        expected.sort_by([(c, "ascending") for c in order]).to_pylist()


def test_a_worker_that_finds_other_prompt_files_than_the_driver_stops_the_job(cluster, tiny_model, data, tmp_path,
                                                                              monkeypatch):
    """The model's tokenizer config edited after the driver read it and before a worker loads: the worker refuses
    (PromptPin), and the driver stops the job with that refusal (exit 2) instead of retrying it on other workers."""
    import shutil
    from pathlib import Path

    from batchgen.errors import ResumeMismatchError
    from batchgen.run.ray_job import PromptPin

    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    pinned = PromptPin.of

    def pin_then_edit(cfg, job):
        pin = pinned(cfg, job)
        with open(model / "tokenizer_config.json", "a") as f:
            f.write("\n")
        return pin

    monkeypatch.setattr(PromptPin, "of", pin_then_edit)
    refused = r"prompt_files\.tokenizer_config\.json: was [0-9a-f]{16}, now"
    with pytest.raises(ResumeMismatchError, match=refused) as got:
        run_job(compose_job(overrides(str(model), data, tmp_path / "out", "launcher=ray", "launcher.num_workers=1")))
    assert type(got.value) is ResumeMismatchError  # the worker's own refusal, not Ray's wrapper of it
    assert not list((tmp_path / "out").glob("part-*.parquet"))
