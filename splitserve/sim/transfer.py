"""How long a prompt's KV takes to reach its token worker, and how much of that the client sees.

Serialized (prompts under `layerwise_threshold`, Splitwise IV-C, Fig. 11a): the whole KV goes in
one message after the prefill, so all of it is visible:

    visible = latency + T,    T = n * kv_bytes_per_token / bandwidth

Layer-wise (Fig. 11b): the prefill of duration d computes the L layers one after another, so layer
i's KV (i = 0..L-1) is ready at d * (i + 1) / L. The layers cross one link one after another, each
taking t_l = T / L. Layer i leaves at s_i = max(ready_i, f_{i-1}) and is through at f_i = s_i + t_l,
so the last one is through at f_{L-1} = max_i (d * (i + 1) / L + (L - i) * t_l). That is linear in
i, so the maximum is at an end: i = L-1 gives d + t_l (the link keeps up: only the last layer is
left after the prefill), i = 0 gives d / L + T (the link is the bottleneck from the first layer on).
The propagation latency is paid once, by the last layer (the others' overlap the pipeline):

    visible = latency + f_{L-1} - d = latency + max(t_l, T - d * (L - 1) / L)

A link much faster than compute leaves latency + t_l; a link much slower leaves about the
serialized time minus the (L-1)/L of the prefill it overlapped. Every prompt has a link of its
own (no contention between transfers).

A model with sliding-window layers sends each KV layer group's layers from its own position on
(`BlockManager.held_from`: a windowed group only what the token worker's window reaches), so its
layers differ in size: layer i takes t_i, its share of T, and the last is through at
f_{L-1} = max_i (d * (i + 1) / L + t_i + ... + t_{L-1}), which is the formula above when they are
equal. The layer-wise threshold counts a layer's tokens on average, as the token worker does.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

LAYERWISE_THRESHOLD = 512  # the same default as splitserve.transfer.handoff


@dataclass(frozen=True)
class TransferModel:
    """Defaults: Llama2-70B (80 layers, 8 KV heads x 128, fp16: 2 * 80 * 8 * 128 * 2 bytes a token)
    between DGX-H100s over 400 Gb/s InfiniBand; the latency is Splitwise's measured ~5 ms of
    non-overlapped layer-wise transfer on H100 (Fig. 14)."""

    bandwidth_bytes_per_s: float = 50e9
    latency_s: float = 0.005
    kv_bytes_per_token: int = 327_680
    num_layers: int = 80
    layerwise_threshold: int = LAYERWISE_THRESHOLD
    layer_groups: tuple[int, ...] = ()  # per layer: its KV layer group (engine.kv_groups); (): one group

    def __post_init__(self) -> None:
        for name in ("bandwidth_bytes_per_s", "kv_bytes_per_token", "num_layers", "layerwise_threshold"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")
        if not isinstance(self.num_layers, int):
            raise ValueError(f"num_layers must be an integer, got {self.num_layers!r}")
        object.__setattr__(self, "layer_groups", tuple(self.layer_groups))
        if self.layer_groups and (len(self.layer_groups) != self.num_layers or not all(
                isinstance(g, int) and 0 <= g for g in self.layer_groups)):
            raise ValueError(f"layer_groups must name a group (an integer >= 0) for each of the {self.num_layers} "
                             f"layers, got {self.layer_groups!r}")

    def link_time(self, num_tokens: float) -> float:
        """T: the KV of `num_tokens` tokens (of every layer) on the wire, without latency."""
        return num_tokens * self.kv_bytes_per_token / self.bandwidth_bytes_per_s

    def serialized_time(self, num_tokens: int) -> float:
        return self.latency_s + self.link_time(num_tokens)

    def layerwise(self, num_tokens: float) -> bool:
        return num_tokens >= self.layerwise_threshold

    def visible_time(self, num_tokens: int | Sequence[int], prefill_s: float) -> float:
        """Seconds from the end of the prefill iteration (of `prefill_s` seconds) to the KV of a
        prompt having landed on the token worker (the module docstring); `num_tokens`: the tokens
        whose KV travels, in every layer or per layer group (without `layer_groups`, which layers
        each group holds is unknown: every layer sends the most any group sends)."""
        if isinstance(num_tokens, int):
            return self._visible(num_tokens, prefill_s)
        if not self.layer_groups or len(set(num_tokens)) == 1:
            return self._visible(max(num_tokens), prefill_s)
        if len(num_tokens) != 1 + max(self.layer_groups):
            raise ValueError(f"{len(num_tokens)} groups' tokens for layer groups {sorted(set(self.layer_groups))}")
        layers = [num_tokens[group] for group in self.layer_groups]
        mean = sum(layers) / self.num_layers
        if not self.layerwise(mean):
            return self.latency_s + self.link_time(mean)
        step, through, tail = prefill_s / self.num_layers, 0.0, 0.0
        for i in reversed(range(self.num_layers)):  # tail: layers i .. L-1 on the wire, one after another
            tail += self.link_time(layers[i]) / self.num_layers
            through = max(through, step * (i + 1) + tail)
        return self.latency_s + through - prefill_s

    def _visible(self, num_tokens: float, prefill_s: float) -> float:
        total = self.link_time(num_tokens)
        if not self.layerwise(num_tokens):
            return self.latency_s + total
        layers = self.num_layers
        return self.latency_s + max(total / layers, total - prefill_s * (layers - 1) / layers)
