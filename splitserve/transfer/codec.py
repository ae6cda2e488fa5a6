"""Maps a sequence's KV between a paged cache and the wire format.

On the wire a layer is token-major: [2 (K, V), num_tokens, kv_heads, head_dim], for the tokens of
a range of positions (from a ticket's start_token to the prompt's end, or a piece of that range:
`protocol.Span`). Each side translates token positions to its own slots (block id * block size +
offset), so the two caches may use different block ids and different block sizes. A cache's
layer groups (`kv_groups`) each have their block tables, so slots are per group (`Slots`) and a
layer is read at its group's; a windowed group's may start later (a ticket's `group_starts`: the
positions its first decode reaches: `BlockManager.held_from`), so its layers are shorter on the
wire. A layer's (or piece's) blocks travel as one message (contiguous on the wire whatever their
ids); a one-shot (ALL) message is every layer's, one after the other, flat. With tensor
parallelism a message carries some of a rank's KV heads (`heads`, a slice of the rank's own);
None: all of them.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_groups import KVGroups

Slots = tuple[torch.Tensor, ...]  # per layer group: the flat cache slots of the positions it sends


def slot_index(tables: list[list[int]], block_size: int, num_tokens: int, device: torch.device,
               start: int | Sequence[int] = 0) -> Slots:
    """Per group: the flat cache slots of tokens start .. num_tokens-1 held by its table (from
    token 0); `start` is every group's, or each group's."""
    starts = [start] * len(tables) if isinstance(start, int) else list(start)
    if len(starts) != len(tables):
        raise ValueError(f"{len(starts)} starts for {len(tables)} tables")
    if any(len(table) * block_size < num_tokens for table in tables):
        raise ValueError(f"tables of {[len(t) for t in tables]} blocks of {block_size} cannot hold {num_tokens} tokens")
    if not all(0 <= s <= num_tokens for s in starts):
        raise ValueError(f"start {start} is outside tokens 0 .. {num_tokens}")
    slots = []
    for table, first in zip(tables, starts):
        positions = torch.arange(first, num_tokens, device=device)
        blocks = torch.tensor(table, dtype=torch.long, device=device)
        slots.append(blocks[positions // block_size] * block_size + positions % block_size)
    return tuple(slots)


def as_lists(slots: Slots) -> list[list[int]]:
    """`slots` as they travel to another rank (`rank_commands`)."""
    return [group.tolist() for group in slots]


def pack_layer(cache: KVCache, layer: int, slots: Slots, heads: slice | None = None) -> torch.Tensor:
    """A copy of one layer's K and V at its group's `slots`: [2, tokens, kv_heads, head_dim]."""
    flat = cache.layer(layer).flatten(1, 2)  # [2, num_blocks * block_size, kv_heads, head_dim]
    return _heads(flat.index_select(1, slots[cache.groups.group_of[layer]]), heads).contiguous()


def pack_all(cache: KVCache, slots: Slots, heads: slice | None = None) -> torch.Tensor:
    """Every layer's `pack_layer`, one after the other, flat (one gather where one group holds them all)."""
    if cache.groups.num_groups == 1:
        return _heads(cache.data.flatten(2, 3).index_select(2, slots[0]), heads).contiguous().view(-1)
    return torch.cat([pack_layer(cache, layer, slots, heads).view(-1) for layer in range(cache.num_layers)])


def unpack_layer(cache: KVCache, layer: int, slots: Slots, wire: torch.Tensor,
                 heads: slice | None = None, offset: int = 0) -> None:
    """Lands a layer's KV, or a piece of it: at its group's slots from `offset` on."""
    flat = cache.layer(layer).flatten(1, 2)
    slots = slots[cache.groups.group_of[layer]][offset:offset + wire.shape[1]]
    if heads is None:
        flat.index_copy_(1, slots, wire.to(flat.dtype))
    else:
        flat[:, slots, heads] = wire.to(flat.dtype)


def unpack_all(cache: KVCache, slots: Slots, wire: torch.Tensor, heads: slice | None = None) -> None:
    """Lands a `pack_all` payload."""
    num_heads = count_heads(cache.data.shape[-2], heads)
    shapes = [wire_shape(cache, len(slots[group]), heads=num_heads) for group in cache.groups.group_of]
    for layer, payload in enumerate(split_layers(wire.view(-1), shapes)):
        unpack_layer(cache, layer, slots, payload, heads)


def split_layers(wire: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """A flat ALL payload as its layers' views, of `shapes`."""
    sizes = [math.prod(shape) for shape in shapes]
    if sum(sizes) != wire.numel():
        raise ValueError(f"an ALL payload of {wire.numel()} elements is not layers of {list(shapes)}")
    return [piece.view(shape) for piece, shape in zip(wire.split(sizes), shapes)]


def copy_kv(src: torch.Tensor, src_slots: Slots, dst: torch.Tensor, dst_slots: Slots,
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


def count_heads(kv_heads: int, heads: slice | None) -> int:
    """The KV heads `heads` selects of a rank's `kv_heads`."""
    return kv_heads if heads is None else len(range(kv_heads)[heads])


def _heads(wire: torch.Tensor, heads: slice | None) -> torch.Tensor:
    return wire if heads is None else wire[..., heads, :]
