"""The hf engine: greedy equivalence with one-row HF generate, seeds independent of batching,
EOS / stop strings / per-row caps, and the sampling filters."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.config import HFConfig
from batchgen.engines.hf.device import resolve_dtype
from batchgen.engines.hf.engine import HFEngine
from batchgen.engines.hf.sampling.draw import RowParams, sample
from batchgen.records import Request
from batchgen.run.runner import run_job
from batchgen.sampling import SampleParams
from tests.conftest import WORDS, compose_job, generate_generic, job_overrides, read_output, write_parquet

GREEDY = SampleParams(max_new_tokens=16, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=False)


def prompts_with_lengths(tokenizer, lengths: list[int], seed: int = 0) -> list[str]:
    """Texts whose tokenized length (BOS included) is close to each target length."""
    rng = random.Random(seed)
    out = []
    for target in lengths:
        words: list[str] = []
        while len(tokenizer(" ".join(words)).input_ids) < target:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words) or rng.choice(WORDS))
    return out


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    return HFEngine(HFConfig(model=tiny_model, dtype="float32", max_batch_tokens=2048, max_batch_size=16),
                    tokenizer)


@pytest.fixture(scope="module")
def reference(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def generate_alone(model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_job_equals_one_row_generate(tiny_model, tokenizer, reference, tmp_path):
    """64 rows, prompts of 1 to 300 tokens, through a real job: each row equals HF generate on it alone."""
    lengths = [1 + round(i * 299 / 63) for i in range(64)]
    random.Random(1).shuffle(lengths)
    texts = prompts_with_lengths(tokenizer, lengths)
    data = write_parquet(tmp_path / "in.parquet", [{"id": f"r{i}", "prompt": t} for i, t in enumerate(texts)])
    cfg = compose_job(job_overrides(tiny_model, data, tmp_path / "out", "sampling.max_new_tokens=24",
                                    "dataset.id_column=id", "run.rows_per_part=24", "engine.max_batch_size=8"))
    run_job(cfg)
    out = read_output(tmp_path / "out").to_pylist()
    assert [r["id"] for r in out] == [f"r{i}" for i in range(64)]
    spread = [len(tokenizer(t).input_ids) for t in texts]
    assert min(spread) <= 2 and max(spread) >= 300
    for row, text in zip(out, texts):
        ids = tokenizer(text).input_ids
        expected = generate_alone(reference, ids, 24)
        assert row["num_generated_tokens"] == len(expected), row["id"]
        assert row["generation"] == tokenizer.decode(expected, skip_special_tokens=True), row["id"]
        assert row["num_prompt_tokens"] == len(ids)


def test_rows_with_different_caps_leave_the_batch_independently(engine, reference, tokenizer):
    """Rows of one bucket with caps 1..40 finish at different steps; each still equals its solo run."""
    texts = prompts_with_lengths(tokenizer, [5, 40, 12, 60, 33, 8, 21, 50], seed=3)
    caps = [1, 40, 7, 23, 2, 31, 15, 9]
    reqs = []
    for i, (t, cap) in enumerate(zip(texts, caps)):
        params = SampleParams(max_new_tokens=cap, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=True)
        reqs.append(Request(key=i, prompt_ids=tokenizer(t).input_ids, params=params, seed=None))
    results = engine.generate(reqs)
    for req, res in zip(reqs, results):
        assert res.key == req.key
        assert res.num_generated_tokens == req.params.max_new_tokens
        assert res.finish_reason == "length"
        model_cfg = reference.generation_config
        eos, model_cfg.eos_token_id = model_cfg.eos_token_id, None  # ignore_eos on the reference too
        try:
            expected = generate_alone(reference, req.prompt_ids, req.params.max_new_tokens)
        finally:
            model_cfg.eos_token_id = eos
        assert res.text == tokenizer.decode(expected, skip_special_tokens=True)


def test_sample_depends_on_seed_not_on_batch(engine, tokenizer):
    params = SampleParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, stop=(), ignore_eos=True)
    texts = prompts_with_lengths(tokenizer, [10, 30, 20, 5], seed=5)
    reqs = [Request(key=i, prompt_ids=tokenizer(t).input_ids, params=params, seed=1000 + i)
            for i, t in enumerate(texts)]
    together = engine.generate(reqs)
    alone = [engine.generate([r])[0] for r in reqs]
    assert [r.text for r in together] == [r.text for r in alone]
    reseeded = engine.generate([Request(key=0, prompt_ids=reqs[0].prompt_ids, params=params, seed=7)])
    assert len({reseeded[0].text, together[0].text}) == 2  # a different seed gives a different sample


def test_stop_string_cuts_generation(engine, tokenizer):
    ids = tokenizer("the river town").input_ids
    free = engine.generate([Request(key=0, prompt_ids=ids, params=GREEDY, seed=None)])[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    params = SampleParams(max_new_tokens=16, temperature=0.0, top_p=1.0, top_k=0, stop=(stop,), ignore_eos=False)
    cut = engine.generate([Request(key=0, prompt_ids=ids, params=params, seed=None)])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert cut.num_generated_tokens <= free.num_generated_tokens


def test_stop_string_late_in_a_long_generation_stops_at_the_first_token_that_completes_it(engine, tokenizer,
                                                                                           reference):
    """The stop check reads only a tail of the generation; it must still stop where a full decode would."""
    ids = tokenizer("the river town").input_ids
    tokens = generate_alone(reference, ids, 80)  # the greedy tokens (the engine equals this; tested above)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    stop = next(text[i:i + 4] for i in range(len(text) - 8, 0, -1) if text.find(text[i:i + 4]) == i)
    first = next(k for k in range(1, len(tokens) + 1)
                 if stop in tokenizer.decode(tokens[:k], skip_special_tokens=True))
    assert first > 4 * len(stop) + 8  # the stop completes beyond the tail window the engine decodes
    params = SampleParams(max_new_tokens=80, temperature=0.0, top_p=1.0, top_k=0, stop=(stop,), ignore_eos=True)
    cut = engine.generate([Request(key=0, prompt_ids=ids, params=params, seed=None)])[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    assert cut.num_generated_tokens == first


def test_sampling_filters_keep_only_allowed_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, -1.0, -2.0]).expand(200, -1)
    steps = torch.arange(200)  # one row's 200 draws

    def drawn(p: SampleParams) -> set[int]:
        return set(sample(logits, RowParams.of_rows([p] * 200, [7] * 200, logits.device), steps).tolist())

    top_k = SampleParams(max_new_tokens=1, temperature=1.0, top_p=1.0, top_k=2, stop=(), ignore_eos=False)
    assert drawn(top_k) <= {0, 1}
    top_p = SampleParams(max_new_tokens=1, temperature=1.0, top_p=0.5, top_k=0, stop=(), ignore_eos=False)
    assert drawn(top_p) == {0}


def test_auto_dtype_follows_the_measured_gemm_speed_and_an_explicit_dtype_wins(monkeypatch, tmp_path, caplog):
    """engine.dtype=auto on CPU: bf16 only where the calibration measured it clearly faster than float32 (an emulated
    bf16 is ~200x slower, a native one ~2.7x faster); the figures are cached per CPU kind and logged."""
    import logging

    from batchgen.engines.hf.backends.cpu import calibration as cpu_dtype

    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "emulated"))
    emulated = {"cpu": "x", "float32_s": 1e-3, "bfloat16_s": 0.2, "speedup": 0.005}
    monkeypatch.setattr(cpu_dtype, "measure", lambda features: emulated | {"shape": [64, *features]})
    with caplog.at_level(logging.INFO, logger=cpu_dtype.__name__):
        assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert "float32" in caplog.text and "0.01x" in caplog.text and "measured now" in caplog.text
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "native"))
    native = {"cpu": "x", "float32_s": 1e-3, "bfloat16_s": 3.7e-4, "speedup": 2.7}
    monkeypatch.setattr(cpu_dtype, "measure", lambda features: native | {"shape": [64, *features]})
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(cpu_dtype, "measure", lambda features: pytest.fail("measured again: the cache was not read"))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


def test_dtype_calibration_times_the_models_shape_capped():
    from types import SimpleNamespace

    from batchgen.engines.hf.backends.cpu import calibration as cpu_dtype

    assert cpu_dtype.model_features(SimpleNamespace(hidden_size=768, intermediate_size=2048)) == (768, 2048)
    assert cpu_dtype.model_features(SimpleNamespace(hidden_size=8192, intermediate_size=28672)) == (4096, 4096)
    assert cpu_dtype.model_features(None) == cpu_dtype.DEFAULT_FEATURES
    assert cpu_dtype.fastest_dtype((64, 128)) == torch.float32  # too small to prepack: no measurement needed


def test_dtype_calibration_measures_both_dtypes_here(monkeypatch, tmp_path):
    """The real measurement on this CPU: both dtypes timed, the ratio consistent with the times, cached on disk."""
    from batchgen.engines.hf.backends.cpu import calibration as cpu_dtype

    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    figures = cpu_dtype.calibration()
    assert figures["source"] == "measured now" and figures["float32_s"] > 0 and figures["bfloat16_s"] > 0
    assert figures["speedup"] == pytest.approx(figures["float32_s"] / figures["bfloat16_s"])
    assert cpu_dtype.calibration()["source"].startswith("cached in") and len(list(tmp_path.iterdir())) == 1
    print(f"{cpu_dtype.cpu_model()}: float32 {1e3 * figures['float32_s']:.3f} ms, bfloat16 "
          f"{1e3 * figures['bfloat16_s']:.3f} ms, bf16 speedup {figures['speedup']:.2f}x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_generates(tiny_model, tokenizer):
    eng = HFEngine(HFConfig(model=tiny_model, device="cuda"), tokenizer)
    res = eng.generate([Request(key=0, prompt_ids=tokenizer("the river").input_ids, params=GREEDY, seed=None)])
    assert res[0].num_generated_tokens >= 1 and eng.dtype in (torch.bfloat16, torch.float16)



def test_generic_path_matches_the_fast_path(engine, tokenizer):
    texts = prompts_with_lengths(tokenizer, [3, 17, 64, 9, 120, 33], seed=9)
    params = SampleParams(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=0, stop=(), ignore_eos=False)
    reqs = [Request(key=i, prompt_ids=tokenizer(t).input_ids, params=params if i % 2 else GREEDY, seed=50 + i)
            for i, t in enumerate(texts)]
    fast = engine.generate(reqs)
    generic = generate_generic(engine, reqs)
    assert [(r.text, r.finish_reason, r.num_generated_tokens) for r in fast] == \
        [(r.text, r.finish_reason, r.num_generated_tokens) for r in generic]


def test_prompts_past_the_token_budget_are_chunked_and_generate_what_one_prefill_does(tiny_model, tokenizer,
                                                                                       reference):
    """engine.max_batch_tokens=96 with prompts of up to 150 tokens: no prefill pass past 96 tokens, every greedy row
    equal to HF generate on it alone, seeded sampled rows equal to their draws under a budget that chunks nothing.
    A second window's long prompt starts its chunks after the prefix the first window's rows cached."""
    shared = prompts_with_lengths(tokenizer, [34], seed=11)[0]
    texts = prompts_with_lengths(tokenizer, [150, 12, 130, 5, 33, 70], seed=12)
    texts += [shared + " " + t for t in prompts_with_lengths(tokenizer, [5, 6, 80], seed=13)]
    sampled = SampleParams(max_new_tokens=10, temperature=0.9, top_p=0.95, top_k=0, stop=(), ignore_eos=True)
    reqs = [Request(key=i, prompt_ids=tokenizer(t).input_ids, params=sampled if i in (2, 7) else GREEDY,
                    seed=70 + i) for i, t in enumerate(texts)]
    chunked = HFEngine(HFConfig(model=tiny_model, dtype="float32", max_batch_tokens=96, max_batch_size=8,
                                prefix_cache="on"), tokenizer)
    whole = HFEngine(HFConfig(model=tiny_model, dtype="float32", max_batch_tokens=4096, max_batch_size=4),
                     tokenizer)
    passes, prefill = [], chunked.stepper.prefill

    def counting(cache, first_slot, prompts, starts=None):
        passes.append(sum(len(p) for p in prompts) - sum(starts or []))  # the tokens this pass computes
        return prefill(cache, first_slot, prompts, starts)

    chunked.stepper.prefill = counting
    got = chunked.generate(reqs[:-1])
    reused = chunked.counters.prefix_tokens_reused
    got += chunked.generate(reqs[-1:])
    want = whole.generate(reqs)
    assert len(reqs[-1].prompt_ids) > 96 and chunked.counters.prefix_tokens_reused > reused > 0
    assert max(passes) <= 96 and chunked.counters.prefill_chunks >= 2 + 2 + 1
    for req, res, ref in zip(reqs, got, want):
        if req.params is GREEDY:
            expected = generate_alone(reference, req.prompt_ids, GREEDY.max_new_tokens)
            assert res.text == tokenizer.decode(expected, skip_special_tokens=True), req.key
        assert (res.text, res.num_generated_tokens) == (ref.text, ref.num_generated_tokens), req.key


def test_no_decode_step_is_spent_on_a_finished_row(tiny_model, tokenizer):
    eng = HFEngine(HFConfig(model=tiny_model, dtype="float32", max_batch_size=4), tokenizer)
    caps = [1, 30, 5, 12, 2, 25, 8, 3, 17, 6]
    reqs = [Request(key=i, prompt_ids=tokenizer("the river " * (i + 1)).input_ids,
                    params=SampleParams(max_new_tokens=c, temperature=0.0, top_p=1.0, top_k=0, stop=(),
                                        ignore_eos=True), seed=None) for i, c in enumerate(caps)]
    results = eng.generate(reqs)
    assert [r.num_generated_tokens for r in results] == caps
    # the first token of each row comes from its prefill; every decode row-step yields one more useful token
    assert eng.counters.decode_row_steps == sum(c - 1 for c in caps)
    assert eng.counters.decode_steps < sum(caps)  # rows shared steps: 4 slots, waiting rows joined as others left


def test_out_of_memory_in_prefill_halves_the_budget_and_retries(engine, tokenizer, monkeypatch):
    from batchgen.engines.hf.step import LlamaStepper

    texts = prompts_with_lengths(tokenizer, [40, 35, 30, 25, 20, 15], seed=11)
    reqs = [Request(key=i, prompt_ids=tokenizer(t).input_ids, params=GREEDY, seed=None) for i, t in enumerate(texts)]
    expected = engine.generate(reqs)
    real = LlamaStepper.prefill

    def tight_memory(self, cache, first_slot, prompts):
        if len(prompts) > 2:  # a fault injected at the allocation point: big buckets do not fit
            raise torch.OutOfMemoryError("injected: out of memory")
        return real(self, cache, first_slot, prompts)

    monkeypatch.setattr(LlamaStepper, "prefill", tight_memory)
    before = engine.counters.oom_backoffs
    budget = engine.max_batch_tokens
    try:
        got = engine.generate(reqs)
    finally:
        engine.max_batch_tokens = budget
    assert [r.text for r in got] == [r.text for r in expected]
    assert engine.counters.oom_backoffs > before


def test_out_of_memory_allocating_the_cache_or_in_the_generic_path_backs_off(tiny_model, tokenizer, monkeypatch):
    from batchgen.engines.hf.step import LlamaStepper

    eng = HFEngine(HFConfig(model=tiny_model, dtype="float32", max_batch_size=8), tokenizer)
    reqs = [Request(key=i, prompt_ids=tokenizer("the river " * (i + 1)).input_ids, params=GREEDY, seed=None)
            for i in range(6)]
    expected = [r.text for r in eng.generate(reqs)]
    real_cache = LlamaStepper.new_cache

    def small_memory(self, slots, max_len):
        if slots > 2:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: injected")
        return real_cache(self, slots, max_len)

    monkeypatch.setattr(LlamaStepper, "new_cache", small_memory)
    assert [r.text for r in eng.generate(reqs)] == expected
    assert eng.counters.oom_backoffs == 2 and eng.max_batch_size <= 2  # 6 slots -> 3 -> 1

    from batchgen.engines.hf.generic import GenericGenerator

    real_bucket = GenericGenerator._bucket

    def tight_generic(self, bucket):
        if len(bucket) > 1:
            raise torch.OutOfMemoryError("injected: out of memory")
        return real_bucket(self, bucket)

    monkeypatch.setattr(GenericGenerator, "_bucket", tight_generic)
    eng.fast, eng.max_batch_size = False, 8
    assert [r.text for r in eng.generate(reqs)] == expected
    assert eng.counters.oom_backoffs > 2


def test_prepacked_linears_compute_what_nn_linear_computes():
    """Weights with both sides >= MIN_FEATURES are reordered for oneDNN; the forward is nn.Linear's."""
    from torch import nn

    from batchgen.engines.hf.backends.cpu import onednn as cpu_linear

    if not cpu_linear.available(torch.float32):
        pytest.skip("this torch build has no oneDNN linear reorder")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 320), nn.Linear(320, 256, bias=False), nn.Linear(256, 16))
    x = torch.randn(3, 5, 256)
    want = model(x)
    assert cpu_linear.pack_linears(model) == 2
    assert [type(m) for m in model] == [cpu_linear.PackedLinear, cpu_linear.PackedLinear, nn.Linear]
    got = model(x)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_greedy_output_is_the_same_with_prepacked_and_fused_linears(tiny_model, tokenizer, engine, monkeypatch):
    """The tiny model's weights are under MIN_FEATURES; pack (and fuse) them anyway and compare whole generations,
    through the stepper (fused GEMMs) and through the model's own forward (the generic path, on FusedSlices)."""
    from batchgen.engines.hf.backends.cpu import onednn as cpu_linear
    from batchgen.engines.hf.fusion import FusedSlice

    if not cpu_linear.available(torch.float32):
        pytest.skip("this torch build has no oneDNN linear reorder")
    assert engine.prepacked == engine.fused == 0 and "linear" not in engine.identity()
    monkeypatch.setattr(cpu_linear, "MIN_FEATURES", 1)
    packed = HFEngine(HFConfig(model=tiny_model, dtype="float32", max_batch_tokens=2048, max_batch_size=16),
                      tokenizer)
    layers = packed.model.config.num_hidden_layers
    assert packed.fused == 2 * layers and packed.prepacked == 2 * layers + 2 * layers + 1  # + o, down; + lm_head
    assert packed.identity()["linear"] == "onednn-prepacked"
    attn = packed.model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedSlice) and isinstance(attn.qkv_proj, cpu_linear.PackedLinear)
    assert sum(isinstance(m, cpu_linear.PackedLinear) for m in packed.model.modules()) == packed.prepacked
    texts = prompts_with_lengths(tokenizer, [3, 40, 7, 120, 18, 66])
    reqs = [Request(key=i, prompt_ids=tokenizer(t).input_ids, params=GREEDY, seed=None) for i, t in enumerate(texts)]
    want = [r.text for r in engine.generate(reqs)]
    assert [r.text for r in packed.generate(reqs)] == want
    packed.fast = False
    assert [r.text for r in packed.generate(reqs)] == want


