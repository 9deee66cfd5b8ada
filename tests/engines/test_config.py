"""Each engine owns its settings: a config class beside the engine (hf/config.py, vllm.py, dummy.py) that Hydra's
engine group composes, that a config made in Python is turned into, and that refuses another engine's keys."""

from __future__ import annotations

import dataclasses

import pytest

from batchgen.commands.compose import compose_checked, config_from
from batchgen.engines import ENGINES, engine_config
from batchgen.engines.base import EngineConfig
from batchgen.engines.dummy import DummyConfig
from batchgen.engines.endpoint.config import OpenAIConfig
from batchgen.engines.hf.config import HFConfig
from batchgen.engines.vllm_config import VLLMConfig
from batchgen.errors import ConfigError
from tests.conftest import job_overrides, write_parquet

SHARED = {f.name for f in dataclasses.fields(EngineConfig)}


def keys(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_each_engine_declares_its_own_keys_beside_the_shared_ones():
    assert {name: spec.config for name, spec in ENGINES.items()} == {"hf": HFConfig, "vllm": VLLMConfig,
                                                                     "openai": OpenAIConfig, "dummy": DummyConfig}
    assert keys(HFConfig) - SHARED == {"device", "threads", "prepack", "prefix_cache", "prefix_cache_mb",
                                       "cuda_graphs", "gpu_memory_utilization"}
    assert keys(VLLMConfig) - SHARED == {"tensor_parallel_size", "gpu_memory_utilization", "enable_prefix_caching",
                                         "extra_args"}
    assert keys(DummyConfig) - SHARED == {"extra_args"}
    assert keys(OpenAIConfig) - SHARED == {"base_url", "endpoint", "api_key_env", "max_concurrency", "timeout_s",
                                           "max_retries", "stop_grace_s", "extensions", "extra_body"}
    assert all(spec.config().name == name for name, spec in ENGINES.items())


@pytest.mark.parametrize("engine,cls", [("hf", HFConfig), ("vllm", VLLMConfig), ("dummy", DummyConfig)])
def test_the_engine_group_composes_the_engines_class(tiny_model, tmp_path, engine, cls):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    cfg = compose_checked(job_overrides(tiny_model, data, tmp_path / "o", f"engine={engine}"))
    assert type(cfg.engine) is cls and cfg.engine.model == tiny_model


def test_another_engines_key_on_the_command_line_names_whose_it_is(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    with pytest.raises(ConfigError) as err:
        compose_checked(job_overrides(tiny_model, data, tmp_path / "o", "engine=dummy", "engine.threads=2",
                                      "engine.tensor_parallel_size=2", "engine.prefix_cach=on"))
    assert err.value.problems == [
        "engine.threads='2' is a setting of engine=hf; engine=dummy has no such key (remove it, or pass vLLM "
        "options in engine.extra_args)",
        "engine.tensor_parallel_size='2' is a setting of engine=vllm; engine=dummy has no such key (remove it, or "
        "pass vLLM options in engine.extra_args)",
        "engine.prefix_cach: no such config key (did you mean engine.prefix_cache?); see batchgen help "
        "engine.prefix_cache"]


def test_a_config_made_in_python_becomes_its_engines_class():
    own, problems = engine_config(EngineConfig(name="vllm", model="m", max_batch_size=8))
    assert type(own) is VLLMConfig and own.max_batch_size == 8 and not problems
    hf = HFConfig(model="m", threads=4)
    hf.name = "dummy"
    own, problems = engine_config(hf)
    assert type(own) is DummyConfig and problems == [
        "engine.threads=4 is a setting of engine=hf; engine=dummy has no such key (remove it, or pass vLLM options "
        "in engine.extra_args)"]


def test_a_retry_of_an_output_written_before_engines_had_their_own_keys(tiny_model, tmp_path):
    """A manifest's resolved config from before the split holds every engine's keys (at their defaults where the
    engine was another's): batchgen retry builds the engine's own class from it."""
    union = {"name": "dummy", "model": tiny_model, "tokenizer": None, "dtype": "auto", "quantization": None,
             "device": "auto", "max_batch_tokens": None, "max_batch_size": None, "max_model_len": None,
             "threads": None, "prepack": True, "prefix_cache": "auto", "prefix_cache_mb": 1024,
             "trust_remote_code": False, "tensor_parallel_size": 1, "gpu_memory_utilization": None,
             "enable_prefix_caching": True, "extra_args": {"delay_s": 0.0}}
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    resolved = {"name": "t", "output_dir": str(tmp_path / "o"), "engine": union,
                "dataset": {"path": str(data), "format": "parquet"}}
    cfg = config_from(resolved, ["engine.max_batch_size=4"])
    assert type(cfg.engine) is DummyConfig and cfg.engine.max_batch_size == 4
    assert cfg.engine.extra_args == {"delay_s": 0.0}
    with pytest.raises(ConfigError, match=r"engine.device='cpu' is a setting of engine=hf; engine=dummy"):
        config_from(resolved, ["engine.device=cpu"])
