"""`kv_routes.split_ticket`: a transfer's parts between tensor-parallel workers."""
import dataclasses

import pytest

from splitserve.transfer.kv_routes import split_ticket
from splitserve.transfer.transport import TransferTicket


@pytest.mark.parametrize("prompt_tp, token_tp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_every_part_asks_for_the_positions_its_transfer_asks_for(prompt_tp, token_tp):
    whole = TransferTicket("r", 3, "p0", "t0", 40, False, "layout")
    parts = split_ticket(dataclasses.replace(whole, start_token=24), 4, prompt_tp, token_tp)
    assert len(parts) == max(prompt_tp, token_tp)
    assert {(p.start_token, p.num_sent_tokens) for p in parts} == {(24, 16)}
    assert [dataclasses.replace(p, start_token=0) for p in parts] == list(split_ticket(whole, 4, prompt_tp, token_tp))
