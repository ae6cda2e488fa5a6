"""`TransferTicket` and the sizes `KVTransport` sends and expects for a partial import (the KV of
positions start_token .. num_tokens-1 only), over the in-memory link of test_metadata_channel."""
import pytest
import torch

from splitserve.transfer.link import TransferError
from splitserve.transfer.transport import TransferTicket
from tests.transfer.test_metadata_channel import DIM, KV_HEADS, LAYERS, RecordingFabric, transport


@pytest.mark.parametrize("start", [-1, 5, 9])
def test_a_ticket_rejects_a_start_outside_the_prompt(start):
    with pytest.raises(ValueError, match=r"start_token must be in \[0, num_tokens=5\), got " + str(start)):
        TransferTicket("r", 0, "p0", "t0", 5, False, start_token=start)


def test_a_partial_transfer_announces_and_lands_only_the_positions_it_sends():
    wires: dict = {}
    prompt, token = transport(RecordingFabric("p0", wires)), transport(RecordingFabric("t0", wires))
    ticket = TransferTicket("r", 7, "p0", "t0", 10, False, "test-layout", start_token=6)
    written = {}
    token.expect(ticket, lambda layer, wire: written.setdefault(layer, wire.clone()))
    payload = torch.randn(LAYERS, 2, 4, KV_HEADS, DIM)
    prompt.push_all(ticket, payload)
    prompt.complete(ticket, first_token_id=42)
    assert [t.tolist() for t in wires[("p0", "t0")][0][2:]] == [[7, -1, 4, KV_HEADS], [7, -2, 4, 42]]
    assert token.poll(timeout=5.0) == [(ticket, 42)]
    assert all(torch.equal(written[i], payload[i]) for i in range(LAYERS))


def test_a_payload_of_the_whole_prompt_for_a_partial_ticket_fails_the_link():
    wires: dict = {}
    prompt, token = transport(RecordingFabric("p0", wires)), transport(RecordingFabric("t0", wires))
    partial = TransferTicket("r", 7, "p0", "t0", 10, True, "test-layout", start_token=6)
    token.expect(partial, lambda *_: pytest.fail("nothing may land"))
    prompt.push_layer(TransferTicket("r", 7, "p0", "t0", 10, True, "test-layout"), 0,
                      torch.zeros(2, 10, KV_HEADS, DIM))
    [(failed, error)] = token.poll(timeout=5.0)
    assert failed == partial and isinstance(error, TransferError)
    assert "announces 10 tokens" in str(error) and "expects 4 tokens (from position 6)" in str(error)
