"""The device sampler (backends/cuda/sampling.py) on CPU tensors: no op syncs the host (the syncguard, itself tested
here); a seeded row draws the same token alone, among others in another slot, after a move and after a resume;
draws follow the filtered, renormalised softmax (within 4 sigma over 20,000 (seed, step) pairs); greedy rows take
argmax's first index; logprobs are log_softmax's and topk's."""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from batchgen.engines.hf.backends.cuda.sampling import SlotParams, as_int64, gumbel, hash_bits, logprobs, pick
from batchgen.sampling import SampleParams
from tests.engines.hf.backends.cuda.syncguard import no_host_sync

CPU = torch.device("cpu")
PROBS = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01])  # sorted; spread over the vocab by PERM
PERM = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])  # token PERM[i] has probability PROBS[i]
DRAWS = 20_000


def sp(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SampleParams:
    return SampleParams(max_new_tokens=64, temperature=temperature, top_p=top_p, top_k=top_k, stop=(),
                        ignore_eos=False)


def table(rows: list[tuple[SampleParams, Optional[int], float]]) -> SlotParams:
    """SlotParams with row i = (params, seed, min_p) in slot i."""
    params = SlotParams(len(rows) + 2, CPU)  # spare slots, as a real table has
    for slot, (p, seed, min_p) in enumerate(rows):
        params.set(slot, p, seed, min_p=min_p)
    return params


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
    steps, out = torch.tensor([0, 7, 2, 3]), torch.empty(4, dtype=torch.int64)
    with no_host_sync():
        tokens = pick(logits, params, 4, steps)
        pick(logits, params, 4, steps, out=out)
        pick(logits, params, 4, steps, filtered=False)
        pick(logits, params, 4, steps, sampled=False)
        logprobs(logits, tokens, 5)
    assert torch.equal(out, tokens)


# repeatability


ROW = (sp(0.9, 40, 0.95), 987654321987654321, 0.02)  # the row followed; its logits at step s are step_logits(s)
OTHERS = [(sp(0.0), None, 0.0), (sp(1.5), 11, 0.0), (sp(0.6, 3), 12, 0.0), (sp(1.0, 0, 0.3), 13, 0.1)]


def alone(steps: range) -> list[int]:
    params = table([ROW])
    return [int(pick(step_logits(s)[None], params, 1, torch.tensor([s]))[0]) for s in steps]


def among_others(steps: range, slot: int, params: Optional[SlotParams] = None) -> list[int]:
    """The row at `slot` of a batch of 5, the other rows with their own params, logits and steps."""
    params = params or table(OTHERS[:slot] + [ROW] + OTHERS[slot:])
    tokens = []
    for s in steps:
        logits = torch.stack([step_logits(1000 * r + s) for r in range(5)])
        logits[slot] = step_logits(s)
        own = torch.tensor([3 * s + r for r in range(5)])
        own[slot] = s
        tokens.append(int(pick(logits, params, 5, own)[slot]))
    return tokens


def test_a_seeded_row_draws_the_same_tokens_alone_in_any_slot_and_after_a_resume():
    steps = range(60)
    reference = alone(steps)
    assert len(set(reference)) > 10  # it samples (the step moves the noise), not a fixed token
    assert among_others(steps, slot=3) == reference
    assert among_others(steps, slot=0) == reference
    assert among_others(range(25, 60), slot=1) == reference[25:]  # resumed: fresh params, the same seed and steps


def test_a_moved_row_draws_as_before():
    params = table(OTHERS + [ROW])  # the row in slot 4
    params.move(4, 2)  # slot 2's row finished: the last live row takes it
    assert among_others(range(30), slot=2, params=params) == alone(range(30))
    assert params.mode(5) == (True, True)


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
    slots = SlotParams(DRAWS, CPU)
    slots.set(0, params, 1, min_p=min_p)
    for t in slots.tensors():
        t[:] = t[0].clone()
    slots.seed[:] = torch.arange(DRAWS) % 200 * 7919 + 1
    steps = torch.arange(DRAWS) // 200
    tokens = pick(logits.expand(DRAWS, -1), slots, DRAWS, steps)
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
    tokens = pick(logits, table(rows), 40, torch.zeros(40, dtype=torch.int64))
    for r in range(1, 40):
        if r % 3:
            assert int(tokens[r]) == int(torch.argmax(logits[r])) == logits[r].tolist().index(float(logits[r].max()))


def test_out_is_written_in_place():
    params, logits = table([(sp(0.0), None, 0.0), (sp(1.0), 5, 0.0)]), torch.randn(2, 30)
    out = torch.full((2,), -1, dtype=torch.int64)
    got = pick(logits, params, 2, torch.tensor([4, 4]), out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, pick(logits, params, 2, torch.tensor([4, 4])))


def test_logprobs_are_the_raw_log_softmax_and_its_top_k():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tokens = torch.tensor([0, 49, 7, 7, 13, 21])
    picked, values, indices = logprobs(logits, tokens, 4)
    logp = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(picked, logp[torch.arange(6), tokens])
    top = torch.topk(logp, 4, dim=-1)
    assert torch.equal(values, top.values) and torch.equal(indices, top.indices)
    assert logprobs(logits, tokens, 0)[1].shape == (6, 0)
