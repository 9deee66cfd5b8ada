"""ledger/existing.py: run.skip_existing's ids must be stable. Without dataset.id_column a row's id is its position
`<file>:<row>`, so a table rewritten in another order would skip new rows as generated and generate old ones again:
the job is refused (exit 2, naming dataset.id_column) unless run.skip_by_position=true says positions are ids, which
is warned. (The chain and the ledger of nights: tests/output/test_nights.py, tests/scenarios/test_round2_output.py.)"""

from __future__ import annotations

import logging

import pytest

from batchgen.errors import ConfigError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, dummy_overrides, write_parquet


def test_skip_existing_refuses_ids_that_are_positions_unless_told_they_are(tiny_model, tmp_path, caplog):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": f"ticket {i}"} for i in range(4)])
    first = tmp_path / "first"
    run_job(compose_job(dummy_overrides(tiny_model, data, first, "run.rows_per_part=2")))
    second = tmp_path / "second"
    with pytest.raises(ConfigError, match=r"run.skip_existing=.*: dataset.id_column is not set, so each row's id is "
                                          r"its position .*run.skip_by_position=true") as refused:
        run_job(compose_job(dummy_overrides(tiny_model, data, second, "run.rows_per_part=2",
                                            f"run.skip_existing={first}")))
    assert refused.value.exit_code == 2 and not second.exists()
    with caplog.at_level(logging.WARNING):
        summary = run_job(compose_job(dummy_overrides(tiny_model, data, second, "run.rows_per_part=2",
                                                      f"run.skip_existing={first}",
                                                      "run.skip_by_position=true")))
    assert "dataset.id_column is not set and run.skip_by_position=true" in caplog.text
    assert summary.totals.skipped == 4
