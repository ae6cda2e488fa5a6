"""How long a prompt's KV takes to reach its token worker, and how much of that the client sees (in
the gap between its first token, the prompt worker's, and its second, the token worker's).

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

A prompt prefilled in chunks (`prompt_chunk_tokens`) streams each chunk's piece of every layer
as the chunk's iteration computes it (`KVExport`): the pieces cross the link one after another,
each leaving once computed and once the link is through with the ones before (`stream`: the same
pipeline, carried across iterations), so at the hand-off only what the last iteration's pieces
add, and any backlog, is visible.

A model with sliding-window layers sends each KV layer group's layers from its own position on
(`BlockManager.held_from`: a windowed group only what the token worker's window reaches), so its
layers differ in size: layer i takes t_i, its share of T, and the last is through at
f_{L-1} = max_i (d * (i + 1) / L + t_i + ... + t_{L-1}), which is the formula above when they are
equal. The layer-wise threshold counts a layer's tokens on average, as the token worker does.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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

    def layer_tokens(self, num_tokens: Sequence[float]) -> list[float]:
        """Per layer: the tokens its group sends (`num_tokens`: per group; without `layer_groups`,
        every layer sends the most any group sends)."""
        if not self.layer_groups:
            return [max(num_tokens)] * self.num_layers
        return [num_tokens[group] for group in self.layer_groups]

    def stream(self, through: float, start: float, prefill_s: float, layer_tokens: Sequence[float]) -> float:
        """When the link is through with the pieces one iteration computes (`layer_tokens`: each
        layer's; the iteration runs `prefill_s` from `start`, layer after layer) behind the pieces
        before them (through at `through`): a piece leaves once computed and once the link is free."""
        step = prefill_s / self.num_layers
        for i, tokens in enumerate(layer_tokens):
            if tokens > 0:
                through = max(through, start + step * (i + 1)) + self.link_time(tokens) / self.num_layers
        return through

    def _visible(self, num_tokens: float, prefill_s: float) -> float:
        total = self.link_time(num_tokens)
        if not self.layerwise(num_tokens):
            return self.latency_s + total
        layers = self.num_layers
        return self.latency_s + max(total / layers, total - prefill_s * (layers - 1) / layers)


@dataclass
class KVExport:
    """A split request's KV from its placement to its hand-off: what travels, and, for a layer-wise
    one prefilled in chunks, what the chunks before the last have streamed (as the real prompt
    worker does: `splitserve.transfer.protocol.Span`)."""

    prompt_tokens: int
    start_token: int  # the first position whose KV travels (the token worker's cache holds those before)
    starts: tuple[int, ...]  # per KV layer group: the first position it sends
    prompt_worker: str
    pushed_to: int = 0  # positions before this were streamed by earlier iterations
    through: float = field(default=-math.inf)  # when the link is through with them

    @property
    def by_group(self) -> tuple[int, ...]:
        """Per KV layer group: the tokens whose KV travels."""
        return tuple(self.prompt_tokens - start for start in self.starts)

    def layerwise(self, model: TransferModel) -> bool:
        """As the token worker decides: the mean tokens a layer sends, against the threshold."""
        return model.layerwise(sum(model.layer_tokens(self.by_group)) / model.num_layers)

    def chunk_done(self, model: TransferModel, start: float, prefill_s: float, end: int) -> None:
        """An iteration from `start` computed a chunk before the last, up to `end`: its pieces
        stream once `layerwise_threshold` positions are pending (as the prompt worker's
        `min_piece_tokens`), else with a later iteration's."""
        if end - self.pushed_to >= model.layerwise_threshold:
            self._stream(model, start, prefill_s, end)

    def _stream(self, model: TransferModel, start: float, prefill_s: float, end: int) -> None:
        """Each layer's positions from where the last piece ended (or its group's start) to `end`."""
        pieces = [end - min(max(first, self.pushed_to), end) for first in self.starts]
        self.through = model.stream(self.through, start, prefill_s, model.layer_tokens(pieces))
        self.pushed_to = max(self.pushed_to, end)

    def hand_off(self, model: TransferModel, start: float, prefill_s: float) -> float:
        """The iteration from `start`, `prefill_s` long, completed the prefill: the rest streams.
        Returns the time from its end to the KV having landed (a prompt with no earlier pieces:
        `TransferModel.visible_time`)."""
        if self.through == -math.inf:
            return model.visible_time(self.by_group, prefill_s)
        self._stream(model, start, prefill_s, self.prompt_tokens)
        return model.latency_s + self.through - (start + prefill_s)
