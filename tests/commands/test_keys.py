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


def test_vllms_names_are_answered_with_batchgens_keys_or_why_there_is_none():
    """`batchgen help max_tokens` names sampling.max_new_tokens and shows it; a name batchgen does not take says why;
    an override naming a vLLM name is pointed at its key, never at a look-alike (stop_token_ids once suggested
    engine.stop_grace_s); docs/recipes.md's "Coming from vLLM" table lists every name, each key a real one."""
    from batchgen.commands.keynames import config_keys, unknown_keys
    from batchgen.commands.keys import VLLM_NAMES
    from tests.conftest import REPO

    shown = run_cli(["help", "max_tokens"])
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("vLLM's max_tokens is sampling.max_new_tokens\nsampling.max_new_tokens  [default")
    refused = run_cli(["help", "lora_request"])
    assert refused.returncode == 0 and "not supported, because" in refused.stdout
    assert unknown_keys(["sampling.max_tokens=5", "stop_token_ids=[1]", "sampling.watermarking=true"]) == [
        "sampling.max_tokens: no such config key (did you mean sampling.max_new_tokens, vLLM's max_tokens?); see "
        "batchgen help max_tokens",
        "stop_token_ids: no such config key (did you mean sampling.stop_token_ids?); see batchgen help "
        "sampling.stop_token_ids",
        "sampling.watermarking: no such config key (vLLM's watermarking: not supported, because batchgen writes no "
        "output watermark); see batchgen help watermarking"]
    keys = set(config_keys()) | {"sampling"}
    assert all(key in keys for key, _ in VLLM_NAMES.values() if key), [k for k, _ in VLLM_NAMES.values()]
    docs = (REPO / "docs" / "recipes.md").read_text().split("## Coming from vLLM", 1)[1].split("\n## ", 1)[0]
    assert [name for name in VLLM_NAMES if f"`{name}`" not in docs and f", {name}" not in docs
            and f"({name}," not in docs] == []
