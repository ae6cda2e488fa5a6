"""Maps a sequence's KV between a paged cache and the wire format.

On the wire a layer is token-major: [2 (K, V), num_tokens, kv_heads, head_dim], for the tokens of
a range of positions (from a ticket's start_token to the prompt's end). Each side
translates token positions to its own slots (block id * block size + offset), so the two caches
may use different block ids and different block sizes. All of a layer's blocks travel as one
message (contiguous on the wire whatever their ids). With tensor parallelism a message carries
some of a rank's KV heads (`heads`, a slice of the rank's own); None: all of them.
"""
from __future__ import annotations

import torch

from splitserve.engine.kv_cache import KVCache


def slot_index(block_ids: list[int], block_size: int, num_tokens: int, device: torch.device,
               start: int = 0) -> torch.Tensor:
    """Flat cache slots of tokens start .. num_tokens-1 held by `block_ids` (a table from token 0)."""
    if len(block_ids) * block_size < num_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    if not 0 <= start <= num_tokens:
        raise ValueError(f"start {start} is outside tokens 0 .. {num_tokens}")
    positions = torch.arange(start, num_tokens, device=device)
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)
    return blocks[positions // block_size] * block_size + positions % block_size


def pack_layer(cache: KVCache, layer: int, slots: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
    """A copy of one layer's K and V at `slots`: [2, len(slots), kv_heads, head_dim]."""
    flat = cache.data[layer].flatten(1, 2)  # [2, num_blocks * block_size, kv_heads, head_dim]
    return _heads(flat.index_select(1, slots), heads).contiguous()


def pack_all(cache: KVCache, slots: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
    """Every layer at once: [layers, 2, len(slots), kv_heads, head_dim]."""
    return _heads(cache.data.flatten(2, 3).index_select(2, slots), heads).contiguous()


def unpack_layer(cache: KVCache, layer: int, slots: torch.Tensor, wire: torch.Tensor,
                 heads: slice | None = None) -> None:
    flat = cache.data[layer].flatten(1, 2)
    if heads is None:
        flat.index_copy_(1, slots, wire.to(flat.dtype))
    else:
        flat[:, slots, heads] = wire.to(flat.dtype)


def unpack_all(cache: KVCache, slots: torch.Tensor, wire: torch.Tensor, heads: slice | None = None) -> None:
    for layer in range(wire.shape[0]):
        unpack_layer(cache, layer, slots, wire[layer], heads)


def copy_kv(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor,
            layers: slice, src_heads: slice | None = None, dst_heads: slice | None = None) -> int:
    """Same-node transfer with no wire: the KV at `src_slots` of the sender's cache data (every
    rank's cache is [layers, 2, blocks, block_size, kv_heads, head_dim]) written straight into
    `dst_slots` of the receiver's, for `layers`. Returns the bytes written."""
    payload = _heads(src[layers].flatten(2, 3).index_select(2, src_slots), src_heads)
    flat = dst[layers].flatten(2, 3)
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