def test_attention_plan_splits_off_long_rows_only_when_cheaper():
    from batchgen.engines.hf.step import AttentionPlan

    even = AttentionPlan.for_lengths([100, 101, 99, 100])
    assert even.width == 101 and even.long_rows == ()
    skewed = AttentionPlan.for_lengths([40, 900, 35, 50, 45, 38, 42, 700])
    assert skewed.width == 50 and dict(skewed.long_rows) == {1: 900, 7: 700}
    assert AttentionPlan.for_lengths([7]).width == 7


def test_decode_with_long_rows_split_off_equals_one_padded_batch(engine, monkeypatch):
    """The same decode step with the long rows computed apart, and with every row padded to the longest
    (torch's attention; batchgen's native kernel reads each row over its own length anyway)."""
    from batchgen.engines.hf import step as llama_step

    stepper = llama_step.LlamaStepper(engine.model)  # the reference: torch's attention
    torch.manual_seed(0)
    prompts = [torch.randint(3, 200, (n,)).tolist() for n in (250, 6, 9, 12, 180, 7)]
    assert llama_step.AttentionPlan.for_lengths([len(p) + 1 for p in prompts]).long_rows

    def decode_step() -> torch.Tensor:
        cache = stepper.new_cache(len(prompts), 300)
        with torch.inference_mode():
            for b, p in enumerate(prompts):
                stepper.prefill(cache, b, [p])
            return stepper.decode(cache, torch.tensor([5] * len(prompts)))

    split = decode_step()
    monkeypatch.setattr(llama_step.AttentionPlan, "for_lengths",
                        classmethod(lambda cls, lengths: cls(max(lengths), ())))
    padded = decode_step()
    assert torch.allclose(split, padded, atol=1e-4, rtol=1e-4)


