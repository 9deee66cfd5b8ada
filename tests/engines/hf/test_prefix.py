"""The hf engine's prefix cache (engine.prefix_cache): shared prompt prefixes computed once, the same output."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.engines.hf.config import HFConfig
from batchgen.engines.hf.engine import HFEngine
from batchgen.engines.hf.prefix import BLOCK, PrefixCache
from batchgen.records import Request
from batchgen.sampling import SampleParams
from tests.conftest import WORDS

GREEDY = SampleParams(max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=True)
SAMPLED = SampleParams(max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=0, stop=(), ignore_eos=True)


def shared_prompt_rows(tokenizer, rows: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Rows of one ~300-token system prompt then 1 to 200 tokens of their own, each tokenized as a whole, so that
    BPE may merge across the boundary; returns (prompt ids, the system prompt's own ids)."""
    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(400))
    system_ids = tokenizer(system).input_ids
    while len(system_ids) > 300:
        system = system.rsplit(" ", 1)[0]
        system_ids = tokenizer(system).input_ids
    prompts = []
    for i in range(rows):
        own = rng.randint(1, 200)
        text = system + ("" if i % 3 else " ") + "".join(rng.choice("abcdefgh ") for _ in range(own))
        prompts.append(tokenizer(text).input_ids[:len(system_ids) + own])
    return prompts, system_ids


def engine(tiny_model, tokenizer, mode: str, **kw) -> HFEngine:
    return HFEngine(HFConfig(model=tiny_model, dtype="float32", prefix_cache=mode, max_batch_size=6, **kw),
                    tokenizer)


