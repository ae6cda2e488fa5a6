"""The KV transfer model: serialized below the threshold, the layer pipeline above it (across
the iterations of a prompt prefilled in chunks)."""
import dataclasses

import pytest

from splitserve.sim.transfer import KVExport, TransferModel

# 1000 bytes a token, 10 layers, 10 ms latency; the bandwidth sets how fast the link is
SLOW = TransferModel(bandwidth_bytes_per_s=1e6, latency_s=0.01, kv_bytes_per_token=1000, num_layers=10)
FAST = TransferModel(bandwidth_bytes_per_s=1e9, latency_s=0.01, kv_bytes_per_token=1000, num_layers=10)


def pipeline_visible(model: TransferModel, num_tokens: int | list[int], prefill_s: float) -> float:
    """Layer by layer, as the docstring describes it: layer i ready at d (i+1) / L, one link;
    `num_tokens`: every layer's, or each layer's."""
    layers = [num_tokens] * model.num_layers if isinstance(num_tokens, int) else num_tokens
    through = 0.0
    for i, tokens in enumerate(layers):
        ready = prefill_s * (i + 1) / model.num_layers
        through = max(ready, through) + model.link_time(tokens) / model.num_layers
    return model.latency_s + through - prefill_s


def test_small_prompt_is_serialized_whatever_the_prefill_time():
    # 100 tokens x 1000 B / 1e6 B/s = 0.1 s on the wire, plus 10 ms
    assert SLOW.serialized_time(100) == pytest.approx(0.11)
    assert SLOW.visible_time(100, prefill_s=0.0) == pytest.approx(0.11)
    assert SLOW.visible_time(100, prefill_s=5.0) == pytest.approx(0.11)


def test_threshold_picks_layerwise_from_512_tokens():
    assert not SLOW.layerwise(511)
    assert SLOW.layerwise(512)
    # 511 tokens: serialized 0.01 + 0.511; 512 tokens with a 1 s prefill: 0.01 + max(0.0512, 0.512 - 0.9)
    assert SLOW.visible_time(511, prefill_s=1.0) == pytest.approx(0.521)
    assert SLOW.visible_time(512, prefill_s=1.0) == pytest.approx(0.0612)


def test_fast_link_leaves_latency_plus_one_layer():
    # T = 1000 x 1000 / 1e9 = 1 ms, t_l = 0.1 ms; the link keeps up with a 0.5 s prefill
    assert FAST.visible_time(1000, prefill_s=0.5) == pytest.approx(0.01 + 0.0001)


def test_slow_link_leaves_serialized_minus_the_overlapped_prefill():
    # T = 1 s, d = 0.5 s: the link is the bottleneck; 0.01 + 1 - 0.5 x 9/10 = 0.56
    assert SLOW.visible_time(1000, prefill_s=0.5) == pytest.approx(0.56)
    assert SLOW.visible_time(1000, prefill_s=0.5) < SLOW.serialized_time(1000)


@pytest.mark.parametrize("num_tokens", [512, 1000, 4000])
@pytest.mark.parametrize("prefill_s", [0.0, 0.01, 0.3, 0.9, 1.0, 1.2, 8.0])
def test_closed_form_matches_the_layer_pipeline(num_tokens, prefill_s):
    for model in (SLOW, FAST):
        expected = pipeline_visible(model, num_tokens, prefill_s)
        assert model.visible_time(num_tokens, prefill_s) == pytest.approx(expected)


def test_visible_never_below_latency_plus_one_layer():
    for prefill_s in (0.0, 0.5, 100.0):
        assert SLOW.visible_time(2000, prefill_s) >= 0.01 + SLOW.link_time(2000) / 10 - 1e-12


