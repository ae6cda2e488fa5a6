"""How a model's layers share KV blocks: layer groups of one attention kind each.

A model whose layers all attend alike (all to the whole context, or all to one window) is one
group of every layer. Where some layers slide and the others do not (Gemma 2 and 3, GPT-OSS),
the full layers and the windowed ones form separate groups, so the windowed layers' block tables
can release what their window no longer reaches (`BlockManager`) while the full layers' grow with
the context. Every group has `size` layers (the last of a kind padded with unused slots), so one
block id names `size` layers' worth of KV whichever group holds it: the groups share one pool of
blocks, and the cache is [size, 2, blocks, block_size, kv_heads, head_dim] (`KVCache`). The size
is the largest that pads at most MAX_PADDING of the layers; a model that would need more than
MAX_GROUPS groups (a table each per sequence and step) keeps one group, releasing nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.engine.config import ModelConfig

MAX_PADDING = 0.125  # the share of layers a grouping may leave as unused cache slots
MAX_GROUPS = 16


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window, None for the whole context
    group_of: tuple[int, ...]        # per layer: its group
    slot_of: tuple[int, ...]         # per layer: its slot in a block (the cache's first dimension)
    size: int                        # slots a block holds

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_groups(config: ModelConfig) -> KVGroups:
    layers = range(config.num_hidden_layers)
    full = [layer for layer in layers if config.window_of(layer) is None]
    windowed = [layer for layer in layers if config.window_of(layer) is not None]
    size = _group_size(len(full), len(windowed)) if full and windowed else 0
    if not size or -(-len(full) // size) + -(-len(windowed) // size) > MAX_GROUPS:
        return KVGroups((config.uniform_window,), (0,) * len(layers), tuple(layers), len(layers))
    windows, group_of, slot_of = [], [0] * len(layers), [0] * len(layers)
    for kind, members in ((None, full), (config.sliding_window, windowed)):
        for start in range(0, len(members), size):
            for slot, layer in enumerate(members[start:start + size]):
                group_of[layer], slot_of[layer] = len(windows), slot
            windows.append(kind)
    return KVGroups(tuple(windows), tuple(group_of), tuple(slot_of), size)


def _group_size(*counts: int) -> int:
    """The most layers a group can have with at most MAX_PADDING of them padding."""
    total = sum(counts)
    return max(size for size in range(1, min(counts) + 1)
               if sum(math.ceil(c / size) * size - c for c in counts) <= MAX_PADDING * total)
