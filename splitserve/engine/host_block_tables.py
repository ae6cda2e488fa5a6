"""The block tables of a step's sequences as one host tensor, kept from step to step.

Rebuilding every table from Python lists costs each step time in proportion to the whole
batch's context (256 sequences at 2k tokens: 32k ids), while a decode step adds at most one block
per sequence. So each sequence keeps a row of a host array, and a step copies into it only the
ids appended since the last one. This relies on the block manager's invariant: a sequence's
table list only grows while the sequence holds it, and a new allocation is a new list (which is
copied whole). An entry the block manager releases (a sliding window's) keeps its old id here:
no attention output depends on it (keys out of the window are skipped or masked). Rows of
sequences that have left are reclaimed when the rows run out; a row's entries past its table's
end are 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class _Row:
    index: int
    table: list[int]  # the block manager's list this row mirrors (identity tells a new allocation)
    synced: int       # table[:synced] is in the row


class HostBlockTables:
    def __init__(self, rows: int = 64, columns: int = 64):
        self._data = np.zeros((rows, columns), dtype=np.int64)
        self._rows: dict[str, _Row] = {}
        self._free = list(range(rows - 1, -1, -1))

    def gather(self, seq_ids: list[str], tables: list[list[int]], width: int) -> torch.Tensor:
        """[len(seq_ids), width] int64 on the host: row i starts with tables[i]'s first `width`
        ids (a table may hold fewer: 0 after its end, or more: its later blocks are cut off)."""
        index = []
        for seq_id, table in zip(seq_ids, tables):
            row = self._rows.get(seq_id)
            if row is None or row.table is not table:
                row = self._place(seq_id, table, seq_ids)
            if len(table) > row.synced:
                self._sync(row)
            index.append(row.index)
        return torch.from_numpy(self._data[index, :width])

    def _place(self, seq_id: str, table: list[int], in_step: list[str]) -> _Row:
        old = self._rows.pop(seq_id, None)
        if old is not None:
            self._free.append(old.index)
        if not self._free:
            self._reclaim(set(in_step))
        row = _Row(self._free.pop(), table, 0)
        self._data[row.index] = 0
        self._rows[seq_id] = row
        return row

    def _sync(self, row: _Row) -> None:
        n = len(row.table)
        if n > self._data.shape[1]:
            self._data = np.pad(self._data, ((0, 0), (0, max(n, 2 * self._data.shape[1]) - self._data.shape[1])))
        self._data[row.index, row.synced:n] = row.table[row.synced:n]
        row.synced = n

    def _reclaim(self, in_step: set[str]) -> None:
        """Free the rows of sequences this step does not run; if that frees under half of them,
        double the rows too, so a reclaim's scan of every row is paid for by the rows it frees."""
        for seq_id in [s for s in self._rows if s not in in_step]:
            self._free.append(self._rows.pop(seq_id).index)
        rows = len(self._data)
        if 2 * len(self._free) < rows:
            self._data = np.pad(self._data, ((0, rows), (0, 0)))
            self._free += range(2 * rows - 1, rows - 1, -1)
