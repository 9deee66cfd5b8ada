"""One job set-up (run.preflight.open_input) for every way to run a job: the local runner, the Ray driver and its
workers, and `batchgen plan` read the same parts of the same input."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from batchgen.commands.plan import measure
from batchgen.run.runner import run_job
from tests.conftest import compose_job, job_overrides, write_jsonl

ROWS, PART = 10, 3


def parts_of(out) -> dict[str, list]:
    return {p.name: pq.read_table(p, columns=["id", "sample_index", "generation"]).to_pylist()
            for p in sorted(out.glob("part-*.parquet"))}


@pytest.mark.ray
def test_every_way_to_run_a_job_reads_the_same_parts(tiny_model, tmp_path):
    pytest.importorskip("ray", reason="launcher=ray needs ray: pip install 'batchgen[ray]'")
    data = write_jsonl(tmp_path / "in.jsonl", [{"uid": f"u{i}", "prompt": f"the river {i} " * (i % 4 + 1)}
                                              for i in range(ROWS)])

    def job(out, *extra):  # engine=dummy: no model, each generation a function of its request
        return compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "dataset.id_column=uid",
                                         f"run.rows_per_part={PART}", "sampling.max_new_tokens=4", *extra))

    run_job(job(tmp_path / "local"))
    plan, rows = measure(job(tmp_path / "plan"))
    run_job(job(tmp_path / "ray", "launcher=ray", "launcher.num_workers=1", "launcher.num_cpus=1"))
    local, ray = parts_of(tmp_path / "local"), parts_of(tmp_path / "ray")
    assert plan["parts"] == len(local) == -(-ROWS // PART) and plan["rows"] == ROWS == len(rows)
    assert ray == local  # the driver planned and the worker generated the same parts, row for row
