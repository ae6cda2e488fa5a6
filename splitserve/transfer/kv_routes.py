"""Which rank sends which KV heads to which rank, for a prompt worker of TP p and a token worker of TP t.

Each token rank receives exactly the KV heads it holds (`kv_head_range`), each head from one
prompt rank that holds it; nothing is gathered on one rank. Where the prompt side replicates a
head (fewer KV heads than prompt ranks), token rank j takes it from the (j mod holders)-th holder,
spreading the sends. Token rank 0's first head always comes from prompt rank 0, so the part
(0 -> 0) exists for every pair of TP sizes: it carries the first token.

A transfer is one `TransferTicket` whose `parts` are the per-route tickets the ranks push and
receive; a part's tag is the transfer's tag * MAX_RANKS + its prompt rank, unique on its token rank.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from splitserve.engine.model.sharding import MAX_RANKS, kv_head_range
from splitserve.transfer.transport import TransferTicket


@dataclass(frozen=True)
class Route:
    prompt_rank: int
    token_rank: int
    heads: tuple[int, int]  # global KV heads [lo, hi)


def rank_peer(worker_id: str, rank: int) -> str:
    """The transport id of a worker's rank (rank 0 is the worker itself)."""
    return worker_id if rank == 0 else f"{worker_id}/tp{rank}"


def worker_of(peer: str) -> str:
    """The worker a rank's transport id (`rank_peer`) belongs to."""
    worker_id, tp, rank = peer.rpartition("/tp")
    return worker_id if tp and rank.isdigit() else peer


def rank_peers(worker_ids) -> frozenset[str]:
    """The transport ids of every rank these workers may have."""
    return frozenset(rank_peer(worker_id, rank) for worker_id in worker_ids for rank in range(MAX_RANKS))


def holders(head: int, num_kv_heads: int, size: int) -> list[int]:
    """The ranks of a TP-`size` worker that hold KV head `head`."""
    ranges = (kv_head_range(num_kv_heads, rank, size) for rank in range(size))
    return [rank for rank, (lo, hi) in enumerate(ranges) if lo <= head < hi]


def kv_routes(num_kv_heads: int, prompt_tp: int, token_tp: int) -> list[Route]:
    routes = []
    for j in range(token_tp):
        head, hi = kv_head_range(num_kv_heads, j, token_tp)
        while head < hi:
            choices = holders(head, num_kv_heads, prompt_tp)
            i = choices[j % len(choices)]
            end = min(hi, kv_head_range(num_kv_heads, i, prompt_tp)[1])
            routes.append(Route(i, j, (head, end)))
            head = end
    return routes


def split_ticket(ticket: TransferTicket, num_kv_heads: int, prompt_tp: int,
                 token_tp: int) -> tuple[TransferTicket, ...]:
    """The transfer's parts, one per route (unstamped: each token rank stamps its own link epoch)."""
    if max(prompt_tp, token_tp) > MAX_RANKS:
        raise ValueError(f"at most {MAX_RANKS} ranks per worker")
    return tuple(dataclasses.replace(ticket, tag=ticket.tag * MAX_RANKS + r.prompt_rank,
                                     prompt_peer=rank_peer(ticket.prompt_peer, r.prompt_rank),
                                     token_peer=rank_peer(ticket.token_peer, r.token_rank),
                                     prompt_rank=r.prompt_rank, token_rank=r.token_rank, heads=r.heads, parts=())
                 for r in kv_routes(num_kv_heads, prompt_tp, token_tp))
