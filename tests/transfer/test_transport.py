"""`TransferTicket` and the sizes `KVTransport` sends and expects for a partial import (the KV of
positions start_token .. num_tokens-1 only), over the in-memory link of test_metadata_channel."""
import dataclasses
import time

import pytest
import torch

from splitserve.transfer.link import TransferError
from splitserve.transfer.protocol import ProtocolError
from splitserve.transfer.transport import TransferTicket
from tests.transfer.test_metadata_channel import DIM, KV_HEADS, LAYERS, RecordingFabric, transport


@pytest.mark.parametrize("start", [-1, 5, 9])
def test_a_ticket_rejects_a_start_outside_the_prompt(start):
    with pytest.raises(ValueError, match=r"start_token must be in \[0, num_tokens=5\), got " + str(start)):
        TransferTicket("r", 0, "p0", "t0", 5, False, start_token=start)


@pytest.mark.parametrize("starts", [(1, 3), (2, 5), (2, 3.0)])
def test_a_ticket_rejects_group_starts_outside_what_it_sends(starts):
    with pytest.raises(ValueError, match=r"group_starts must be in \[start_token=2, num_tokens=5\)"):
        TransferTicket("r", 0, "p0", "t0", 5, False, start_token=2, group_starts=starts)


def test_windowed_groups_send_each_layer_from_its_own_start():
    """Layer 1's group sends from position 7 (a window's reach), layer 0's from start_token: each
    message announces its layer's tokens (ALL: their sum), and every layer lands at its length."""
    wires: dict = {}
    prompt, token = (transport(RecordingFabric(name, wires), layer_groups=(0, 1)) for name in ("p0", "t0"))
    layerwise = TransferTicket("a", 1, "p0", "t0", 10, True, "test-layout", 2, group_starts=(2, 7))
    one_shot = dataclasses.replace(layerwise, request_id="b", tag=2, layerwise=False)
    written: dict = {}
    for ticket in (layerwise, one_shot):
        token.expect(ticket, lambda layer, wire, _, r=ticket.request_id: written.setdefault((r, layer), wire.clone()))
    layers = [torch.randn(2, 8, KV_HEADS, DIM), torch.randn(2, 3, KV_HEADS, DIM)]
    for layer, payload in enumerate(layers):
        prompt.push_layer(layerwise, layer, payload)
    prompt.push_all(one_shot, torch.cat([payload.view(-1) for payload in layers]), KV_HEADS)
    for ticket in (layerwise, one_shot):
        prompt.complete(ticket, first_token_id=5)
    headers = [t.tolist() for t in wires[("p0", "t0")][0][2:]]
    assert headers[:3] == [[1, 0, 8, KV_HEADS], [1, 1, 3, KV_HEADS], [2, -1, 11, KV_HEADS]]
    landed, deadline = [], time.monotonic() + 5.0
    while len(landed) < 2 and time.monotonic() < deadline:  # a poll returns what has finished so far
        landed += token.poll(timeout=1.0)
    assert sorted(landed, key=lambda r: r[0].tag) == [(layerwise, 5), (one_shot, 5)]
    assert all(torch.equal(written[r, layer], layers[layer]) for r in "ab" for layer in range(LAYERS))


def test_a_windowed_layer_sent_whole_fails_the_link():
    wires: dict = {}
    prompt, token = (transport(RecordingFabric(name, wires), layer_groups=(0, 1)) for name in ("p0", "t0"))
    ticket = TransferTicket("r", 7, "p0", "t0", 10, True, "test-layout", group_starts=(0, 7))
    token.expect(ticket, lambda *_: None)
    prompt.push_layer(dataclasses.replace(ticket, group_starts=()), 1, torch.zeros(2, 10, KV_HEADS, DIM))
    [(failed, error)] = token.poll(timeout=5.0)
    assert failed == ticket and "announces 10 tokens" in str(error) and "has 3 tokens of the layer left" in str(error)


def test_a_ticket_naming_other_layer_groups_is_refused_before_any_work():
    prompt = transport(RecordingFabric("p0", {}), layer_groups=(0, 1))
    with pytest.raises(ProtocolError, match="names 3 KV layer groups' starts; this worker's KV has 2 groups"):
        prompt.check_compatible(TransferTicket("r", 7, "p0", "t0", 10, True, "test-layout", group_starts=(0, 7, 7)))


def test_a_partial_transfer_announces_and_lands_only_the_positions_it_sends():
    wires: dict = {}
    prompt, token = transport(RecordingFabric("p0", wires)), transport(RecordingFabric("t0", wires))
    ticket = TransferTicket("r", 7, "p0", "t0", 10, False, "test-layout", start_token=6)
    written = {}
    token.expect(ticket, lambda layer, wire, _: written.setdefault(layer, wire.clone()))
    payload = torch.randn(LAYERS, 2, 4, KV_HEADS, DIM)
    prompt.push_all(ticket, payload, KV_HEADS)
    prompt.complete(ticket, first_token_id=42)  # ALL announces every layer's tokens
    assert [t.tolist() for t in wires[("p0", "t0")][0][2:]] == [[7, -1, 4 * LAYERS, KV_HEADS], [7, -2, 4, 42]]
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
    assert "announces 10 tokens" in str(error) and "has 4 tokens of the layer left (from position 6)" in str(error)
