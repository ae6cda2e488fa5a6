"""Turns a scheduler `Plan` into tensors, runs the model, and returns the logits to sample from."""
from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.attention.metadata import group_by_length
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.policies import Plan, ScheduledSeq
from splitserve.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self._kv_layers = kv_cache.layers()

    @torch.inference_mode()
    def execute(self, plan: Plan, block_tables: dict[str, list[int]],
                after_layer: Callable[[int], None] | None = None) -> tuple[list[Sequence], torch.Tensor]:
        """Run one iteration. Returns the sequences that sample this step and their logits
        [n, vocab] (float32), one row each, in the same order."""
        # single-token queries first, longest context first, so decode_groups are contiguous runs
        items = sorted(plan.scheduled, key=lambda item: (item.num_new_tokens != 1, -item.start))
        input_ids, positions, meta = self._prepare(items, block_tables)
        hidden = self.model(input_ids, positions, self._kv_layers, meta, self.backend, after_layer)
        rows = [meta.query_starts[i + 1] - 1 for i, item in enumerate(items) if item.samples]
        logits = self.model.compute_logits(hidden[rows]).float()
        return [item.seq for item in items if item.samples], logits

    def _prepare(self, items: list[ScheduledSeq], block_tables: dict[str, list[int]]):
        bs = self.kv_cache.block_size
        tokens, positions, slots, starts, context_lens, tables = [], [], [], [0], [], []
        for item in items:
            seq, end = item.seq, item.start + item.num_new_tokens
            table = block_tables[seq.seq_id]
            tokens += seq.token_ids[item.start:end]
            positions += range(item.start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(item.start, end)]
            starts.append(starts[-1] + item.num_new_tokens)
            context_lens.append(end)
            tables.append(table[: -(-end // bs)])
        width = max(len(t) for t in tables)
        num_decodes = sum(1 for item in items if item.num_new_tokens == 1)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor([t + [0] * (width - len(t)) for t in tables]),
            context_lens=self._tensor(context_lens),
            query_starts=starts,
            context_lens_list=context_lens,
            num_decodes=num_decodes,
            decode_groups=group_by_length(context_lens[:num_decodes]),
            query_start_tensor=self._tensor(starts),
        )
        return self._tensor(tokens), self._tensor(positions), meta

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
