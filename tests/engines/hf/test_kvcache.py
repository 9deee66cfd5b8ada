"""SlotKVCache: what is written is what is read back, per slot and position; appends land at each slot's own
length; a move copies one sequence (all layers, valid positions, length) and nothing else; reads are views."""

from __future__ import annotations

import torch

from batchgen.engines.hf.kvcache import SlotKVCache

LAYERS, SLOTS, HEADS, MAX_LEN, DIM = 3, 5, 2, 8, 4


def new_cache() -> SlotKVCache:
    return SlotKVCache(layers=LAYERS, slots=SLOTS, kv_heads=HEADS, max_len=MAX_LEN, head_dim=DIM,
                       dtype=torch.float32, device=torch.device("cpu"))


def kv(n: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, t, DIM, generator=g), torch.randn(n, HEADS, t, DIM, generator=g)


def filled_cache() -> tuple[SlotKVCache, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Slots [0, 4) prefilled in two buckets (lengths 5, 5, 3, 3); per layer, the K and V written."""
    cache, written = new_cache(), {}
    for layer in range(LAYERS):
        k1, v1 = kv(2, 5, seed=10 + layer)
        k2, v2 = kv(2, 3, seed=20 + layer)
        cache.write_prefill(layer, 0, k1, v1)
        cache.write_prefill(layer, 2, k2, v2)
        written[layer] = (k1, v1, k2, v2)
    cache.set_lengths(0, [5, 5])
    cache.set_lengths(2, [3, 3])
    return cache, written


def test_a_new_cache_is_zero_with_the_declared_shape():
    cache = new_cache()
    assert cache.k.shape == cache.v.shape == (LAYERS, SLOTS, HEADS, MAX_LEN, DIM)
    assert cache.k.dtype == torch.float32 and not cache.k.any() and not cache.v.any()
    assert cache.lengths.tolist() == [0] * SLOTS and cache.host_lengths == [0] * SLOTS
    assert cache.slots == SLOTS and cache.max_len == MAX_LEN


def test_prefill_then_view_reads_back_exactly_what_was_written():
    cache, written = filled_cache()
    assert cache.lengths.tolist() == [5, 5, 3, 3, 0] and cache.host_lengths == [5, 5, 3, 3, 0]
    for layer, (k1, v1, k2, v2) in written.items():
        k, v = cache.view(layer, 2, 5)
        assert k.shape == v.shape == (2, HEADS, 5, DIM)
        assert torch.equal(k, k1) and torch.equal(v, v1)
        k, v = cache.view(layer, 4, 3)
        assert torch.equal(k[2:], k2) and torch.equal(v[2:], v2)
        assert torch.equal(k[:2], k1[:, :, :3]) and torch.equal(v[:2], v1[:, :, :3])
        # nothing beyond what was written: the second bucket's tail positions and the unused slot stay zero
        assert not cache.k[layer, 2:4, :, 3:].any() and not cache.k[layer, 4].any() and not cache.v[layer, 4].any()


def test_prefill_into_one_layer_leaves_the_other_layers_alone():
    cache = new_cache()
    k, v = kv(3, 4, seed=1)
    cache.write_prefill(1, 1, k, v)
    assert torch.equal(cache.k[1, 1:4, :, :4], k) and torch.equal(cache.v[1, 1:4, :, :4], v)
    assert not cache.k[0].any() and not cache.k[2].any() and not cache.v[0].any() and not cache.v[2].any()
    assert not cache.k[1, 0].any() and not cache.k[1, 4].any()


def test_append_writes_each_slot_at_its_own_length_and_advance_moves_both_length_copies():
    cache, written = filled_cache()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    for layer in range(LAYERS):
        k, v = kv(4, 1, seed=30 + layer)
        cache.append(layer, k, v)
        for slot, position in enumerate([5, 5, 3, 3]):
            assert torch.equal(cache.k[layer, slot, :, position], k[slot, :, 0])
            assert torch.equal(cache.v[layer, slot, :, position], v[slot, :, 0])
    changed = (cache.k != before_k).any(dim=(2, 4))  # [layers, slots, positions]
    expected = torch.zeros(LAYERS, SLOTS, MAX_LEN, dtype=torch.bool)
    expected[:, [0, 1, 2, 3], [5, 5, 3, 3]] = True
    assert torch.equal(changed, expected)
    assert torch.equal((cache.v != before_v).any(dim=(2, 4)), expected)
    assert cache.lengths.tolist() == [5, 5, 3, 3, 0]  # appending does not count the token: advance does
    cache.advance(4)
    assert cache.lengths.tolist() == [6, 6, 4, 4, 0] and cache.host_lengths == [6, 6, 4, 4, 0]


def test_advance_only_touches_the_first_n_slots_and_the_next_append_goes_one_further():
    cache, _ = filled_cache()
    cache.advance(1)
    assert cache.lengths.tolist() == [6, 5, 3, 3, 0] and cache.host_lengths == [6, 5, 3, 3, 0]
    k, v = kv(2, 1, seed=2)
    cache.append(0, k, v)
    assert torch.equal(cache.k[0, 0, :, 6], k[0, :, 0]) and torch.equal(cache.k[0, 1, :, 5], k[1, :, 0])
    assert torch.equal(cache.v[0, 0, :, 6], v[0, :, 0]) and torch.equal(cache.v[0, 1, :, 5], v[1, :, 0])
    assert cache.host_lengths == cache.lengths.tolist()


def test_move_copies_the_valid_positions_of_every_layer_and_the_length_only():
    cache, _ = filled_cache()
    cache.advance(4)  # lengths 6, 6, 4, 4: slot 0's position 5 holds zeros, slot 2 and 3 positions 3 too
    for layer in range(LAYERS):
        k, v = kv(4, 1, seed=40 + layer)
        cache.append(layer, k, v)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.move(3, 0)  # a shorter sequence (4 tokens) into a longer one's slot (6 tokens)
    assert torch.equal(cache.k[:, 0, :, :4], before_k[:, 3, :, :4])
    assert torch.equal(cache.v[:, 0, :, :4], before_v[:, 3, :, :4])
    # positions past the source's length are not copied (they keep the old occupant's values)
    assert torch.equal(cache.k[:, 0, :, 4:], before_k[:, 0, :, 4:])
    assert torch.equal(cache.v[:, 0, :, 4:], before_v[:, 0, :, 4:])
    assert not torch.equal(before_k[:, 0, :, :4], before_k[:, 3, :, :4])  # the move did change something
    for slot in (1, 2, 3, 4):  # the source included: a move copies, it does not clear
        assert torch.equal(cache.k[:, slot], before_k[:, slot]) and torch.equal(cache.v[:, slot], before_v[:, slot])
    assert cache.lengths.tolist() == [4, 6, 4, 4, 0] and cache.host_lengths == [4, 6, 4, 4, 0]


def test_move_of_a_longer_sequence_copies_all_of_its_positions():
    cache, written = filled_cache()
    cache.move(0, 3)
    for layer, (k1, v1, _, _) in written.items():
        assert torch.equal(cache.k[layer, 3, :, :5], k1[0]) and torch.equal(cache.v[layer, 3, :, :5], v1[0])
    assert cache.lengths[3].item() == 5 and cache.host_lengths[3] == 5


def test_view_and_view_row_share_the_cache_storage():
    cache, _ = filled_cache()
    k, v = cache.view(1, 3, 4)
    assert k.untyped_storage().data_ptr() == cache.k.untyped_storage().data_ptr()
    assert v.untyped_storage().data_ptr() == cache.v.untyped_storage().data_ptr()
    k[2, 1, 3, 0] = 123.0
    v[0, 0, 0, 2] = -7.0
    assert cache.k[1, 2, 1, 3, 0].item() == 123.0 and cache.v[1, 0, 0, 0, 2].item() == -7.0
    kr, vr = cache.view_row(2, 3, 5)
    assert kr.shape == vr.shape == (1, HEADS, 5, DIM)
    assert torch.equal(kr[0], cache.k[2, 3, :, :5]) and torch.equal(vr[0], cache.v[2, 3, :, :5])
    kr[0, 1, 4, 3] = 55.0
    vr[0, 0, 1, 1] = 66.0
    assert cache.k[2, 3, 1, 4, 3].item() == 55.0 and cache.v[2, 3, 0, 1, 1].item() == 66.0
    assert kr.untyped_storage().data_ptr() == cache.k.untyped_storage().data_ptr()


def test_a_write_to_the_cache_shows_in_a_view_taken_before_it():
    cache, _ = filled_cache()
    k, v = cache.view(0, 4, 6)
    kn, vn = kv(4, 1, seed=3)
    cache.append(0, kn, vn)  # at positions 5, 5, 3, 3
    for slot, position in enumerate([5, 5, 3, 3]):
        assert torch.equal(k[slot, :, position], kn[slot, :, 0]) and torch.equal(v[slot, :, position], vn[slot, :, 0])
