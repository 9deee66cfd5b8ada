"""JobConfig made in Python (not through Hydra) validates like the CLI's: interpolations done, ignored keys refused."""

from __future__ import annotations

import pytest

from batchgen.checks import validate
from batchgen.errors import BatchgenError, ConfigError
from batchgen.job import JobConfig
from batchgen.output.rows.assemble import assemble
from batchgen.records import Part, PlannedPart


def test_output_dir_gets_the_name_outside_hydra(tiny_model, tmp_path):
    cfg = JobConfig(name="nightly")
    cfg.engine.model, cfg.dataset.path = tiny_model, str(tmp_path)
    assert validate(cfg).output_dir == "data/outputs/nightly"


def test_validate_returns_the_resolved_job_and_leaves_the_given_config_as_it_was(tiny_model, tmp_path, monkeypatch):
    from batchgen.engines.hf.config import HFConfig

    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    cfg = JobConfig(name="nightly", output_dir="out/${name}")
    cfg.engine.model, cfg.dataset.path = tiny_model, str(tmp_path)
    resolved = validate(cfg)
    assert (resolved.output_dir, resolved.run.shard, resolved.run.num_shards) == ("out/nightly", 3, 4)
    assert isinstance(resolved.engine, HFConfig) and resolved.engine.model == tiny_model
    assert (cfg.output_dir, cfg.run.shard, cfg.run.num_shards) == ("out/${name}", None, None)
    assert type(cfg.engine) is not HFConfig and resolved is not cfg
    assert validate(resolved) == resolved  # resolving again changes nothing


def test_keys_the_chosen_engine_ignores_are_refused(tiny_model, tmp_path):
    cfg = JobConfig(name="j")
    cfg.engine.model, cfg.dataset.path = tiny_model, str(tmp_path)
    cfg.engine.name, cfg.engine.device = "vllm", "cuda:1"
    with pytest.raises(ConfigError, match=r"engine.device='cuda:1' is a setting of engine=hf; engine=vllm has no "):
        validate(cfg)
    cfg.engine.name, cfg.engine.device, cfg.engine.tensor_parallel_size = "hf", "auto", 2
    with pytest.raises(ConfigError, match=r"engine.tensor_parallel_size=2 is a setting of engine=vllm"):
        validate(cfg)


def test_a_request_the_engine_lost_is_a_clear_error_not_a_key_error():
    import pyarrow as pa

    part = Part(index=3, start=0, table=pa.table({"prompt": ["a", "b"]}), ids=["r0", "r1"], read_errors=[None, None])
    planned = PlannedPart(part=part, requests=[], errors=[None, None], seeds=[None, None], n=1)
    with pytest.raises(BatchgenError, match=r"part 3: the engine returned no result for row 'r0' sample 0"):
        assemble(planned, [])


def test_the_shards_shares_partition_the_parts_and_their_rows():
    from batchgen.job import Share

    for total, size, shards in [(0, 4, 3), (1, 4, 3), (10, 4, 3), (12, 4, 3), (13, 4, 1), (100, 7, 5)]:
        shares = [Share(k, shards, size) for k in range(shards)]
        parts = -(-total // size)
        assert all(sum(s.owns(i) for s in shares) == 1 for i in range(parts))  # each part has one owner
        assert sum(s.rows(total) for s in shares) == total
        by_hand = [sum(min(size, total - i * size) for i in range(parts) if i % shards == k) for k in range(shards)]
        assert [s.rows(total) for s in shares] == by_hand
    cfg = JobConfig(name="j")
    cfg.run.rows_per_part, cfg.run.shard, cfg.run.num_shards = 5, 1, 2
    assert cfg.share() == Share(1, 2, 5) and JobConfig(name="j").share().num_shards == 1