def test_native_decode_attention_equals_torch_attention(engine):
    """batchgen's CPU kernel (each row over its own length) against torch's masked batched attention, on a
    decode step of rows of very different lengths."""
    from batchgen.engines.hf import step as llama_step
    from batchgen.engines.hf.backends.cpu.step import CpuStepper

    native = CpuStepper(engine.model)
    if native.native is None:
        pytest.skip("batchgen's CPU kernels are not built here (they need x86-64 with AVX2 and FMA, and a C compiler)")
    reference = llama_step.LlamaStepper(engine.model)
    torch.manual_seed(0)
    prompts = [torch.randint(3, 200, (n,)).tolist() for n in (250, 6, 9, 1, 180, 7, 33)]

    def two_steps(stepper) -> list[torch.Tensor]:
        cache = stepper.new_cache(len(prompts), 300)
        with torch.inference_mode():
            for b, p in enumerate(prompts):
                stepper.prefill(cache, b, [p])
            return [stepper.decode(cache, torch.tensor([5 + t] * len(prompts))) for t in range(2)]

    for got, want in zip(two_steps(native), two_steps(reference)):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_native_decode_step_equals_the_torch_step(tiny_model, tokenizer, monkeypatch):
    """With fused projections, a decode step runs batchgen's kernels between the GEMMs (RMSNorm, rotary embedding,
    cache write and attention, SiLU-and-multiply); its logits and cache equal those of the torch step."""
    from batchgen.engines.hf import step as llama_step
    from batchgen.engines.hf.backends.cpu import onednn as cpu_linear
    from batchgen.engines.hf.backends.cpu.step import CpuStepper

    monkeypatch.setattr(cpu_linear, "MIN_FEATURES", 1)  # the tiny model's projections fused, as a large model's are
    engine = HFEngine(HFConfig(model=tiny_model, dtype="float32", max_batch_size=16), tokenizer)
    native = CpuStepper(engine.model)
    if native.native is None:
        pytest.skip("batchgen's CPU kernels are not built here (they need x86-64 with AVX2 and FMA, and a C compiler)")
    if not native.native_step:
        pytest.skip("the projections were not fused (no oneDNN linear reorder in this torch build)")
    reference = llama_step.LlamaStepper(engine.model)  # torch's step, torch's attention
    torch.manual_seed(0)
    prompts = [torch.randint(3, 200, (n,)).tolist() for n in (250, 6, 9, 1, 180, 7, 33)]

    def steps(stepper):
        cache = stepper.new_cache(len(prompts), 300)
        with torch.inference_mode():
            for b, p in enumerate(prompts):
                stepper.prefill(cache, b, [p])
            logits = [stepper.decode(cache, torch.tensor([5 + t] * len(prompts))) for t in range(3)]
        return logits, cache

    (got, got_cache), (want, want_cache) = steps(native), steps(reference)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-4, rtol=1e-4)
    assert got_cache.host_lengths == want_cache.host_lengths
    assert torch.allclose(got_cache.k, want_cache.k, atol=1e-4)
    assert torch.allclose(got_cache.v, want_cache.v, atol=1e-4)


