"""CUDA graphs for decode-only steps: the model's forward captured once per batch size of a
ladder (1, 2, 4, 8, then every 8 up to the largest), replayed with one launch instead of a few
hundred. A step of n decodes runs the smallest captured size >= n; the rows past n are padding.

Invariants a replay relies on:
- inputs live in persistent device buffers the graphs were captured on; a step writes its rows
  there with two non-blocking copies (ids, positions, context lengths and each layer group's
  slots as one [3 + groups, g] block; the groups' block tables' used columns as another);
- a padding row has slot PAD_SLOT (its K and V are stored nowhere), context length 1 and token 0,
  so it reads one key of whatever block its stale table row names (a valid id) and writes nothing;
- a model with LoRA adapter slots has one more input row, each row's slot (NO_ADAPTER for a
  padding row and a base-model row): the graphs run every projection's adapters by row
  (`model.lora`), so a step under any adapters replays the same graph (a step under none still
  launches them, and they return at once);
- table entries past a sequence's context are never read, so stale columns need no clearing;
- launches depend only on the batch size: the decode kernel divides each sequence's keys over
  the splits on the device, and captures with every context at max_model_len, the bound the
  split count is chosen for;
- nothing is garbage-collected while a graph is captured: freeing another graph or an event then
  (what an earlier engine of the process left) invalidates the capture, so garbage is collected
  before and the collector is off during.

Without CUDA (how CI checks the buffers and the padding) a "capture" is an eager run on the same
buffers, replayed by running it again.
"""
from __future__ import annotations

import bisect
import gc
from collections.abc import Callable

import torch

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.attention.metadata import PAD_SLOT
from splitserve.engine.collector import collector_paused
from splitserve.engine.model.lora import NO_ADAPTER
from splitserve.engine.model_runner import ModelRunner, StepBatch
from splitserve.engine.step_inputs import upload

IDS, POSITIONS, CONTEXTS, SLOTS = range(4)  # rows of the [3 + groups (+ 1: adapters), max batch] inputs: SLOTS + group
PADDING = (0, 0, 1)  # a padding row's id, position and context; its slots in every group: PAD_SLOT


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to max_batch, which is always one."""
    return sorted({s for s in (1, 2, 4) if s < max_batch} | set(range(8, max_batch, 8)) | {max_batch})


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, backend: AttentionBackend, max_batch: int, max_model_len: int):
        if not backend.graph_safe:
            raise ValueError(f"attention backend {backend.name!r} reads host-side metadata; it cannot be captured")
        cache, device = runner.kv_cache, runner.device
        self.runner, self.kv_layers, self.backend, self.device = runner, cache.layers(), backend, device
        self.sizes, self.max_model_len = capture_sizes(max_batch), max_model_len
        groups = cache.groups.num_groups
        self._lora = runner.model.lora_slots if runner.model.lora_slots.capacity else None
        self._padding = PADDING + (PAD_SLOT,) * groups + ((NO_ADAPTER,) if self._lora else ())
        self._inputs = torch.tensor(self._padding, dtype=torch.long, device=device)[:, None].repeat(1, max_batch)
        self._tables = torch.zeros((groups, max_batch, -(-max_model_len // cache.block_size)), dtype=torch.long,
                                   device=device)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so the smaller graphs reuse the memory pool the largest one grew."""
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        gc.collect()
        with collector_paused():
            for size in reversed(self.sizes):
                self._replays[size] = self._capture(size, pool)

    def covers(self, batch: StepBatch) -> bool:
        n = len(batch.token_ids)
        return bool(self._replays) and batch.num_decodes == n and n <= self.max_batch

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Final hidden states [n, hidden] of a decode-only batch of n <= max_batch sequences."""
        n = len(batch.token_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        rows = [batch.token_ids, batch.positions, batch.context_lens, *batch.slots]
        if self._lora is not None:
            rows.append(list(batch.adapters) or [NO_ADAPTER] * n)
        padded = [row + [pad] * (size - n) for row, pad in zip(rows, self._padding)]
        upload(torch.tensor(padded, dtype=torch.long), self.device, self._inputs[:, :size])
        upload(batch.block_tables, self.device, self._tables[:, :n, :batch.block_tables.shape[2]])
        return self._replays[size]()[:n]

    def _forward(self, size: int) -> torch.Tensor:
        inputs = self._inputs[:, :size]
        metas = [AttentionMetadata(slot_mapping=slots, block_tables=tables[:size], context_lens=inputs[CONTEXTS],
                                   query_starts=list(range(size + 1)), context_lens_list=[self.max_model_len] * size,
                                   num_decodes=size)
                 for slots, tables in zip(inputs[SLOTS:], self._tables)]
        if self._lora is not None:
            self._lora.rows = inputs[-1]  # each row's adapter slot (the last input row)
        try:
            return self.runner.model(inputs[IDS], inputs[POSITIONS], self.kv_layers, self.runner.layer_metas(metas),
                                     self.backend)
        finally:
            if self._lora is not None:
                self._lora.rows = None  # eager steps group rows by adapter

    def _capture(self, size: int, pool) -> Callable[[], torch.Tensor]:
        if self.device.type != "cuda":
            return lambda: self._forward(size)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(size)  # compiles the kernels for this size and warms the allocator, outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._forward(size)
        return lambda: (graph.replay(), out)[1]