@pytest.mark.parametrize("sent", [(1000, 200), (4000, 1024), (600, 600)])
@pytest.mark.parametrize("prefill_s", [0.0, 0.3, 1.0, 8.0])
def test_windowed_layers_pipeline_at_their_own_sizes(sent, prefill_s):
    """Layers 1, 3, .. in a windowed group sending fewer tokens than the full layers' group."""
    model = dataclasses.replace(SLOW, layer_groups=(0, 1) * 5)
    layers = [sent[group] for group in model.layer_groups]
    assert model.visible_time(sent, prefill_s) == pytest.approx(pipeline_visible(model, layers, prefill_s))
    assert model.visible_time((sent[0],) * 2, prefill_s) == model.visible_time(sent[0], prefill_s)


def test_the_layerwise_threshold_counts_a_layers_mean_tokens():
    model = dataclasses.replace(SLOW, layer_groups=(0, 1) * 5)
    # (600 + 100) / 2 = 350 tokens a layer: one message after the prefill, 350 x 1000 B / 1e6 B/s + 10 ms
    assert model.visible_time((600, 100), prefill_s=5.0) == pytest.approx(0.36)
    assert model.visible_time((924, 100), prefill_s=5.0) < 0.36  # 512 a layer: layer-wise, hidden
    with pytest.raises(ValueError, match="3 groups' tokens"):
        model.visible_time((1, 2, 3), 0.0)


@pytest.mark.parametrize("field, value", [("bandwidth_bytes_per_s", 0), ("latency_s", -0.1),
                                          ("kv_bytes_per_token", 0), ("num_layers", 0), ("num_layers", 2.5),
                                          ("layerwise_threshold", 0), ("layer_groups", (0, 1)),
                                          ("layer_groups", (0,) * 9 + (-1,))])
def test_rejects_bad_parameters(field, value):
    with pytest.raises(ValueError, match=field):
        TransferModel(**{field: value})


def pipeline_through(model: TransferModel, iterations: list[tuple[float, float, list[float]]]) -> float:
    """When the link is through with pieces that iterations (start, duration, each layer's tokens)
    computed, layer after layer, the pieces crossing one link one after another."""
    through = float("-inf")
    for start, duration, layers in iterations:
        for i, tokens in enumerate(layers):
            if tokens:
                ready = start + duration * (i + 1) / model.num_layers
                through = max(ready, through) + model.link_time(tokens) / model.num_layers
    return through


@pytest.mark.parametrize("chunk", [300, 700, 2000])
@pytest.mark.parametrize("layer_groups, starts", [((), (0,)), ((0, 1) * 5, (0, 1500))])
def test_a_prompt_prefilled_in_chunks_streams_each_chunks_pieces(chunk, layer_groups, starts):
    """A 2000-token prompt in chunks of `chunk`, each iteration chunk / 1000 s: once 512 positions
    are pending (the layer-wise threshold; chunks of 300: every other one), a piece of each layer
    (a windowed group's from position 1500 on) joins the pipeline as it is computed, so the hand-off
    leaves only what the link still owes; one chunk is `visible_time`'s whole prompt."""
    model = dataclasses.replace(SLOW, layer_groups=layer_groups)
    export = KVExport(2000, 0, starts, "p0")
    iterations, start, pushed = [], 0.0, 0
    for lo in range(0, 2000, chunk):
        hi, duration = min(lo + chunk, 2000), min(chunk, 2000 - lo) / 1000
        if hi == 2000 or hi - pushed >= 512:
            pieces = [hi - min(max(first, pushed), hi) for first in starts]
            iterations.append((start, duration, model.layer_tokens(pieces)))
            pushed = hi
        if hi < 2000:
            export.chunk_done(model, start, duration, hi)
        start += duration
    visible = export.hand_off(model, start - duration, duration)
    assert len(iterations) == {300: 4, 700: 3, 2000: 1}[chunk]
    assert visible == pytest.approx(model.latency_s + pipeline_through(model, iterations) - start)
    whole = model.visible_time(export.by_group, duration)  # every layer's whole KV behind the last chunk
    assert visible == pytest.approx(whole) if chunk == 2000 else visible < whole
