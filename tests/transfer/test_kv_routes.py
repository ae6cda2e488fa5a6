"""`kv_routes.split_ticket`: a transfer's parts between tensor-parallel workers; a rank's
transport id and back."""
import dataclasses

import pytest

from splitserve.transfer.kv_routes import rank_peer, split_ticket, worker_of
from splitserve.transfer.transport import TransferTicket


@pytest.mark.parametrize("prompt_tp, token_tp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_every_part_asks_for_the_positions_its_transfer_asks_for(prompt_tp, token_tp):
    whole = TransferTicket("r", 3, "p0", "t0", 40, False, "layout")
    parts = split_ticket(dataclasses.replace(whole, start_token=24), 4, prompt_tp, token_tp)
    assert len(parts) == max(prompt_tp, token_tp)
    assert {(p.start_token, p.num_sent_tokens) for p in parts} == {(24, 16)}
    assert [dataclasses.replace(p, start_token=0) for p in parts] == list(split_ticket(whole, 4, prompt_tp, token_tp))


@pytest.mark.parametrize("worker_id", ["t0", "app-token-3.12", "odd/tpx", "app/tp-token-0.1"])
def test_a_ranks_transport_id_names_its_worker(worker_id):
    assert [worker_of(rank_peer(worker_id, rank)) for rank in range(4)] == [worker_id] * 4