def test_greedy_output_with_the_prefix_cache_equals_output_without_it(tiny_model, tokenizer):
    prompts, system_ids = shared_prompt_rows(tokenizer, 14)
    merged = [p for p in prompts if p[:len(system_ids)] != system_ids]
    assert merged and len(merged) < len(prompts)  # some rows' boundaries merged under BPE: they share less
    reqs = [Request(key=i, prompt_ids=p, params=GREEDY, seed=None) for i, p in enumerate(prompts)]
    off = engine(tiny_model, tokenizer, "off")
    on = engine(tiny_model, tokenizer, "on")
    expected = off.generate(reqs)
    got = on.generate(reqs)
    assert [(r.text, r.num_generated_tokens) for r in got] == [(r.text, r.num_generated_tokens) for r in expected]
    s = on.counters
    assert off.counters.prefix_tokens_reused == 0
    assert s.prefix_tokens_reused >= (len(prompts) - len(merged) - 1) * (len(system_ids) // BLOCK) * BLOCK
    assert s.prefill_tokens + s.prefix_tokens_reused == off.counters.prefill_tokens + s.prefix_tokens_computed
    assert s.prefill_tokens < 0.6 * off.counters.prefill_tokens
    assert 0 < s.prefix_cache_bytes <= 1024 << 20


def test_samples_of_a_row_share_its_prompt_and_sample_as_without_the_cache(tiny_model, tokenizer):
    """n > 1: the samples of a row have the same prompt; each keeps its own seed's draw."""
    prompts, _ = shared_prompt_rows(tokenizer, 3, seed=1)
    reqs = [Request(key=row * 4 + s, prompt_ids=prompts[row], params=SAMPLED, seed=1000 * row + s)
            for row in range(3) for s in range(4)]
    expected = engine(tiny_model, tokenizer, "off").generate(reqs)
    on = engine(tiny_model, tokenizer, "on")
    assert [r.text for r in on.generate(reqs)] == [r.text for r in expected]
    assert on.counters.prefix_tokens_reused > 3 * 3 * (len(prompts[0]) // BLOCK - 1) * BLOCK


def test_the_cache_is_kept_across_windows_and_a_prefix_under_one_block_is_not_cached(tiny_model, tokenizer):
    prompts, _ = shared_prompt_rows(tokenizer, 8, seed=2)
    eng = engine(tiny_model, tokenizer, "auto")
    reqs = [Request(key=i, prompt_ids=p, params=GREEDY, seed=None) for i, p in enumerate(prompts)]
    eng.generate(reqs[:4])
    computed = eng.counters.prefix_tokens_computed
    eng.generate(reqs[4:])  # the next window finds the system prompt's blocks cached
    assert eng.counters.prefix_tokens_computed - computed < computed
    short = [[5, 6, 7] + [9] * 25 + [i] * 10 for i in range(4)]  # 28 shared tokens: not one whole block
    before = eng.counters.prefix_tokens_reused
    eng.generate([Request(key=i, prompt_ids=p, params=GREEDY, seed=None) for i, p in enumerate(short)])
    assert eng.counters.prefix_tokens_reused == before


def test_prefix_cache_lookup_sharing_and_its_memory_bound():
    def kv(tokens: int) -> torch.Tensor:
        return torch.zeros(2, 1, tokens, 4)  # [layers, kv_heads, P, d]: 32 bytes per token per tensor

    cache = PrefixCache(max_bytes=6000, min_tokens=BLOCK)  # one entry of 64 tokens (4096 bytes), not two
    a = list(range(100))
    b = list(range(70)) + [999] * 30
    c = [7] * 100
    shared = cache.shared([a, b, c])
    assert shared == [tuple(range(64))]  # a and b share two whole blocks; c shares nothing
    cache.add(shared[0], kv(64), kv(64))
    assert cache.lookup(a).ids == tuple(range(64)) and cache.lookup(c) is None
    assert cache.lookup(list(range(64))) is None  # the row's last token is always prefilled
    assert cache.shared([a, b]) == []  # already held
    assert cache.stats.prefix_cache_bytes == 2 * 64 * 32  # keys and values, 64 tokens, 32 bytes a token
    cache.add(tuple([7] * 64), kv(64), kv(64))  # over the bound: the least recently used entry goes
    assert cache.stats.prefix_evictions == 1 and cache.lookup(a) is None and cache.lookup(c) is not None


def test_prefix_cache_values_are_checked(tiny_model, tmp_path):
    from batchgen.commands.compose import compose_checked
    from batchgen.errors import ConfigError
    from tests.conftest import job_overrides, write_parquet

    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    with pytest.raises(ConfigError, match=r"engine.prefix_cache must be one of auto, on, off"):
        compose_checked(job_overrides(tiny_model, data, tmp_path / "o", "engine.prefix_cache=sometimes"))
    with pytest.raises(ConfigError, match=r"engine.prefix_cache=.* is a setting of engine=hf"):
        compose_checked(job_overrides(tiny_model, data, tmp_path / "o", "engine=vllm", "engine.prefix_cache=off"))


def test_a_job_with_a_shared_system_prompt_writes_the_same_with_and_without_the_cache(tiny_model, tokenizer, tmp_path):
    """Chat rows under one long system prompt (sampling.n=2, seeded): the job's output is the same either way, and
    the status and the summary count the prompt tokens the cache saved."""
    import json

    from batchgen.run.runner import run_job
    from tests.conftest import compose_job, corpus, job_overrides, read_output, write_parquet

    system = " ".join(corpus(40, seed=9))
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(10, seed=8)])
    common = (f"dataset.system_prompt='{system}'", "sampling=sample", "sampling.n=2", "sampling.max_new_tokens=6",
              "engine.max_batch_size=4", "run.rows_per_part=4")
    summary = run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "on", *common,
                                                "engine.prefix_cache=on")))
    run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "off", *common, "engine.prefix_cache=off")))
    on, off = read_output(tmp_path / "on"), read_output(tmp_path / "off")
    assert on.column("generation").to_pylist() == off.column("generation").to_pylist()
    assert on.column("seed").to_pylist() == off.column("seed").to_pylist()
    status = json.loads((tmp_path / "on" / "_status.json").read_text())["engine"]
    assert status["prefix_tokens_reused"] == summary.prefix_tokens_reused > 10 * len(tokenizer(system).input_ids)
    assert "prompt tokens reused instead of prefilled" in summary.render()


def test_int8_weights_with_the_prefix_cache(tiny_model, tokenizer):
    """Quantized weights: the cache is used and the greedy output is what the same int8 model writes without it."""
    prompts, _ = shared_prompt_rows(tokenizer, 8, seed=3)
    reqs = [Request(key=i, prompt_ids=p, params=GREEDY, seed=None) for i, p in enumerate(prompts)]
    off = engine(tiny_model, tokenizer, "off", quantization="int8")
    on = engine(tiny_model, tokenizer, "on", quantization="int8")
    expected, got = off.generate(reqs), on.generate(reqs)
    assert on.counters.prefix_tokens_reused > 0
    assert [r.text for r in got] == [r.text for r in expected]


def test_a_shared_prefix_is_cut_to_what_the_cache_can_hold():
    """A prefix bigger than engine.prefix_cache_mb is not computed in vain: it is cut to the blocks that fit."""
    cache = PrefixCache(max_bytes=100 * 32, min_tokens=BLOCK)  # 100 tokens at 32 bytes a token
    a, b = list(range(300)) + [1], list(range(300)) + [2]
    assert cache.shared([a, b]) == [tuple(range(288))]  # without a byte figure: the longest shared
    assert cache.shared([a, b], bytes_per_token=32) == [tuple(range(96))]  # three blocks fit
    assert cache.shared([a, b], bytes_per_token=10_000) == []  # not one block fits
