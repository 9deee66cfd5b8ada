"""The CUDA backend's decode step (backends/cuda/step.py), checked on CPU tensors: its static-shape body equals the
reference stepper (float32 logits within 1e-4, greedy picks the logits' argmax) with live rows fewer than the bucket,
runs without a host sync or a value-dependent shape (syncguard.py beside this file), gives the same twice from the
same buffers, and generates through the scheduler what the reference generates. On CUDA (the `gpu` tests) the captured
graphs give what the eager body gives."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchgen.engines.hf.backends.cuda.step import CudaStepper, masked_attention
from batchgen.engines.hf.fusion import concatenate_linears, fuse_projections
from batchgen.engines.hf.step import LlamaStepper
from tests.engines.hf.backends.cuda.syncguard import no_host_sync

PROMPT_LENGTHS = (40, 3, 17, 1, 29)  # 5 live rows: bucket 8 of a 6-slot cache is 6 rows, one padding row


@pytest.fixture(scope="module", params=[False, True], ids=["separate", "fused"])
def model(request, tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    if request.param:
        assert fuse_projections(model, concatenate_linears) == 2 * model.config.num_hidden_layers
    return model


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 200, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def decode_steps(stepper: LlamaStepper, steps: int = 4) -> tuple[list[torch.Tensor], list]:
    """Prefill the prompts one per slot of a 6-slot cache, then `steps` decode steps: the logits and picks."""
    cache = stepper.new_cache(6, 64)
    logits, picks = [], []
    with torch.inference_mode():
        for slot, p in enumerate(prompts()):
            stepper.prefill(cache, slot, [p])
        for t in range(steps):
            got, pick = stepper.decode_picks(cache, torch.tensor([7 + t + r for r in range(len(PROMPT_LENGTHS))]))
            logits.append(got.clone())
            picks.append(None if pick is None else pick.clone())
    assert cache.host_lengths[:5] == [n + steps for n in PROMPT_LENGTHS] and cache.lengths[:5].tolist() == \
        cache.host_lengths[:5]
    return logits, picks


def test_the_static_decode_step_equals_the_reference_steps(model):
    want, _ = decode_steps(LlamaStepper(model))
    stepper = CudaStepper(model)
    got, picks = decode_steps(stepper)
    assert stepper.graphs == "off" and sorted(stepper.buckets) == [6]  # 5 rows: bucket 8, capped at the 6 slots
    for g, w, p in zip(got, want, picks):
        assert g.shape == w.shape and torch.allclose(g, w.float(), atol=1e-4, rtol=1e-4)
        assert torch.equal(p, g.argmax(dim=-1))


def test_the_step_body_makes_no_host_sync_and_repeats_from_the_same_buffers(model):
    stepper = CudaStepper(model)
    cache = stepper.new_cache(6, 64)
    with torch.no_grad():  # not inference_mode: the guard's dispatch mode sees no op on inference tensors
        for slot, p in enumerate(prompts()):
            stepper.prefill(cache, slot, [p])
        bucket = stepper._bucket(cache, 5)
        bucket.tokens.copy_(torch.tensor([5, 6, 7, 8, 9, 10]))
        with no_host_sync():
            stepper.step(cache, bucket)
        first = bucket.logits.clone()
        stepper.step(cache, bucket)  # the same inputs, the same cache positions written again
    assert torch.equal(first, bucket.logits)


def test_the_guard_sees_the_reference_steps_host_work(model):
    """The guard is not blind: the reference step plans attention from host lengths and tensors built from lists."""
    stepper = LlamaStepper(model)
    cache = stepper.new_cache(2, 32)
    with torch.no_grad():
        stepper.prefill(cache, 0, [[5, 6, 7], [8, 9]])
        with pytest.raises(AssertionError, match="from a Python list"):
            with no_host_sync():
                stepper.decode_picks(cache, torch.tensor([4, 4]))


def test_masked_attention_reads_each_row_over_its_own_length():
    from batchgen.engines.hf.backends.cuda.attention import decode_attention_reference

    torch.manual_seed(0)
    q = torch.randn(3, 4, 16)
    k, v = torch.randn(5, 2, 40, 16), torch.randn(5, 2, 40, 16)
    lengths = torch.tensor([1, 40, 17])
    want = decode_attention_reference(q, k, v, lengths, 0.25)
    assert torch.allclose(masked_attention(q, k, v, lengths, 0.25), want, atol=1e-5)


def test_generation_through_the_scheduler_equals_the_reference(model, tiny_model):
    """Rows joining and leaving a 4-slot cache (buckets of 2 and 4 rows in turn): the same greedy tokens."""
    from transformers import AutoTokenizer

    from batchgen.engines.hf.sampling.sampler import Sampler, eos_ids
    from batchgen.engines.hf.scheduler import Scheduler
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    params = [SampleParams(max_new_tokens=cap, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=True)
              for cap in (9, 3, 14, 6, 11, 2, 8)]
    reqs = [Request(key=i, prompt_ids=p, params=params[i], seed=None) for i, p in enumerate(prompts() + prompts()[:2])]
    sampler = Sampler(tokenizer, eos_ids(model, tokenizer), torch.device("cpu"))

    def run(stepper: LlamaStepper) -> list[str]:
        with torch.inference_mode():
            results = Scheduler(sampler, stepper, max_batch_tokens=4096, max_batch_size=4).run(reqs, None)
        return [r.text for r in results]

    stepper = CudaStepper(model)
    assert run(stepper) == run(LlamaStepper(model))
    assert {2, 4} <= set(stepper.buckets)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_give_what_the_eager_step_gives(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).to("cuda").eval()
    fuse_projections(model, concatenate_linears)
    graphed, eager = CudaStepper(model, graphs="on"), CudaStepper(model, graphs="off")
    (got, got_picks), (want, want_picks) = decode_steps(graphed), decode_steps(eager)
    assert all(b.graph is not None for b in graphed.buckets.values())
    for g, w, gp, wp in zip(got, want, got_picks, want_picks):
        assert torch.equal(g, w) and torch.equal(gp, wp)
    memory = torch.cuda.memory_allocated()
    decode_steps(graphed)  # replays allocate nothing new beyond the new cache
    assert torch.cuda.memory_allocated() <= memory + 2 * graphed.cache.k.numel() * graphed.cache.k.element_size()


def test_device_sampled_rows_draw_the_same_alone_in_any_batch_and_after_a_resume(tiny_model):
    """Sampling as on every device (draw.py: each row's noise from its seed and step) with the CUDA platform's draw
    ops: a seeded row's tokens are the same generated alone, beside other rows in another slot, and again from a
    fresh scheduler."""
    from transformers import AutoTokenizer

    from batchgen.engines.hf.backends.cuda.backend import CudaBackend
    from batchgen.engines.hf.sampling.sampler import Sampler, eos_ids
    from batchgen.engines.hf.scheduler import Scheduler
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    sampled = SampleParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=40, stop=(), ignore_eos=True)
    greedy = SampleParams(max_new_tokens=7, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=True)
    rows = prompts()
    target = Request(key="t", prompt_ids=rows[2], params=sampled, seed=1234)
    others = [Request(key=i, prompt_ids=p, params=sampled if i % 2 else greedy, seed=77 + i)
              for i, p in enumerate(rows)]

    def run(reqs: list[Request], slots: int) -> dict:
        sampler = Sampler(tokenizer, eos_ids(model, tokenizer), torch.device("cpu"), ops=CudaBackend().draw_ops())
        assert sampler.start(target).seed == 1234  # no generator state: the seed and the step draw
        with torch.no_grad():
            results = Scheduler(sampler, CudaStepper(model), max_batch_tokens=4096, max_batch_size=slots).run(reqs,
                                                                                                              None)
        return {r.key: r.text for r in results}

    alone = run([target], 1)["t"]
    assert run([*others[:3], target, *others[3:]], 4)["t"] == alone  # another slot, rows leaving around it
    assert run([*others, target], 2)["t"] == alone  # admitted last, into a recycled slot
    assert run([target], 1)["t"] == alone  # a resume: a fresh sampler and scheduler
    twins = run([Request(f"u{s}", rows[2], sampled, seed=s) for s in (1, 2)], 2)  # the seed is what draws
    assert twins["u1"] != twins["u2"]


def test_the_kv_budget_is_the_jobs_share_less_what_is_held_and_the_activation_reserve():
    from types import SimpleNamespace

    from batchgen.engines.hf.backends.cuda.backend import activation_reserve, kv_budget

    gb = 10 ** 9
    assert kv_budget(total=80 * gb, free=77 * gb, utilization=0.9, reserve=5 * gb) == 64 * gb  # 72 - 3 held - 5
    assert kv_budget(total=80 * gb, free=10 * gb, utilization=0.9, reserve=5 * gb) == 0  # another process holds it
    llama_1b = SimpleNamespace(hidden_size=2048, intermediate_size=8192, vocab_size=128256)
    reserve = activation_reserve(llama_1b, max_batch_tokens=65536, max_slots=1024, element=2)
    assert reserve == 65536 * (6 * 2048 + 3 * 8192) * 2 + 3 * 1024 * 128256 * 4  # 4.8 GB + 1.6 GB


def test_the_summary_says_the_kv_cache_the_hf_engine_sized(tiny_model, tmp_path):
    from batchgen.run.runner import run_job
    from tests.conftest import compose_job, job_overrides, write_jsonl

    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "the river " * (i + 1)} for i in range(6)])
    summary = run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "out", "dataset.id_column=id",
                                                "engine.max_batch_size=4", "sampling.max_new_tokens=4")))
    assert summary.kv_cache.startswith("4 slots x 64 positions") and "KV cache: 4 slots" in summary.render()


KERNEL_STEP = """
import sys, torch
from transformers import AutoModelForCausalLM
from batchgen.engines.hf.backends.cuda import attention
from batchgen.engines.hf.backends.cuda.step import CudaStepper
from batchgen.engines.hf.fusion import concatenate_linears, fuse_projections
from batchgen.engines.hf.step import LlamaStepper
from tests.engines.hf.backends.cuda.test_cuda_step import decode_steps

assert attention.interpreted()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
fuse_projections(model, concatenate_linears)
stepper = CudaStepper(model)
assert stepper.kernel and "Triton" in stepper.describe()
(got, picks), (want, _) = decode_steps(stepper, steps=2), decode_steps(LlamaStepper(model), steps=2)
print(max((g - w).abs().max().item() for g, w in zip(got, want)))
"""


def test_the_static_step_with_the_triton_kernel_equals_the_reference_under_the_interpreter(tiny_model):
    """The step as it runs on CUDA, its attention the Triton kernel on the cache's per-layer views (TRITON_INTERPRET=1
    runs it on CPU tensors, in a subprocess: the variable is read when the kernels are defined)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", KERNEL_STEP, tiny_model], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) < 1e-4
