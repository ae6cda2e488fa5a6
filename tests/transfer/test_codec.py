"""The wire format lets the two sides use different block ids and block sizes."""
import math

import pytest
import torch

from splitserve.engine.demo import demo_model_config
from splitserve.engine.kv_cache import KVCache
from splitserve.transfer.codec import (pack_all, pack_layer, slot_index, split_layers, unpack_all, unpack_layer,
                                       wire_shape)

CPU = torch.device("cpu")
CONFIG = demo_model_config()


def caches(src_block_size: int, dst_block_size: int):
    src = KVCache(CONFIG, 12, src_block_size, torch.float32, CPU)
    src.data.normal_(generator=torch.Generator().manual_seed(0))
    return src, KVCache(CONFIG, 64, dst_block_size, torch.float32, CPU)


@pytest.mark.parametrize("src_bs,dst_bs", [(16, 16), (16, 4), (4, 32)])
def test_one_shot_round_trip_across_block_sizes(src_bs, dst_bs):
    src, dst = caches(src_bs, dst_bs)
    n = 37
    src_slots = slot_index([[9, 2, 11, 0, 5, 7, 3, 1, 4, 6][: -(-n // src_bs)]], src_bs, n, CPU)
    dst_slots = slot_index([list(range(63, 63 - -(-n // dst_bs), -1))], dst_bs, n, CPU)
    wire = pack_all(src, src_slots)
    assert wire.shape == (math.prod(wire_shape(src, n, CONFIG.num_hidden_layers)),)
    assert torch.equal(wire.view(wire_shape(src, n, CONFIG.num_hidden_layers))[1], pack_layer(src, 1, src_slots))
    unpack_all(dst, dst_slots, wire)
    for layer in range(CONFIG.num_hidden_layers):
        assert torch.equal(pack_layer(dst, layer, dst_slots), pack_layer(src, layer, src_slots))


def test_layer_by_layer_writes_only_the_reserved_slots():
    src, dst = caches(16, 8)
    src_slots, dst_slots = slot_index([[3, 1]], 16, 20, CPU), slot_index([[7, 0, 5]], 8, 20, CPU)
    for layer in range(CONFIG.num_hidden_layers):
        unpack_layer(dst, layer, dst_slots, pack_layer(src, layer, src_slots))
    untouched = torch.ones(dst.data.shape[2] * dst.block_size, dtype=torch.bool)
    untouched[dst_slots[0]] = False
    assert torch.count_nonzero(dst.data.flatten(2, 3)[:, :, untouched]) == 0


def test_too_few_blocks_names_the_problem():
    with pytest.raises(ValueError, match="cannot hold 40 tokens"):
        slot_index([[0, 1]], 16, 40, CPU)


def test_whole_blocks_round_trip_between_two_caches_with_different_ids():
    src = KVCache(CONFIG, 10, 16, torch.float32, CPU)
    dst = KVCache(CONFIG, 12, 16, torch.float32, CPU)
    src.data.normal_()
    unpack_all(dst, slot_index([[0, 11, 3]], 16, 48, CPU), pack_all(src, slot_index([[7, 2, 5]], 16, 48, CPU)))
    for s, d in zip([7, 2, 5], [0, 11, 3]):
        assert torch.equal(dst.data[:, :, d], src.data[:, :, s])
    assert torch.count_nonzero(dst.data[:, :, [1, 2, 4, 5, 6, 7, 8, 9, 10]]) == 0


def test_layers_round_trip_into_another_dtype():
    src = KVCache(CONFIG, 6, 16, torch.float32, CPU)
    dst = KVCache(CONFIG, 6, 16, torch.bfloat16, CPU)
    src.data.normal_()
    src_slots, dst_slots = slot_index([[0, 3]], 16, 32, CPU), slot_index([[4, 1]], 16, 32, CPU)
    for layer in range(CONFIG.num_hidden_layers):
        unpack_layer(dst, layer, dst_slots, pack_layer(src, layer, src_slots))
    assert torch.equal(dst.data[:, :, [4, 1]], src.data[:, :, [0, 3]].to(torch.bfloat16))


def test_slots_from_a_start_position_are_the_tail_of_the_whole_prompts():
    whole = slot_index([[5, 2, 9], [1, 3, 4]], 4, 11, CPU)
    assert torch.equal(whole[1], torch.tensor([4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18]))
    for got, want in zip(slot_index([[5, 2, 9], [1, 3, 4]], 4, 11, CPU, start=6), whole):
        assert torch.equal(got, want[6:])
    ragged = slot_index([[5, 2, 9], [0, 0, 4]], 4, 11, CPU, start=(6, 9))
    assert torch.equal(ragged[0], whole[0][6:]) and torch.equal(ragged[1], torch.tensor([17, 18]))
    with pytest.raises(ValueError, match="start 12"):
        slot_index([[5, 2, 9]], 4, 11, CPU, start=12)
    with pytest.raises(ValueError, match="2 starts for 1 tables"):
        slot_index([[5, 2, 9]], 4, 11, CPU, start=(0, 1))


def test_windowed_layers_travel_shorter_in_one_shot():
    """Layer groups sending from different positions: an ALL payload is each layer at its group's
    length, one after the other, and lands every layer where it belongs."""
    from dataclasses import replace

    hybrid = replace(CONFIG, sliding_window=8, sliding_layers=(1, 3))
    src, dst = KVCache(hybrid, 8, 4, torch.float32, CPU), KVCache(hybrid, 8, 4, torch.float32, CPU)
    src.data.normal_(generator=torch.Generator().manual_seed(2))
    windowed = src.groups.group_of[1]
    starts = (0, 8) if windowed == 1 else (8, 0)
    src_slots = slot_index([[1, 2, 3], [4, 5, 6]], 4, 11, CPU, starts)
    dst_slots = slot_index([[7, 6, 5], [4, 3, 1]], 4, 11, CPU, starts)
    wire = pack_all(src, src_slots)
    layer_tokens = [len(src_slots[src.groups.group_of[layer]]) for layer in range(CONFIG.num_hidden_layers)]
    assert sorted(set(layer_tokens)) == [3, 11]
    assert wire.numel() == sum(math.prod(wire_shape(src, n)) for n in layer_tokens)
    unpack_all(dst, dst_slots, wire)
    for layer in range(CONFIG.num_hidden_layers):
        assert torch.equal(pack_layer(dst, layer, dst_slots), pack_layer(src, layer, src_slots))
    with pytest.raises(ValueError, match="not layers of"):
        split_layers(wire[1:], [wire_shape(src, n) for n in layer_tokens])


def test_layer_groups_each_read_and_write_at_their_own_slots():
    """A model with full and windowed layers (two groups, a block holding half the layers): a layer
    travels from its group's slots on one side to its group's on the other."""
    from dataclasses import replace

    hybrid = replace(CONFIG, sliding_window=8, sliding_layers=(1, 3))
    src, dst = KVCache(hybrid, 8, 4, torch.float32, CPU), KVCache(hybrid, 8, 4, torch.float32, CPU)
    assert src.groups.num_groups == 2 and src.data.shape[0] == 2
    src.data.normal_(generator=torch.Generator().manual_seed(1))
    src_slots = slot_index([[1, 2], [3, 4]], 4, 6, CPU)
    dst_slots = slot_index([[7, 6], [5, 0]], 4, 6, CPU)
    wire = pack_all(src, src_slots)
    assert wire.shape == (math.prod(wire_shape(src, 6, CONFIG.num_hidden_layers)),)
    unpack_all(dst, dst_slots, wire)
    for layer in range(CONFIG.num_hidden_layers):
        group, slot = src.groups.group_of[layer], src.groups.slot_of[layer]
        assert torch.equal(dst.data[slot].flatten(1, 2)[:, dst_slots[group]],
                           src.data[slot].flatten(1, 2)[:, src_slots[group]])
