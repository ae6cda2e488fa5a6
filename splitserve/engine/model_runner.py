"""Turns a scheduler `Plan` into a `StepBatch`, runs the model, and returns the logits to sample from.

With tensor parallelism the leader's runner hands each batch to `StepChannel` before running it
(the other ranks run the same batch on their shards) and closes the round after it. A step's
inputs reach the device in one non-blocking copy (`step_inputs`); decode-only steps replay a
captured CUDA graph where the runner has `DecodeGraphs`."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.attention.metadata import group_by_length
from splitserve.engine.host_block_tables import HostBlockTables
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.policies import Plan, ScheduledSeq
from splitserve.engine.prompt_logprobs import PromptRows
from splitserve.engine.sequence import Sequence
from splitserve.engine.step_inputs import StepTensors, upload_list

if TYPE_CHECKING:
    from splitserve.engine.cuda_graphs import DecodeGraphs

T = TypeVar("T")


@dataclass(frozen=True)
class StepBatch:
    """One iteration's inputs (what a tensor-parallel leader sends its other ranks). Sequences are
    ordered decodes first (see AttentionMetadata). `positions` are each token's rows of the rotary
    tables (`RotaryEmbedding.table_rows`: its position, unless LongRoPE turns it long). Per layer
    group (`kv_groups`), `slots` has each token's cache slot and `block_tables` (a host int64
    tensor [groups, num_seqs, width], width the most blocks a sequence's context covers) the
    sequences' tables; a row's entries past its sequence's context are block ids or 0, never read.
    `adapters`: each sequence's LoRA adapter slot (`model.lora`; empty where the model has none)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[list[int]]
    query_starts: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    num_decodes: int
    adapters: tuple[int, ...] = ()


class StepChannel(Protocol):
    """The leader's side of a tensor-parallel step (engine.tp_step.TPLeader)."""

    def begin(self, batch: StepBatch) -> None: ...

    def end(self) -> None: ...

    def abandon(self, error: BaseException) -> None: ...


