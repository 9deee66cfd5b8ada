"""`batchgen help KEY`: a key's default and meaning from the shipped reference (conf/reference.md)."""

from __future__ import annotations

from batchgen.commands.keys import matching, rows
from tests.conftest import run_cli


def test_help_shows_a_key_a_section_and_a_part_of_a_name():
    shown = run_cli(["help", "dataset.template"])
    assert shown.returncode == 0 and shown.stdout.startswith("dataset.template  [default: null]")
    assert "newline" in shown.stdout and "`" not in shown.stdout
    section = run_cli(["help", "run"]).stdout
    assert all(k in section for k in ("run.rows_per_part", "run.too_long", "run.skip_existing"))
    assert [r.keys for r in matching("prefix_cache")] == [["engine.prefix_cache"], ["engine.prefix_cache_mb"]]
    together = [["sampling.temperature", "sampling.top_p", "sampling.top_k"]]
    assert [r.keys for r in matching("sampling.top_p")] == together
    missing = run_cli(["help", "nothinghere"])
    assert missing.returncode == 2 and "no config key matches" in missing.stderr
    assert run_cli(["help"]).stdout.startswith("batchgen ")  # `batchgen help` alone: the usage
    assert all(r.meaning for r in rows()), [r.keys for r in rows() if not r.meaning]
