"""Maps a sequence's KV between a paged cache and the wire format.

On the wire a layer is token-major: [2 (K, V), num_tokens, kv_heads, head_dim], for the tokens of
a range of positions (from a ticket's start_token to the prompt's end). Each side
translates token positions to its own slots (block id * block size + offset), so the two caches
may use different block ids and different block sizes. A cache's layer groups (`kv_groups`) each
have their block tables, so slots are per group ([groups, tokens]) and a layer is read at its
group's. All of a layer's blocks travel as one message (contiguous on the wire whatever their
ids). With tensor parallelism a message carries some of a rank's KV heads (`heads`, a slice of
the rank's own); None: all of them.
"""
from __future__ import annotations

import torch

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_groups import KVGroups


def slot_index(tables: list[list[int]], block_size: int, num_tokens: int, device: torch.device,
               start: int = 0) -> torch.Tensor:
    """[groups, num_tokens - start]: the flat cache slots of tokens start .. num_tokens-1 held by
    each group's table (from token 0)."""
    if any(len(table) * block_size < num_tokens for table in tables):
        raise ValueError(f"tables of {[len(t) for t in tables]} blocks of {block_size} cannot hold {num_tokens} tokens")
    if not 0 <= start <= num_tokens:
        raise ValueError(f"start {start} is outside tokens 0 .. {num_tokens}")
    positions = torch.arange(start, num_tokens, device=device)
    blocks = torch.tensor(tables, dtype=torch.long, device=device)
    return blocks[:, positions // block_size] * block_size + positions % block_size


def pack_layer(cache: KVCache, layer: int, slots: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
    """A copy of one layer's K and V at its group's `slots`: [2, tokens, kv_heads, head_dim]."""
    flat = cache.layer(layer).flatten(1, 2)  # [2, num_blocks * block_size, kv_heads, head_dim]
    return _heads(flat.index_select(1, slots[cache.groups.group_of[layer]]), heads).contiguous()


def pack_all(cache: KVCache, slots: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
    """Every layer: [layers, 2, tokens, kv_heads, head_dim] (one gather where one group holds them all)."""
    if cache.groups.num_groups == 1:
        return _heads(cache.data.flatten(2, 3).index_select(2, slots[0]), heads).contiguous()
    return torch.stack([pack_layer(cache, layer, slots, heads) for layer in range(cache.num_layers)])


def unpack_layer(cache: KVCache, layer: int, slots: torch.Tensor, wire: torch.Tensor,
                 heads: slice | None = None) -> None:
    flat, slots = cache.layer(layer).flatten(1, 2), slots[cache.groups.group_of[layer]]
    if heads is None:
        flat.index_copy_(1, slots, wire.to(flat.dtype))
    else:
        flat[:, slots, heads] = wire.to(flat.dtype)


def unpack_all(cache: KVCache, slots: torch.Tensor, wire: torch.Tensor, heads: slice | None = None) -> None:
    for layer in range(wire.shape[0]):
        unpack_layer(cache, layer, slots, wire[layer], heads)


def copy_kv(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor,
            layers: slice, groups: KVGroups, src_heads: slice | None = None, dst_heads: slice | None = None) -> int:
    """Same-node transfer with no wire: the KV at `src_slots` of the sender's cache data (every
    rank's cache is [group size, 2, blocks, block_size, kv_heads, head_dim], laid out by `groups`
    on both ends: the same model) written straight into `dst_slots` of the receiver's, for
    `layers`. Returns the bytes written."""
    if groups.num_groups == 1:  # slots are the layers: one copy for them all
        return _copy(src[layers], src_slots[0], dst[layers], dst_slots[0], src_heads, dst_heads)
    return sum(_copy(src[slot:slot + 1], src_slots[group], dst[slot:slot + 1], dst_slots[group], src_heads, dst_heads)
               for slot, group in list(zip(groups.slot_of, groups.group_of))[layers])


def _copy(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor,
          src_heads: slice | None, dst_heads: slice | None) -> int:
    payload = _heads(src.flatten(2, 3).index_select(2, src_slots), src_heads)
    flat = dst.flatten(2, 3)
    payload = payload.to(flat.device, flat.dtype)  # another GPU of the node: a peer-to-peer copy
    if dst_heads is None:
        flat.index_copy_(2, dst_slots, payload)
    else:
        flat[:, :, dst_slots, dst_heads] = payload
    return payload.nbytes


def wire_shape(cache: KVCache, num_tokens: int, layers: int | None = None, heads: int | None = None) -> tuple[int, ...]:
    _, _, _, _, kv_heads, head_dim = cache.data.shape
    layer_shape = (2, num_tokens, kv_heads if heads is None else heads, head_dim)
    return layer_shape if layers is None else (layers, *layer_shape)


def _heads(wire: torch.Tensor, heads: slice | None) -> torch.Tensor:
    return wire if heads is None else wire[..., heads, :]