ISAS = cpu_kernels.supported_isas()


@pytest.fixture
def isa(request, monkeypatch):
    """Run the test with batchgen's kernels forced to one variant (BATCHGEN_CPU_ISA), loaded afresh."""
    if request.param not in ISAS:
        pytest.skip("no variant of batchgen's CPU kernels runs here (x86-64 with AVX2 and FMA)")
    monkeypatch.setenv(cpu_kernels.ISA_ENV, request.param)
    cpu_kernels.reset()
    yield request.param
    cpu_kernels.reset()


@pytest.mark.parametrize("isa", ISAS or ["none"], indirect=True)
def test_native_step_greedy_equals_one_row_generate_under_each_variant(isa, tiny_model, tokenizer, reference,
                                                                      monkeypatch):
    """float32 with batchgen's kernels between the GEMMs, forced to each variant this CPU runs: every row of a
    continuous batch equals HF generate on it alone."""
    from batchgen.engines.hf.backends.cpu import onednn as cpu_linear

    monkeypatch.setattr(cpu_linear, "MIN_FEATURES", 1)  # the tiny model's projections fused, as a large model's are
    engine = HFEngine(HFConfig(model=tiny_model, dtype="float32", max_batch_size=8), tokenizer)
    texts = prompts_with_lengths(tokenizer, [1, 7, 30, 120, 250, 15, 64, 3, 90, 44], seed=7)
    reqs = [Request(key=i, prompt_ids=tokenizer(t).input_ids, params=GREEDY, seed=None) for i, t in enumerate(texts)]
    results = engine.generate(reqs)
    stepper = engine._stepper
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: batchgen's kernels are not built")
    assert stepper.native_step and stepper.native.batchgen_isa().decode() == isa
    for req, res in zip(reqs, results):
        assert res.text == tokenizer.decode(generate_alone(reference, req.prompt_ids, 16), skip_special_tokens=True)


