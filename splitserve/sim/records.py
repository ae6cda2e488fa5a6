"""What the clients of a simulated cluster saw, kept compact: per request its status and the times of
its tokens, with no request object left once it has ended.

A request in flight keeps its token times in a list (the cluster's `token_times`); when it ends,
`finish` moves them here, into one float64 array that holds every request's slice in index order
(a slice as long as the output the request asked for). So a run of any length holds 8 bytes a
token plus a few numbers a request, and its summary is computed from arrays (`columns`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from splitserve.bench.report import RequestRecord, RunColumns
from splitserve.bench.workload import RequestSpec

OK, REJECTED = 200, 429  # HTTP statuses, as `RequestRecord` reads them
UNRESOLVED = 0  # the status of a request that has not ended yet


class SimRecords(Sequence[RequestRecord]):
    """The requests' records in index order, each a `RequestRecord` built when asked for. A request
    is addressed by its slot (`slot_of`), its place in index order."""

    def __init__(self, requests: Sequence[RequestSpec]):
        ordered = sorted(requests, key=lambda r: r.index)
        self._index = np.array([r.index for r in ordered], dtype=np.int64)
        self._prompt_tokens = np.array([r.prompt_tokens for r in ordered], dtype=np.int64)
        self._requested = np.array([r.output_tokens for r in ordered], dtype=np.int64)
        self._start_s = np.array([r.arrival_s for r in ordered], dtype=float)
        self._priority = np.array([r.priority for r in ordered], dtype=np.int64)
        self._first = np.concatenate(([0], np.cumsum(self._requested)))  # slot i's times: _times[_first[i]:]
        self._times = np.zeros(self._first[-1])  # seconds from the request's start, as the client saw them
        self._count = np.zeros(len(ordered), dtype=np.int64)  # tokens received
        self._status = np.full(len(ordered), UNRESOLVED, dtype=np.int16)
        self._cached = np.full(len(ordered), -1, dtype=np.int64)  # prompt tokens its prefill found cached
        self._errors: dict[int, str] = {}  # by slot, for refused requests

    def slot_of(self, index: int) -> int:
        return int(np.searchsorted(self._index, index))

    # ---- recording -----------------------------------------------------------------------
    def finish(self, slot: int, times: list[float], delay_s: float, cached_tokens: int) -> None:
        """The request's tokens were sampled at `times` (simulated seconds) and reached the client
        `delay_s` later; its prefill found `cached_tokens` of its prompt in the prefix cache."""
        if self._status[slot] != UNRESOLVED:
            raise RuntimeError(f"request {self._index[slot]} ended twice (simulator bug)")
        first, count = self._first[slot], len(times)
        self._times[first:first + count] = np.add(times, delay_s - self._start_s[slot])
        self._count[slot], self._status[slot], self._cached[slot] = count, OK, cached_tokens

    def refuse(self, slot: int, status: int, error: str) -> None:
        self._status[slot], self._errors[slot] = status, error

    @property
    def num_resolved(self) -> int:
        return int(np.count_nonzero(self._status))

    # ---- reading -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, position: int) -> RequestRecord:
        slot = range(len(self))[position]  # IndexError past the end, as a sequence must raise
        index, prompt, requested = int(self._index[slot]), int(self._prompt_tokens[slot]), int(self._requested[slot])
        start, status, priority = float(self._start_s[slot]), int(self._status[slot]), int(self._priority[slot])
        if status != OK:
            return RequestRecord(index, prompt, 0, requested, start, None, (), None, self._errors.get(slot), status,
                                 priority=priority)
        first = self._first[slot]
        times = tuple(self._times[first:first + self._count[slot]].tolist())
        return RequestRecord(index, prompt, len(times), requested, start, times[0], times, times[-1], status=OK,
                             cached_tokens=int(self._cached[slot]), priority=priority)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SimRecords):
            return NotImplemented
        arrays = ("_index", "_prompt_tokens", "_requested", "_start_s", "_times", "_count", "_status", "_cached",
                  "_priority")
        return self._errors == other._errors and all(np.array_equal(getattr(self, a), getattr(other, a))
                                                     for a in arrays)

    def end_s(self) -> float:
        """When the last request ended (its last token, or its refusal at arrival)."""
        done = self._status == OK
        e2e = np.where(done, self._times[np.maximum(self._first[:-1] + self._count - 1, 0)], 0.0)
        return float((self._start_s + e2e).max())

    def columns(self) -> RunColumns:
        """The summary's arrays; a completed request's token gaps are those of `RequestRecord.tbt_s`."""
        done = np.flatnonzero(self._status == OK)
        first, count = self._first[done], self._count[done]
        tbt = np.empty(int(count.sum()) - len(done))
        end = 0
        for start, n in zip(first.tolist(), count.tolist()):
            np.subtract(self._times[start + 1:start + n], self._times[start:start + n - 1], out=tbt[end:end + n - 1])
            end += n - 1
        return RunColumns(self._status == OK, self._status == REJECTED, self._prompt_tokens, self._count,
                          self._times[first], self._times[first + count - 1], tbt, self._cached, self._priority,
                          np.repeat(np.arange(len(done)), count - 1))
