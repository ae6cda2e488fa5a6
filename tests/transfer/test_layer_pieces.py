"""A layer-wise transfer of a prompt prefilled in chunks sends each layer in pieces, in position
order (`protocol.Span`): the token side lands each where the layer's last one ended, refuses a
piece past the layer's end or a whole ALL after pieces, and completes a transfer only once every
layer has all its positions. Over the in-memory link of test_metadata_channel."""
import random
import time

import torch

from splitserve.transfer.link import TransferError
from splitserve.transfer.protocol import ProtocolError
from splitserve.transfer.transport import TransferTicket
from tests.transfer.test_metadata_channel import DIM, KV_HEADS, LAYERS, RecordingFabric, transport


def pair(layer_groups: tuple[int, ...] = ()):
    wires: dict = {}
    return (*(transport(RecordingFabric(name, wires), layer_groups) for name in ("p0", "t0")), wires)


def land(token, count: int = 1) -> list:
    landed, deadline = [], time.monotonic() + 5.0
    while len(landed) < count and time.monotonic() < deadline:
        landed += token.poll(timeout=1.0)
    return landed


def test_random_pieces_of_each_layer_land_as_the_whole_layer_would():
    """Random cuts of each group's positions (a windowed group from position 9), sent as one
    message a piece: every layer lands equal to its whole KV, each header announcing its piece."""
    rng = random.Random(0)
    prompt, token, wires = pair(layer_groups=(0, 1))
    for tag in range(20):
        num_tokens = rng.randrange(12, 40)
        starts = (rng.randrange(0, 6), rng.randrange(6, num_tokens))
        ticket = TransferTicket(f"r{tag}", tag, "p0", "t0", num_tokens, True, "test-layout", starts[0],
                                group_starts=starts)
        cache = {}
        token.expect(ticket, lambda layer, wire, offset: cache.setdefault(layer, []).append((offset, wire.clone())))
        layers = [torch.randn(2, num_tokens - starts[layer], KV_HEADS, DIM) for layer in range(LAYERS)]
        sent = []
        for layer, whole in enumerate(layers):
            cuts = sorted(rng.sample(range(1, whole.shape[1]), min(3, whole.shape[1] - 1)))
            for lo, hi in zip([0, *cuts], [*cuts, whole.shape[1]]):
                prompt.push_layer(ticket, layer, whole[:, lo:hi])
                sent.append([tag, layer, hi - lo, KV_HEADS])
        prompt.complete(ticket, first_token_id=tag)
        assert land(token) == [(ticket, tag)]
        headers = [t.tolist() for t in wires[("p0", "t0")][0][2:] if t[0] == tag]  # after HELLO
        assert headers[:-1] == sent
        for layer, whole in enumerate(layers):
            offsets = [offset for offset, _ in cache[layer]]
            assert offsets == [0] + [sum(w.shape[1] for _, w in cache[layer][:i]) for i in range(1, len(offsets))]
            assert torch.equal(torch.cat([w for _, w in cache[layer]], dim=1), whole)


def test_a_piece_past_the_layers_end_fails_the_link_before_anything_lands():
    prompt, token, _ = pair()
    ticket = TransferTicket("r", 3, "p0", "t0", 10, True, "test-layout", start_token=2)
    landed = []
    token.expect(ticket, lambda layer, wire, offset: landed.append((layer, offset)))
    prompt.push_layer(ticket, 0, torch.zeros(2, 5, KV_HEADS, DIM))
    prompt.push_layer(ticket, 0, torch.zeros(2, 4, KV_HEADS, DIM))  # 3 positions left of layer 0
    [(failed, error)] = land(token)
    assert failed == ticket and isinstance(error, ProtocolError) and landed == [(0, 0)]
    assert "announces 4 tokens" in str(error) and "has 3 tokens of the layer left (from position 7)" in str(error)


def test_a_whole_all_message_after_pieces_fails_the_link():
    prompt, token, _ = pair()
    ticket = TransferTicket("r", 3, "p0", "t0", 6, True, "test-layout")
    token.expect(ticket, lambda *_: None)
    prompt.push_layer(ticket, 1, torch.zeros(2, 2, KV_HEADS, DIM))
    prompt.push_all(ticket, torch.zeros(LAYERS, 2, 6, KV_HEADS, DIM), KV_HEADS)
    [(failed, error)] = land(token)
    assert failed == ticket and "expects every layer whole" in str(error)


def test_a_transfer_completed_before_every_layer_landed_fails_alone():
    """DONE with layer 1 short by its last piece: that transfer fails (its KV would decode from a
    hole), the link stays, and the next transfer on it completes."""
    prompt, token, _ = pair()
    short = TransferTicket("short", 1, "p0", "t0", 8, True, "test-layout")
    token.expect(short, lambda *_: None)
    prompt.push_layer(short, 0, torch.zeros(2, 8, KV_HEADS, DIM))
    prompt.push_layer(short, 1, torch.zeros(2, 5, KV_HEADS, DIM))
    prompt.complete(short, first_token_id=3)
    [(failed, error)] = land(token)
    assert failed == short and isinstance(error, ProtocolError) and isinstance(error, TransferError)
    assert "1 layers' KV incomplete (layer 1 landed up to position 5 of 8)" in str(error)
    whole = TransferTicket("whole", 2, "p0", "t0", 8, True, "test-layout")
    token.expect(whole, lambda *_: None)
    for layer in range(LAYERS):
        prompt.push_layer(whole, layer, torch.zeros(2, 8, KV_HEADS, DIM))
    prompt.complete(whole, first_token_id=4)
    assert land(token) == [(whole, 4)]