@dataclass(frozen=True)
class Forward:
    """One iteration's results: the sequences that sample, their logits [rows, vocab] (float32) in the
    same order (a row each, and one more for each of its `drafts`, aligned with `seqs`), the prompt
    rows of the sequences that asked for prompt logprobs, and what those that asked for an embedding
    pool from their last prompt row: its hidden state [hidden], L2-normalized in float32, or its
    logits at their label tokens (copied before sampling changes them)."""

    seqs: list[Sequence]
    logits: torch.Tensor
    prompt_rows: list[PromptRows]
    pooled: list[tuple[Sequence, torch.Tensor]]
    drafts: list[tuple[int, ...]]

    def by_sequence(self, rows: list[T]) -> dict[str, list[T]]:
        """Per-row results (the sampled tokens) by sampling sequence: its next token's, then a draft's each."""
        by_seq, row = {}, 0
        for seq, drafts in zip(self.seqs, self.drafts):
            by_seq[seq.seq_id] = rows[row:row + 1 + len(drafts)]
            row += 1 + len(drafts)
        return by_seq


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: AttentionBackend, device: torch.device,
                 channel: StepChannel | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.channel = channel
        self.graphs: DecodeGraphs | None = None  # set once captured (one rank, CUDA: see shard_builder)
        self._kv_layers = kv_cache.layers()
        self._host_tables = [HostBlockTables() for _ in kv_cache.groups.windows]

    @torch.inference_mode()
    def execute(self, plan: Plan, block_tables: dict[str, list[list[int]]],
                after_layer: Callable[[int], None] | None = None) -> Forward:
        """Run one iteration."""
        # single-token queries first, longest context first, so decode_groups are contiguous runs
        items = sorted(plan.scheduled, key=lambda item: (item.num_new_tokens != 1, -item.start))
        batch = self.prepare(items, block_tables)
        if self.channel is None:
            hidden = self.forward(batch, after_layer)
        else:
            self.channel.begin(batch)
            try:
                hidden = self.forward(batch, after_layer)
            except BaseException as error:
                self.channel.abandon(error)
                raise
            self.channel.end()
        sampling, rows = [], []  # per sampling item its rows: its last token's, then a draft's each
        for i, item in enumerate(items):
            if item.samples:
                sampling.append(item)
                rows += range(batch.query_starts[i + 1] - 1 - len(item.drafts), batch.query_starts[i + 1])
        logits = self.model.compute_logits(hidden[_row_index(rows, hidden.device)]).float()
        return Forward([item.seq for item in sampling], logits, _prompt_rows(items, batch, hidden),
                       _pooled(sampling, rows, logits, hidden), [item.drafts for item in sampling])

    @torch.inference_mode()
    def forward(self, batch: StepBatch, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden]; every token's KV is written to this rank's cache.
        A captured graph runs no per-layer hook, so steps that stream KV layer by layer run eagerly."""
        if after_layer is None and self.graphs is not None and self.graphs.covers(batch):
            return self.graphs.run(batch)  # adapters by row, from the graphs' inputs
        self.model.lora_slots.set(batch.adapters, batch.query_starts, self.device)
        inputs = StepTensors.upload(batch, self.device)
        decode_groups = group_by_length(batch.context_lens[:batch.num_decodes])
        metas = [AttentionMetadata(slot_mapping=slots, block_tables=tables, context_lens=inputs.context_lens,
                                   query_starts=batch.query_starts, context_lens_list=batch.context_lens,
                                   num_decodes=batch.num_decodes, decode_groups=decode_groups,
                                   query_start_tensor=inputs.query_starts)
                 for slots, tables in zip(inputs.slots, inputs.block_tables)]
        return self.model(inputs.token_ids, inputs.positions, self._kv_layers, self.layer_metas(metas), self.backend,
                          after_layer)

    def layer_metas(self, metas: list[AttentionMetadata]) -> list[AttentionMetadata]:
        """Per layer, its group's metadata."""
        return [metas[group] for group in self.kv_cache.groups.group_of]

    def prepare(self, items: list[ScheduledSeq], block_tables: dict[str, list[list[int]]]) -> StepBatch:
        bs, rotary, groups = self.kv_cache.block_size, self.model.rotary, len(self._host_tables)
        tokens, positions, starts, context_lens, ids = [], [], [0], [], []
        slots, tables = [[] for _ in range(groups)], [[] for _ in range(groups)]
        for item in items:
            seq, end = item.seq, item.start + item.num_new_tokens
            tokens += seq.token_ids[item.start:end]
            tokens += item.drafts
            positions += rotary.table_rows(item.start, end, seq.num_tokens)
            for group, table in enumerate(block_tables[seq.seq_id]):
                slots[group] += [table[p // bs] * bs + p % bs for p in range(item.start, end)]
                tables[group].append(table)
            starts.append(starts[-1] + item.num_new_tokens)
            context_lens.append(end)
            ids.append(seq.seq_id)
        width = -(-max(context_lens) // bs)
        gathered = [host.gather(ids, group_tables, width) for host, group_tables in zip(self._host_tables, tables)]
        return StepBatch(tokens, positions, slots, starts, context_lens,
                         gathered[0][None] if groups == 1 else torch.stack(gathered),
                         sum(1 for item in items if item.num_new_tokens == 1),
                         tuple(item.seq.adapter_slot for item in items) if self.model.lora_slots.capacity else ())


def _row_index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """`rows` as an index that does not wait for the device: a slice when they are consecutive (a
    decode-only step's), else uploaded without blocking (indexing by a list copies it synchronously)."""
    if rows and rows[-1] - rows[0] == len(rows) - 1:  # ascending and distinct, so consecutive
        return slice(rows[0], rows[-1] + 1)
    return upload_list(rows, torch.long, device)


def _pooled(sampling: list[ScheduledSeq], rows: list[int], logits: torch.Tensor,
            hidden: torch.Tensor) -> list[tuple[Sequence, torch.Tensor]]:
    """What each sequence that asked for an embedding pools from its row (it has no drafts)."""
    pooled, row = [], 0
    for item in sampling:
        params = item.seq.params
        if params.embed:
            pooled.append((item.seq, logits[row, list(params.label_token_ids)] if params.label_token_ids
                           else torch.nn.functional.normalize(hidden[rows[row]].float(), dim=-1)))
        row += 1 + len(item.drafts)
    return pooled


def _prompt_rows(items: list[ScheduledSeq], batch: StepBatch, hidden: torch.Tensor) -> list[PromptRows]:
    """The rows predicting prompt positions (position p's row predicts p + 1) of the sequences
    that need prompt logits; the prompt's last row predicts the first output token, so it is not one."""
    found = []
    for i, item in enumerate(items):
        end = min(item.start + item.num_new_tokens, item.seq.num_prompt_tokens - 1)
        if item.seq.needs_prompt_logits and end > item.start:
            first_row = batch.query_starts[i]
            found.append(PromptRows(item.seq, item.start + 1, hidden[first_row:first_row + end - item.start]))
    return found
