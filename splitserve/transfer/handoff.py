"""Engine glue for disaggregation: the prompt worker exports (`exporter.py`), the token worker
imports (`importer.py`); here, what both use: the KV layout two workers must share, a rank's
transport, a ticket's parts.

Prompt worker (`KVExporter`, an engine in any role; requests added through it are handed off): while
a prompt's prefill runs, each layer's KV is packed and pushed as soon as that layer has written it
(the push is asynchronous, so layer i + 1 computes while layer i travels); a prompt prefilled in
chunks pushes its new positions of every layer as its steps compute them, a piece a layer, so little
remains at the hand-off; prompts under the threshold go in one push after the prefill. Then the
first token is pushed and the prompt engine frees the request: the pushed KV is a copy, so the
blocks are free at once. The next step does not wait for those pushes to leave: a peer that stops
reading fails its link after the transport's timeout. Once the first token is handed off, the token
side decides the transfer (the caller hears of the request from there): it lands when every message
was read, even if the sender gave the link up meanwhile, and fails when the link breaks first.

Token worker (`KVImporter`): reserves blocks before the prefill starts and issues the ticket the
prompt worker pushes against; layers land straight in those blocks; the request joins the
decode batch when the completion (first token) arrives. A failed or cancelled transfer frees the
reserved blocks (a direct transfer's once its sender has stopped writing into them: see
transport). With `reuse_prefix` the reservation goes through the token worker's prefix cache:
the cached full blocks of the prompt's prefix (an earlier turn of the conversation, say) are
shared, and the ticket's `start_token` asks for the KV of the positions after them only; the
prompt worker packs and pushes just those. A windowed layer group's KV travels from the first
block its window reaches on (the ticket's `group_starts`); the layer-wise threshold counts the
tokens a layer sends, on average over the layers.

Tensor parallelism: a transfer travels as parts, one per (prompt rank, token rank) route
(`kv_routes`); each rank pushes or lands its own KV heads (`RankKV`). Rank 0 runs everything
here and sends the other ranks commands with its engine's rounds (`rank_commands`, run there by
`FollowerKV`); their reports come back with the round. An import completes when every part has
landed and fails when one fails (the others are abandoned). The exporter's stats time rank 0's pushes.

Leases: no KV is stranded. A reservation that has not completed `lease_s` after it was made
(prompt worker stalled or dead, ingress gone before the prefill was asked for) is abandoned and
its blocks freed; a prefill not handed off `lease_s` after it was added is aborted on the prompt
side and cancelled towards the token side. Each side enforces its own lease, so neither depends
on the other being alive.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from splitserve.transfer.codec import wire_shape
from splitserve.transfer.link import Fabric
from splitserve.transfer.transport import KVTransport, TransferTicket

LAYERWISE_THRESHOLD = 512  # tokens whose KV travels; below it one transfer after the prefill (Splitwise IV-C)
WIRE_VERSION = 3  # of the messages' format (2: windowed groups send only what they reach; 3: layers in pieces)


def kv_layout(engine) -> str:
    """What must match for one engine's KV to be another's: the wire format's version, the model
    (name and a hash of its config, and the weights' seed where they are dummy), the KV dtype
    (fp8_e4m3 for an FP8 cache) and the per-token layout of the whole model. Not the block size
    (the wire is token-major, so the two caches may page differently), nor the TP size (parts
    carry each rank its own heads).
    `engine`: an LLMEngine or a TPFollower."""
    config, model = engine.config, engine.model_config
    identity = json.dumps([engine.model_name, dataclasses.asdict(model), config.load_format,
                           config.seed if config.load_format == "dummy" else None], sort_keys=True, default=str)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return (f"wire={WIRE_VERSION} model={engine.model_name} config={digest} dtype={engine.kv_cache.encoding} "
            f"layers={model.num_hidden_layers} kv_heads={model.num_key_value_heads} head_dim={model.head_dim}")


def make_transport(engine, fabric: Fabric, timeout: float = 60.0) -> KVTransport:
    """A rank's transport (`engine`: an LLMEngine or a TPFollower)."""
    cache = engine.kv_cache
    return KVTransport(fabric, lambda n, heads: wire_shape(cache, n, heads=heads), cache.num_layers,
                       cache.data.dtype, cache.data.device, timeout, kv_layout(engine), engine.max_model_len,
                       cache.data.shape[-2], cache.groups.group_of)


def parts_of(ticket: TransferTicket) -> tuple[TransferTicket, ...]:
    """A ticket made without parts (by hand, in tests) is its own one part."""
    return ticket.parts or (ticket,)