@pytest.mark.parametrize("isa", ISAS or ["none"], indirect=True)
def test_bf16_gemms_with_float32_kernels_between_track_the_float32_model(isa, tiny_model, tokenizer, reference,
                                                                          monkeypatch, tmp_path):
    """engine.dtype=bfloat16 on a CPU with native bf16: bf16 weights in oneDNN GEMMs, float32 norms and activations
    through batchgen's kernels, a bf16 KV cache. The first tokens' logits track the float32 model's (bf16 weights
    round each weight to 8 bits of mantissa), the model's own weights are the only copy, and a job writes every
    row."""
    from batchgen.engines.hf.backends.cpu import onednn as cpu_linear
    from batchgen.engines.hf.backends.cpu.backend import cpu_has_fast_bf16

    if not cpu_has_fast_bf16() or not cpu_linear.available(torch.bfloat16):
        pytest.skip("this CPU has no native bf16 (AVX-512 BF16 or AMX): bf16 stays torch's bf16 model")
    monkeypatch.setattr(cpu_linear, "MIN_FEATURES", 1)
    engine = HFEngine(HFConfig(model=tiny_model, dtype="bfloat16", max_batch_size=8), tokenizer)
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: batchgen's kernels are not built")
    assert engine.identity()["dtype"] == "bfloat16" and engine.identity()["activations"] == "float32"
    assert all(m.packed.dtype == torch.bfloat16 for m in engine.model.modules()
               if isinstance(m, cpu_linear.PackedLinear))
    assert engine.model.model.norm.weight.dtype == torch.float32
    texts = prompts_with_lengths(tokenizer, [5, 40, 120, 12], seed=11)
    reqs = [Request(key=i, prompt_ids=tokenizer(t).input_ids, params=GREEDY, seed=None) for i, t in enumerate(texts)]
    engine.generate(reqs)
    stepper = engine._stepper
    assert stepper.native_step and stepper.kv_dtype == torch.bfloat16 and torch.bfloat16 in stepper.gemm_inputs[0]
    cache = stepper.new_cache(len(reqs), 160)
    with torch.inference_mode():
        got = [stepper.prefill(cache, b, [r.prompt_ids]) for b, r in enumerate(reqs)]
        got.append(stepper.decode(cache, torch.tensor([7] * len(reqs))))
        want = [reference(input_ids=torch.tensor([r.prompt_ids])).logits[0, -1:] for r in reqs]
        want.append(torch.cat([reference(input_ids=torch.tensor([r.prompt_ids + [7]])).logits[0, -1:]
                               for r in reqs]))
    for g, w in zip(got, want):
        cos = torch.nn.functional.cosine_similarity(g.float(), w, dim=-1)
        assert (cos > 0.99).all(), cos
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in texts * 3])
    run_job(compose_job([*job_overrides(tiny_model, data, tmp_path / "out", "sampling.max_new_tokens=8"),
                         "engine.dtype=bfloat16"]))
    out = read_output(tmp_path / "out").to_pylist()
    assert len(out) == 12 and all(r["error"] is None and r["num_generated_tokens"] >= 1 for r in out)


def test_mixed_bf16_keeps_small_and_tied_linears_in_bf16(tiny_model):
    """Linears too small to prepack, and an LM head tied to the embeddings (many small checkpoints tie them), stay
    bf16 behind a cast; the tied weight is still one tensor; the model's own forward gives float32 logits that track
    the float32 model's."""
    from transformers import AutoModelForCausalLM

    from batchgen.engines.hf.backends.cpu import onednn as cpu_linear

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).eval()
    model.lm_head.weight = model.model.embed_tokens.weight
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    reference.lm_head.weight = reference.model.embed_tokens.weight
    cpu_linear.mixed_bf16(model)  # the tiny model's linears are all under MIN_FEATURES
    assert isinstance(model.lm_head, cpu_linear.CastLinear) and model.lm_head.linear.weight.dtype == torch.bfloat16
    assert model.lm_head.linear.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert isinstance(model.model.layers[0].mlp.down_proj, cpu_linear.CastLinear)
    assert model.model.norm.weight.dtype == torch.float32
    ids = torch.randint(10, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert got.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99
