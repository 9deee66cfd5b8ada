"""The one draw (engines/hf/sampling/draw.py), on CPU tensors: no op syncs the host (the syncguard, itself tested
here, so a CUDA step can run it); a seeded row draws the same token alone, among others in another slot and after a
resume; draws follow the filtered, renormalised softmax (within 4 sigma over 20,000 (seed, step) pairs); greedy rows
take argmax's first index; logprobs are log_softmax's and topk's."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Optional

import pytest
import torch

from batchgen.engines.hf.sampling.draw import RowParams, as_int64, gumbel, hash_bits, logprobs, pick, sample
from batchgen.sampling import SampleParams
from tests.engines.hf.backends.cuda.syncguard import no_host_sync

CPU = torch.device("cpu")
PROBS = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01])  # sorted; spread over the vocab by PERM
PERM = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])  # token PERM[i] has probability PROBS[i]
DRAWS = 20_000


def sp(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SampleParams:
    return SampleParams(max_new_tokens=64, temperature=temperature, top_p=top_p, top_k=top_k, stop=(),
                        ignore_eos=False)


def table(rows: list[tuple[SampleParams, Optional[int], float]]) -> RowParams:
    """RowParams with row i = (params, seed, min_p)."""
    return RowParams.of_rows([replace(p, min_p=min_p) for p, _, min_p in rows], [seed for _, seed, _ in rows], CPU)


def step_logits(seed: int, vocab: int = 100) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


# the guard


def test_the_guard_catches_item_and_boolean_masks_and_host_reads():
    x, repeats = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([1, 2])
    for bad in (lambda: x[0].item(), lambda: x[x > 0], lambda: x.tolist(), lambda: bool(x[0] > 0),
                lambda: torch.nonzero(x), lambda: torch.unique(x), lambda: x.masked_select(x > 0),
                lambda: torch.repeat_interleave(repeats), lambda: x.__setitem__(x > 0, 0.0),
                lambda: torch.multinomial(x.abs(), 1)):
        with pytest.raises(AssertionError), no_host_sync():
            bad()


def test_the_guard_lets_fixed_shape_ops_through():
    x, index, repeats = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0, 2]), torch.tensor([1, 2])
    with no_host_sync():
        y = x.masked_fill(x > 0, 0.0) + torch.where(x > 0, x, -x)
        y[index] = 1.0  # integer indices: a fixed shape
        torch.repeat_interleave(repeats, output_size=3)
        torch.sort(x, stable=True)
    assert y.tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(AssertionError, match="_local_scalar_dense"), no_host_sync():
        x.sum().item()


def test_pick_and_logprobs_run_under_the_guard():
    rows = [(sp(0.0), None, 0.0), (sp(0.7, 5, 0.9), 3, 0.0), (sp(1.0), 4, 0.1), (sp(1.3, 0, 0.5), 5, 0.0)]
    params, logits = table(rows), torch.randn(4, 300)
    steps = torch.tensor([0, 7, 2, 3])
    with no_host_sync():
        tokens = pick(logits, params, steps)
        drawn = sample(logits, params, steps)
        logprobs(logits, tokens, 5)
    assert torch.equal(torch.where(params.greedy, logits.argmax(dim=-1), drawn), tokens)


# repeatability


ROW = (sp(0.9, 40, 0.95), 987654321987654321, 0.02)  # the row followed; its logits at step s are step_logits(s)
OTHERS = [(sp(0.0), None, 0.0), (sp(1.5), 11, 0.0), (sp(0.6, 3), 12, 0.0), (sp(1.0, 0, 0.3), 13, 0.1)]


def alone(steps: range) -> list[int]:
    params = table([ROW])
    return [int(pick(step_logits(s)[None], params, torch.tensor([s]))[0]) for s in steps]


def among_others(steps: range, slot: int) -> list[int]:
    """The row at `slot` of a batch of 5, the other rows with their own params, logits and steps."""
    params = table(OTHERS[:slot] + [ROW] + OTHERS[slot:])
    tokens = []
    for s in steps:
        logits = torch.stack([step_logits(1000 * r + s) for r in range(5)])
        logits[slot] = step_logits(s)
        own = torch.tensor([3 * s + r for r in range(5)])
        own[slot] = s
        tokens.append(int(pick(logits, params, own)[slot]))
    return tokens


def test_a_seeded_row_draws_the_same_tokens_alone_in_any_slot_and_after_a_resume():
    steps = range(60)
    reference = alone(steps)
    assert len(set(reference)) > 10  # it samples (the step moves the noise), not a fixed token
    assert among_others(steps, slot=3) == reference
    assert among_others(steps, slot=0) == reference
    assert among_others(range(25, 60), slot=1) == reference[25:]  # resumed: fresh params, the same seed and steps


def test_a_small_draw_runs_on_one_thread_with_the_same_tokens_and_leaves_the_thread_count_as_it_was():
    """A draw of up to draw.ONE_THREAD_VALUES values runs torch's ops on one thread (a second thread's wake-up costs
    more than its share of such short passes), a larger one on the threads it was given; the tokens are those of a
    draw on any thread count, and torch's thread count is as it was after each."""
    from batchgen.engines.hf.sampling import draw

    seen: list[int] = []

    def halves(key1: torch.Tensor, key2: torch.Tensor, vocab: int) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return draw.halves_of_keys(key1, key2, vocab)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows, vocab, threads in ((8, 32000, 1), (2, draw.ONE_THREAD_VALUES // 2 + 1, 2)):
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
            params = table([(sp(0.8, top_p=0.95), 100 + i, 0.0) for i in range(rows)])
            steps = torch.arange(rows) * 7
            tokens = sample(logits, params, steps, draw.DrawOps(halves=halves))
            assert seen.pop() == threads and torch.get_num_threads() == 2
            torch.set_num_threads(1)
            assert torch.equal(tokens, sample(logits, params, steps))
            torch.set_num_threads(2)
    finally:
        torch.set_num_threads(before)


def test_the_noise_depends_on_seed_and_step_only():
    seeds = torch.tensor([as_int64(2**64 - 5), 0, 7, 7, 2**62])
    steps = torch.tensor([3, 3, 0, 1, 2**40])
    bits = hash_bits(seeds, steps, 50)
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**32
    for r in range(5):
        assert torch.equal(hash_bits(seeds[r:r + 1], steps[r:r + 1], 50)[0], bits[r])
    assert not torch.equal(bits[2], bits[3])
    noise = gumbel(seeds, steps, 50)
    assert bool(torch.isfinite(noise).all())


# distribution


def draw(params: SampleParams, min_p: float = 0.0, logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DRAWS tokens from one distribution, a row per (seed, step) pair: 200 seeds by 100 steps. Counts per token."""
    logits = torch.log(PROBS[torch.argsort(PERM)]) if logits is None else logits
    rows = table([(params, 1, min_p)] * DRAWS)
    rows.seed[:] = torch.arange(DRAWS) % 200 * 7919 + 1
    steps = torch.arange(DRAWS) // 200
    tokens = pick(logits.expand(DRAWS, -1), rows, steps)
    return torch.bincount(tokens, minlength=logits.shape[-1])


def assert_follows(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Each token's frequency within 4 sigma of its probability; tokens of probability 0 never drawn."""
    expected = expected / expected.sum()
    for token, (c, q) in enumerate(zip(counts.tolist(), expected.tolist())):
        sigma = math.sqrt(q * (1 - q) / DRAWS)
        assert abs(c / DRAWS - q) <= 4 * sigma, (token, c / DRAWS, q, counts.tolist())


def by_token(probs: torch.Tensor) -> torch.Tensor:
    """Probabilities listed by rank (as PROBS) placed at their tokens."""
    return torch.zeros(8).scatter(0, PERM, probs)


def test_draws_follow_the_softmax():
    assert_follows(draw(sp(1.0)), by_token(PROBS))


def test_temperature_sharpens_the_distribution():
    assert_follows(draw(sp(0.5)), by_token(PROBS ** 2))


def test_top_k_keeps_the_k_likeliest_renormalised():
    counts = draw(sp(1.0, top_k=3))
    assert int(counts[PERM[3:]].sum()) == 0
    assert_follows(counts, by_token(torch.cat([PROBS[:3], torch.zeros(5)])))
    assert_follows(draw(sp(1.0, top_k=8)), by_token(PROBS))  # k = V, and past it: all kept
    assert_follows(draw(sp(1.0, top_k=50)), by_token(PROBS))


def test_top_k_keeps_every_token_tied_at_the_kth_value():
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0, 1.0, 1.0, -3.0, 0.5])
    counts = draw(sp(1.0, top_k=2), logits=logits)  # the 2nd largest, 1.0, is tied three ways: 4 tokens stay
    assert_follows(counts, torch.tensor([0, math.e ** 2, math.e, 0, math.e, math.e, 0, 0]))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    assert_follows(draw(sp(1.0, top_p=1e-6)), by_token(torch.tensor([1.0] + [0.0] * 7)))  # tiny: argmax only
    assert_follows(draw(sp(1.0, top_p=1.0)), by_token(PROBS))  # 1: off
    # 0.3 + 0.2 = 0.5 < 0.6, 0.3 + 0.2 + 0.15 = 0.65 reaches it: three tokens stay
    assert_follows(draw(sp(1.0, top_p=0.6)), by_token(torch.cat([PROBS[:3], torch.zeros(5)])))


def test_min_p_drops_tokens_below_a_fraction_of_the_largest():
    assert_follows(draw(sp(1.0), min_p=1.0), by_token(torch.tensor([1.0] + [0.0] * 7)))
    assert_follows(draw(sp(1.0), min_p=0.3), by_token(torch.cat([PROBS[:5], torch.zeros(3)])))  # >= 0.09 stay
    assert_follows(draw(sp(1.0), min_p=0.0), by_token(PROBS))


def test_filters_compose_after_temperature():
    # temperature 0.5 -> q ~ p^2 = .09 .04 .0225 .0144 .01 ...; top-k 4 keeps four; min-p 0.2 keeps q >= .018
    expected = torch.cat([PROBS[:3] ** 2, torch.zeros(5)])
    assert_follows(draw(sp(0.5, top_k=4), min_p=0.2), by_token(expected))


# greedy and logprobs


def test_greedy_rows_take_the_first_index_of_the_largest_logit():
    logits = torch.randint(0, 3, (40, 16), generator=torch.Generator().manual_seed(0)).float()  # ties everywhere
    rows = [(sp(0.0), None, 0.0) if r % 3 else (sp(1.0, 2), r + 1, 0.0) for r in range(40)]
    tokens = pick(logits, table(rows), torch.zeros(40, dtype=torch.int64))
    for r in range(1, 40):
        if r % 3:
            assert int(tokens[r]) == int(torch.argmax(logits[r])) == logits[r].tolist().index(float(logits[r].max()))


def test_logprobs_are_the_raw_log_softmax_and_its_top_k():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tokens = torch.tensor([0, 49, 7, 7, 13, 21])
    picked, values, indices = logprobs(logits, tokens, 4)
    logp = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(picked, logp[torch.arange(6), tokens])
    top = torch.topk(logp, 4, dim=-1)
    assert torch.equal(values, top.values) and torch.equal(indices, top.indices)
    assert logprobs(logits, tokens, 0)[1].shape == (6, 0)


# one draw on every platform


def test_a_seeded_row_draws_the_same_through_the_cpu_path_and_the_cuda_platforms_draw(tiny_model, tokenizer):
    """The CPU platform's engine (its stepper and its draw ops) and the CUDA platform's stepper and draw run on CPU
    tensors: the same tokens for every seeded row, in batches of 1, 7 and 64 (sampled with and without filters, and
    greedy), each platform filling its slots its own way (16 and 5 slots); row 0 the same in each batch."""
    from transformers import AutoModelForCausalLM

    from batchgen.engines.hf.backends.cuda.backend import CudaBackend
    from batchgen.engines.hf.backends.cuda.step import CudaStepper
    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.hf.engine import HFEngine
    from batchgen.engines.hf.sampling.sampler import Sampler, eos_ids
    from batchgen.engines.hf.scheduler import Scheduler
    from batchgen.records import Request

    kinds = [sp(0.9, 40, 0.9), sp(0.0), sp(1.2), sp(0.7, 0, 0.8), replace(sp(1.0), min_p=0.05)]
    reqs = [Request(key=i, prompt_ids=tokenizer(f"the river {'town ' * (i % 9)}").input_ids,
                    params=replace(kinds[i % 5], max_new_tokens=6 + i % 7), seed=1000 + i) for i in range(64)]
    cpu = HFEngine(HFConfig(model=tiny_model, dtype="float32", max_batch_size=16), tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    sampler = Sampler(tokenizer, eos_ids(model, tokenizer), CPU, ops=CudaBackend().draw_ops())
    firsts = set()
    for batch in (1, 7, 64):
        with torch.inference_mode():
            cuda = Scheduler(sampler, CudaStepper(model), max_batch_tokens=4096, max_batch_size=5).run(reqs[:batch],
                                                                                                       None)
        got = {r.key: r.text for r in cpu.generate(reqs[:batch])}
        assert {r.key: r.text for r in cuda} == got, batch
        firsts.add(got[0])
    greedy = cpu.generate([replace(reqs[0], params=replace(reqs[0].params, temperature=0.0))])[0].text
    assert len(firsts) == 1 and greedy not in firsts  # row 0 samples, the same in every batch


def test_a_seeded_job_resumed_in_other_batches_gives_the_same_rows_and_an_output_of_another_draw_is_refused(
        tiny_model, tmp_path):
    """A sampled job (sampling.n=2, seeded) half written with one row a batch, then finished with 16 a batch: the
    rows of one uninterrupted run with 3 a batch. Its manifest records the draw (a greedy job's does not), and an
    output recorded without it (started by a batchgen whose CPU draw was a generator per row) is refused."""
    from batchgen.errors import ResumeMismatchError
    from batchgen.output.manifest import MANIFEST, config_hash, output_config
    from batchgen.run.runner import run_job
    from tests.conftest import compose_job, job_overrides, read_output, write_jsonl

    data = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "the river " * (1 + i % 5)}
                                               for i in range(8)])

    def run(out: str, *extra: str):
        return run_job(compose_job(job_overrides(tiny_model, data, tmp_path / out, "dataset.id_column=id",
                                                 "sampling=sample", "sampling.n=2", "sampling.max_new_tokens=8",
                                                 "sampling.seed=5", "run.rows_per_part=4", *extra)))

    def rows(out: str) -> list[tuple]:
        return sorted((r["id"], r["sample_index"], r["generation"]) for r in read_output(tmp_path / out).to_pylist())

    assert run("whole", "engine.max_batch_size=3").state == "done"
    halves = ("run.num_shards=2", "run.shard=0", "engine.max_batch_size=1"), ("run.num_shards=2", "run.shard=1")
    assert run("resumed", *halves[0]).state == "partial"
    assert run("resumed", *halves[1], "engine.max_batch_size=16").state == "done"
    assert rows("resumed") == rows("whole") and len({g for *_, g in rows("whole")}) > 8
    manifest = json.loads((tmp_path / "whole" / MANIFEST).read_text())
    assert manifest["output_config"]["engine"]["draw"] == "counter-hash"
    greedy = compose_job(job_overrides(tiny_model, data, tmp_path / "g", "sampling.max_new_tokens=8"))
    assert "draw" not in output_config(greedy)["engine"] and config_hash(greedy)
    del manifest["output_config"]["engine"]["draw"]
    (tmp_path / "whole" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ResumeMismatchError, match=r"output_config.engine.draw: was None, now 'counter-hash'"):
        run("whole", "engine.max_batch_size=3")
