"""Turns a scheduler `Plan` into tensors, runs the model, and returns the logits to sample from."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.attention.metadata import group_by_length
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.policies import Plan, ScheduledSeq
from splitserve.engine.prompt_logprobs import PromptRows
from splitserve.engine.sequence import Sequence


@dataclass(frozen=True)
class Forward:
    """One iteration's results: the sequences that sample, their logits [n, vocab] (float32) in the
    same order, and the prompt rows of the sequences that asked for prompt logprobs."""

    seqs: list[Sequence]
    logits: torch.Tensor
    prompt_rows: list[PromptRows]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self._kv_layers = kv_cache.layers()

    @torch.inference_mode()
    def execute(self, plan: Plan, block_tables: dict[str, list[int]],
                after_layer: Callable[[int], None] | None = None) -> Forward:
        """Run one iteration."""
        # single-token queries first, longest context first, so decode_groups are contiguous runs
        items = sorted(plan.scheduled, key=lambda item: (item.num_new_tokens != 1, -item.start))
        input_ids, positions, meta = self._prepare(items, block_tables)
        hidden = self.model(input_ids, positions, self._kv_layers, meta, self.backend, after_layer)
        rows = [meta.query_starts[i + 1] - 1 for i, item in enumerate(items) if item.samples]
        logits = self.model.compute_logits(hidden[rows]).float()
        return Forward([item.seq for item in items if item.samples], logits, _prompt_rows(items, meta, hidden))

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


def _prompt_rows(items: list[ScheduledSeq], meta: AttentionMetadata, hidden: torch.Tensor) -> list[PromptRows]:
    """The rows predicting prompt positions (position p's row predicts p + 1) of the sequences
    that need prompt logits; the prompt's last row predicts the first output token, so it is not one."""
    found = []
    for i, item in enumerate(items):
        end = min(item.start + item.num_new_tokens, item.seq.num_prompt_tokens - 1)
        if item.seq.needs_prompt_logits and end > item.start:
            first_row = meta.query_starts[i]
            found.append(PromptRows(item.seq, item.start + 1, hidden[first_row:first_row + end - item.start]))
    return found
