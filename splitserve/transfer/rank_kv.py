"""One rank's end of KV transfers: it packs and pushes the KV heads of the parts it sends, or writes
them into the receiver's cache when the part is direct, and lands the parts it receives in its
own heads. Parts come from `kv_routes.split_ticket`; a worker of one rank sends and receives one
part per transfer, with all its heads."""
from __future__ import annotations

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.model.sharding import kv_head_range
from splitserve.transfer.codec import Slots, count_heads, pack_all, pack_layer, unpack_layer
from splitserve.transfer.protocol import Span
from splitserve.transfer.transport import ALL, CacheDest, KVTransport, TransferTicket


class RankKV:
    def __init__(self, transport: KVTransport, cache: KVCache, num_kv_heads: int):
        self.transport, self.cache = transport, cache
        self._own = kv_head_range(num_kv_heads, cache.shard.rank, cache.shard.size)

    def heads(self, part: TransferTicket) -> slice | None:
        """The part's KV heads among this rank's own; None: all of them."""
        if part.heads is None or part.heads == self._own:
            return None
        return slice(part.heads[0] - self._own[0], part.heads[1] - self._own[0])

    # ---- sending --------------------------------------------------------------------------
    def push_layer(self, part: TransferTicket, layer: int, slots: Slots, span: Span) -> int:
        """Pushes the layer's piece `span`, held at `slots` (nothing where its group has none of
        it); returns the bytes pushed."""
        if span.tokens(self.cache.groups.group_of[layer]) <= 0:
            return 0
        if part.dest is not None:
            return self.transport.write_kv(part, layer, self.cache, slots, self.heads(part), span)
        payload = pack_layer(self.cache, layer, slots, self.heads(part))
        self.transport.push_layer(part, layer, payload)
        return payload.nbytes

    def push_all(self, part: TransferTicket, slots: Slots) -> int:
        heads = self.heads(part)
        if part.dest is not None:
            return self.transport.write_kv(part, ALL, self.cache, slots, heads)
        payload = pack_all(self.cache, slots, heads)
        self.transport.push_all(part, payload, count_heads(self.cache.data.shape[-2], heads))
        return payload.nbytes

    # ---- receiving ------------------------------------------------------------------------
    def expect(self, part: TransferTicket, host_slots: Slots, tables: list[list[int]]) -> TransferTicket:
        """Returns the part stamped with its link's epoch (what the prompt side pushes against),
        and with its destination when the prompt rank writes into this cache itself; `host_slots`
        (on the CPU) where it lands, `tables` the reservation's block tables (a layer group's each)."""
        heads = self.heads(part)
        slots = self.transport.device_slots(host_slots)
        dest = CacheDest(tuple(map(tuple, tables)), None if heads is None else (heads.start, heads.stop))
        return self.transport.expect(
            part, lambda layer, wire, offset: unpack_layer(self.cache, layer, slots, wire, heads, offset), dest)
