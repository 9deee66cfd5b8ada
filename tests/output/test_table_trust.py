"""An output's manifest is data: `view --table`, `status` and `report` read output dirs that another user or job
wrote, and open the table output the manifest records; `retry` runs its recorded config again. A catalog property
that names code for pyiceberg to import (`py-catalog-impl`, `py-io-impl`) is refused, never imported; the job's own
config (or the retry's command line, saying it again) may name one."""

from __future__ import annotations

import json

import pytest

from batchgen.run.runner import run_job
from tests.conftest import compose_job, run_cli, write_parquet
from tests.output.test_tables import args, rows

pytest.importorskip("pyiceberg", reason="the table tests need pyiceberg (pip install -e '.[dev]')")

MARKER_MODULE = '''
import pathlib, os
pathlib.Path(os.environ["BATCHGEN_TEST_MARKER"]).write_text("imported")


class Catalog:
    def __init__(self, name, **props):
        pathlib.Path(os.environ["BATCHGEN_TEST_MARKER"]).write_text("instantiated")
'''


@pytest.mark.parametrize("key", ["py-catalog-impl", "py-io-impl"])
def test_reading_commands_never_import_the_code_a_manifest_names(tiny_model, tmp_path, key):
    data = write_parquet(tmp_path / "in.parquet", rows(0, 10))
    run_job(compose_job(args(tiny_model, data, tmp_path / "out", "iceberg", tmp_path)))
    manifest_path = tmp_path / "out" / "_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    catalog = manifest["config"]["output"]["catalog"]
    catalog[key] = "planted_catalog.Catalog"
    if key == "py-catalog-impl":
        catalog.pop("type")  # pyiceberg takes one or the other
    manifest_path.write_text(json.dumps(manifest))
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "planted_catalog.py").write_text(MARKER_MODULE)
    marker = tmp_path / "marker"
    env = {"PYTHONPATH": str(tmp_path / "code"), "BATCHGEN_TEST_MARKER": str(marker)}
    view = run_cli(["view", str(tmp_path / "out"), "--table"], env=env)
    assert view.returncode == 2 and f"output.catalog.{key} names code to import" in view.stderr, view.stderr
    assert "Traceback" not in view.stderr
    status = run_cli(["status", str(tmp_path / "out")], env=env)
    assert status.returncode == 0 and f"output.catalog.{key}" in status.stdout, status.stdout + status.stderr
    assert run_cli(["report", str(tmp_path / "out")], env=env).returncode == 0
    retry = run_cli(["retry", str(tmp_path / "out")], env=env)  # the job run again from the manifest's config
    assert retry.returncode == 2, retry.stderr[-3000:]
    assert f"records output.catalog.{key}=planted_catalog.Catalog: batchgen retry runs no code" in retry.stderr
    assert not marker.exists(), marker.read_text()
