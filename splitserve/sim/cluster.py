"""The discrete-event loop: arrivals placed by the cluster's own `ClusterState`, workers running the
engine's own policies (`SimWorker`), KV transfers timed by a `TransferModel`, periodic load reports.

Events sit in one heap keyed (time, push order), so equal times keep the order they were made in and
a run is a pure function of the scenario and the requests (nothing reads a clock or draws a random
number). Per request, as in a real run (splitserve.cluster.dispatch):
1. arrival: `ClusterState.place`; no placement, or no room on the token worker at reservation
   (EngineFullError / OutOfBlocksError), rejects it (HTTP 429); a prompt of max_model_len tokens or
   more is refused as the engine refuses it (HTTP 400);
2. split: the token worker reserves blocks, the prompt worker prefills with hand-off; at the end of
   the prefill iteration the client gets the first token (the real prompt worker returns it without
   waiting for its pushes) and the prompt side frees its blocks; at iteration end + the visible
   transfer time the KV lands and the token worker takes the sequence with its first token, so the
   transfer shows in the second token. The prompt worker goes on with its next iteration at once:
   the pushes are asynchronous (Splitwise IV-C);
   local: the whole request runs on one worker;
3. each token's time is the end of the iteration that sampled it, plus the scenario's per-request
   serving overhead (`ServingOverhead.request_s`: the client sees every token that much later).
With `ServingOverhead.host_cores` > 0 the workers share one host's cores with the serving stack
(`SharedHost`): an iteration's end moves whenever another worker starts or ends one, or the stack
(busy streaming the tokens sampled) starts or runs out of work. There the request's path through
the stack (`request_s`: the proxy, the ingress, the CLS) runs on arrival, and placement (step 1)
waits for it: first its CPU (`request_cpu_s`), work of its own on those cores that a loaded host
stretches, then the rest of its time (waiting, off the cores); nothing is added to the token times.
Prefix caching (the scenario's `prefix_caching`, for requests whose prompts share blocks): a prompt
is its blocks' ids, each repeated for the block's tokens, so equal blocks are equal tokens and the
workers' own prefix caches hit where a real run's would; with prefix-aware placement the CLS gets the
prompt's block hashes and each report's cache delta, and a token worker receives only the KV its
cache lacks (the transfer is timed for those tokens).
Workers sleep while idle (no events), wake when they get work (after the other events of that
instant, so requests arriving together batch), and run iterations back to back while they have work.
Every `report_interval_s` each worker whose load may have changed reports it (an unchanged worker's
report would repeat the last one: same load, nothing placed since, no rebalance unless it is a guest
in the mixed pool, and guests always report); pool moves switch the moved workers' policies. While no
worker would report, the ticks until the next event are skipped (simulated idle time costs no ticks).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

from splitserve.bench.workload import RequestSpec
from splitserve.engine.block_manager import OutOfBlocksError
from splitserve.engine.collector import collector_paused
from splitserve.engine.policies.base import EngineFullError
from splitserve.engine.prefix_hash import prompt_block_hashes
from splitserve.engine.sequence import Sequence as EngineSequence
from splitserve.placement import ClusterState, PlacementRequest, PoolMove, Role, WorkerState
from splitserve.placement.load import prefix_delta_of
from splitserve.placement.state import MAX_PREFIX_BLOCKS, REFUSED_TRIES, PrefixOptions
from splitserve.sim.contention import STACK, SharedHost, request_run
from splitserve.sim.records import SimRecords
from splitserve.sim.request_inputs import RequestInputs
from splitserve.sim.result import SimResult, WorkerStats
from splitserve.sim.scenario import Scenario
from splitserve.sim.transfer import KVExport
from splitserve.sim.worker import FILLER_TOKEN, NOTHING_HAPPENED, SimWorker

Progress = Callable[[int, int], None]  # (requests done or refused, all requests)


def simulate(scenario: Scenario, requests: Sequence[RequestSpec], seed: int = 0,
             progress: Progress | None = None) -> SimResult:
    """Run `requests` (arrival times in seconds from 0) through the cluster of `scenario`."""
    with collector_paused():  # millions of short-lived objects, no cycles: it would only rescan the blocks
        return Simulation(scenario, requests).run(progress, seed)


def _first_tick_at(time: float, interval: float) -> int:
    """The least tick whose time (tick * interval, as `Simulation._report` computes it) is >= `time`."""
    tick = math.ceil(time / interval)
    while tick * interval < time:
        tick += 1
    while tick > 0 and (tick - 1) * interval >= time:
        tick -= 1
    return tick


def _would_report(worker: SimWorker, state: WorkerState) -> bool:
    """A worker reports at a tick when its load may have changed, or when it is a guest in the mixed pool."""
    return worker.changed or (state.pool is Role.MIXED and state.home is not Role.MIXED)


class Simulation:
    """One run (`simulate` is the usual way in). After `run`, `workers` and `cls` hold the final state
    of every worker and of the cluster-level scheduler."""

    def __init__(self, scenario: Scenario, requests: Sequence[RequestSpec]):
        if not requests:
            raise ValueError("requests must hold at least one request")
        if len({r.index for r in requests}) != len(requests):
            raise ValueError("requests must have distinct indexes")
        self.scenario = scenario
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        if scenario.max_loras == 0 and any(r.adapter is not None for r in self.requests):
            raise ValueError("requests name LoRA adapters, but the workers have no adapter slots: set max_loras")
        # A prompt of tokens of its own is only cached where an import preempted for its adapter's
        # slot is admitted again, as the engine's prefix cache keeps its KV for then.
        self.caching = scenario.prefix_caching and any(r.prefix_blocks or r.adapter for r in self.requests)
        self.aware = self.caching and scenario.prefix.aware
        self.cls = ClusterState(scenario.placement, scenario.thresholds,
                                scenario.prefix if self.caching else PrefixOptions(aware=False), scenario.adapters)
        self.records = SimRecords(self.requests)
        self.token_times: dict[str, list[float]] = {}  # requests in flight: when each token was sampled
        self._slots: dict[str, int] = {}  # requests in flight: their slots in `records`
        self._prefills: dict[str, EngineSequence] = {}  # requests in flight: their prefill's sequence (its cache hit)
        self.inputs = RequestInputs(self.caching)
        self.workers: dict[str, SimWorker] = {}
        self._hardware_of: dict[str, str] = {}
        self._add_workers()
        self._reporting = [(w, self.cls.workers[w.worker_id]) for _, w in sorted(self.workers.items())]
        self.pool_moves = dict.fromkeys(self.workers, 0)
        self._awaiting_kv: dict[str, SimWorker] = {}  # split requests' token workers, until the KV lands
        self._to_send: dict[str, KVExport] = {}  # split requests not handed off yet
        self._exporting: dict[str, int] = dict.fromkeys(self.workers, 0)  # per worker: its prefills of those
        self.kv_tokens_sent = self.kv_tokens_reused = self.placements_refused = 0
        self._waking: set[str] = set()
        self._heap: list = []
        cores = scenario.overhead.host_cores  # > 0: the workers share one host's cores
        self.host = SharedHost(cores, scenario.overhead.stream_cpu_s) if cores > 0 else None
        self._arriving: dict[str, int] = {}  # request runs on the shared host -> the request's position
        self._token_delay_s = 0.0 if self.host is not None else scenario.overhead.request_s
        self._order = itertools.count()
        self.now = 0.0
        self.num_events = 0

    def _add_workers(self) -> None:
        scenario, profiles = self.scenario, self.scenario.hardware_profiles()
        counts = dict.fromkeys(Role, 0)
        for pool in scenario.pools:
            for _ in range(pool.count):
                worker_id = f"{pool.role.value}-{counts[pool.role]:03d}"
                counts[pool.role] += 1
                worker = SimWorker(worker_id, scenario.policy_for(pool.role), scenario.perf_models[pool.setup],
                                   scenario.num_blocks_of(pool), scenario.block_size, scenario.limits,
                                   self.token_times, scenario.overhead, lambda: self.now, self.caching,
                                   scenario.kv_windows, scenario.max_loras, scenario.lora_swap_s, scenario.drafts,
                                   scenario.host_tier_of(pool))
                self.workers[worker_id], self._hardware_of[worker_id] = worker, pool.hardware
                self.cls.add_worker(worker_id, pool.role, profiles[pool.setup], worker.load())
                worker.changed = False

    # ---- the loop ------------------------------------------------------------------------
    def _push(self, time: float, handler: Callable, arg) -> None:
        heapq.heappush(self._heap, (time, next(self._order), handler, arg))

    def run(self, progress: Progress | None = None, seed: int = 0) -> SimResult:
        self._progress, self._progress_step = progress, max(1, len(self.requests) // 100)
        self._next_progress = self._progress_step
        self._push(self.requests[0].arrival_s, self._arrive, 0)
        self._push(self.scenario.report_interval_s, self._report, 1)
        heap, pop = self._heap, heapq.heappop
        while heap:
            self.now, _, handler, arg = pop(heap)
            handler(arg)
            self.num_events += 1
        self._check_drained()
        if progress is not None:
            progress(len(self.requests), len(self.requests))
        return self._result(seed)

    def _check_drained(self) -> None:
        """Every request ended, so every worker must be empty: no sequence left, every block free."""
        for worker in self.workers.values():
            policy, blocks = worker.policy, worker.blocks
            if policy.has_work() or policy.held or blocks.num_free_blocks != blocks.num_blocks:
                raise RuntimeError(f"worker {worker.worker_id} still holds sequences or KV blocks after the run "
                                   "(simulator bug)")

    # ---- events --------------------------------------------------------------------------
    def _arrive(self, position: int) -> None:
        if position + 1 < len(self.requests):
            self._push(self.requests[position + 1].arrival_s, self._arrive, position + 1)
        spec = self.requests[position]
        if spec.prompt_tokens >= self.scenario.max_model_len:
            message = f"prompt has {spec.prompt_tokens} tokens but max_model_len is {self.scenario.max_model_len}"
            self.records.refuse(self.records.slot_of(spec.index), 400, message)
            return
        overhead = self.scenario.overhead
        if self.host is None or overhead.request_s == 0:
            self._place(position)
        elif overhead.request_cpu_s == 0:
            self._place_after_waiting(position)
        else:
            run_id = request_run(spec.index)
            self._arriving[run_id] = position
            self._reschedule(self.host.start(run_id, overhead.request_cpu_s, self.now))

    def _request_path_done(self, arg: tuple[str, int]) -> None:
        """The CPU of a request's path is done; the rest of its time (waiting, off the cores) follows."""
        run_id, version = arg
        if self.host.current(run_id, version):
            self._reschedule(self.host.finish(run_id, self.now)[1])
            self._place_after_waiting(self._arriving.pop(run_id))

    def _place_after_waiting(self, position: int) -> None:
        """Placed once the waiting part of its path (request_s less its CPU, off the cores) is over."""
        wait = self.scenario.overhead.request_s - self.scenario.overhead.request_cpu_s
        if wait > 0:
            self._push(self.now + wait, self._place, position)
        else:
            self._place(position)

    def _place(self, position: int) -> None:
        spec = self.requests[position]
        seq_id, slot = f"r{spec.index}", self.records.slot_of(spec.index)
        prompt = self.inputs.prompt_of(spec)
        hashes = prompt_block_hashes(prompt, self.scenario.block_size, MAX_PREFIX_BLOCKS,
                                     lora=spec.adapter) if self.aware else ()
        request, params, refused = PlacementRequest(seq_id, spec.prompt_tokens, spec.output_tokens,
                                                    prefix_hashes=hashes, priority=spec.priority,
                                                    lora=spec.adapter), self.inputs.params_of(spec), {}
        starts: tuple[int, ...] = ()  # split: per KV layer group, the first position the token worker receives
        for tries in range(1, REFUSED_TRIES + 1):  # as the ingress does (cluster/dispatch.py)
            placement, moves = self.cls.place(request, self.now, refused)
            self._apply(moves)
            if placement is None:
                self.records.refuse(slot, 429, "no worker can take the request now" + "".join(
                    f"; {worker} cannot take it: {error}" for worker, error in refused.items()))
                return
            prompt_worker, token_worker = self.workers[placement.prompt_worker], self.workers[placement.token_worker]
            prompt_worker.changed = token_worker.changed = True  # the CLS counts the request on both
            if placement.local:
                break
            imported = EngineSequence(seq_id, prompt, params, self.now)
            imported.adapter_identity = spec.adapter
            try:
                token_worker.reserve_import(imported, self.aware)
            except (EngineFullError, OutOfBlocksError) as error:  # its last report was stale
                self.placements_refused += 1
                if tries == REFUSED_TRIES:
                    self.records.refuse(slot, 429, f"worker {token_worker.worker_id} cannot take the request: "
                                                   f"{error}")
                    return
                refused[token_worker.worker_id] = error
                continue
            self._awaiting_kv[seq_id] = token_worker
            starts = token_worker.import_starts(imported)
            self._to_send[seq_id] = KVExport(spec.prompt_tokens, imported.num_computed_tokens, starts,
                                              prompt_worker.worker_id)
            self._exporting[prompt_worker.worker_id] += 1
            break
        self.token_times[seq_id], self._slots[seq_id] = [], slot
        seq = self._prefills[seq_id] = EngineSequence(seq_id, prompt, params, self.now)
        seq.adapter_identity = spec.adapter
        seq.export_from = starts  # the prompt worker releases the windowed blocks its export never reads
        prompt_worker.add(seq, hand_off=not placement.local)
        self._wake_soon(prompt_worker)

    def _wake_soon(self, worker: SimWorker) -> None:
        """Start the idle `worker` once the other events of this instant are done."""
        if not worker.busy and worker.worker_id not in self._waking:
            self._waking.add(worker.worker_id)
            self._push(self.now, self._wake, worker)

    def _wake(self, worker: SimWorker) -> None:
        self._waking.discard(worker.worker_id)
        if not worker.busy:
            self._start(worker)

    def _start(self, worker: SimWorker) -> None:
        end = worker.start_iteration(self.now)
        if end is None:
            return
        if self.host is None:
            self._push(end, self._iteration_end, worker)
            return
        self._reschedule(self.host.start(worker.worker_id, end - self.now, self.now))

    def _reschedule(self, ends: list[tuple[str, float, int]]) -> None:
        for run_id, end, version in ends:
            if run_id == STACK:
                self._push(end, self._stack_idle, version)
            elif run_id in self._arriving:
                self._push(end, self._request_path_done, (run_id, version))
            else:
                self._push(end, self._shared_iteration_end, (self.workers[run_id], version))

    def _stack_idle(self, version: int) -> None:
        if self.host.current(STACK, version):
            self._reschedule(self.host.finish(STACK, self.now)[1])

    def _shared_iteration_end(self, arg: tuple[SimWorker, int]) -> None:
        worker, version = arg
        if not self.host.current(worker.worker_id, version):
            return  # moved by another worker's start or end since it was pushed
        elapsed, ends = self.host.finish(worker.worker_id, self.now, worker.sampling)
        self._reschedule(ends)
        worker.stretch(elapsed)
        self._iteration_end(worker)

    def _iteration_end(self, worker: SimWorker) -> None:
        if self._exporting[worker.worker_id]:
            self._stream_chunks(worker)
        result = worker.finish_iteration(self.now)
        if result is not NOTHING_HAPPENED:
            for seq in result.handed_off:
                export = self._drop_export(seq.seq_id)
                sent = seq.num_prompt_tokens - export.start_token
                self.kv_tokens_sent += sent
                self.kv_tokens_reused += seq.num_prompt_tokens - sent
                visible = export.hand_off(self.scenario.transfer, self.now - worker.iteration_s, worker.iteration_s)
                self._push(self.now + visible, self._kv_landed, seq.seq_id)
            for seq in result.finished:
                self._cancel_import(seq.seq_id)  # a split request whose first token was its last
                self._finish(seq.seq_id)
        self._start(worker)

    def _stream_chunks(self, worker: SimWorker) -> None:
        """Layer-wise split requests whose chunk before the last the ending iteration computed: its
        pieces stream now."""
        model, start = self.scenario.transfer, self.now - worker.iteration_s
        for item in worker.plan.scheduled:
            export = self._to_send.get(item.seq.seq_id)
            if export is not None and not item.samples and export.layerwise(model):
                export.chunk_done(model, start, worker.iteration_s, item.start + item.num_new_tokens)

    def _drop_export(self, seq_id: str) -> KVExport:
        export = self._to_send.pop(seq_id)
        self._exporting[export.prompt_worker] -= 1
        return export

    def _kv_landed(self, seq_id: str) -> None:
        worker = self._awaiting_kv.pop(seq_id)
        seq = worker.complete_import(seq_id, FILLER_TOKEN)
        if seq.is_finished:  # max_model_len reached with the first token
            self._finish(seq_id)
        self._wake_soon(worker)

    def _cancel_import(self, seq_id: str) -> None:
        worker = self._awaiting_kv.pop(seq_id, None)
        if seq_id in self._to_send:
            self._drop_export(seq_id)
        if worker is not None:
            worker.abort(seq_id)
            self._wake_soon(worker)  # the freed blocks may admit a waiting prompt

    def _finish(self, seq_id: str) -> None:
        if seq_id not in self._slots:
            raise RuntimeError(f"request {seq_id} finished twice (simulator bug)")
        self.records.finish(self._slots.pop(seq_id), self.token_times.pop(seq_id), self._token_delay_s,
                            self._prefills.pop(seq_id).num_cached_tokens)

    def _report(self, tick: int) -> None:
        for worker, state in self._reporting:
            if _would_report(worker, state):
                worker.changed = False
                delta = prefix_delta_of(worker.blocks, snapshot=False) if self.aware else None
                self._apply(self.cls.report(worker.worker_id, worker.load(), self.now, delta))
        resolved = self.records.num_resolved
        if self._progress is not None and resolved >= self._next_progress:
            self._progress(resolved, len(self.requests))
            self._next_progress = resolved + self._progress_step
        if resolved == len(self.requests):
            return
        if not self._heap:
            raise RuntimeError(f"simulation stalled at t={self.now:.3f}s: {len(self.requests) - resolved} requests "
                               "can never be scheduled (a prompt larger than a worker's KV cache?)")
        interval, tick = self.scenario.report_interval_s, tick + 1
        if not any(_would_report(worker, state) for worker, state in self._reporting):
            # No worker would report before the next event: the ticks until it do nothing, so skip to the
            # first tick at or after it (ticks stay at multiples of the interval, so the run is unchanged)
            tick = max(tick, _first_tick_at(self._heap[0][0], interval))
        self._push(tick * interval, self._report, tick)

    def _apply(self, moves: list[PoolMove]) -> None:
        for move in moves:
            worker = self.workers[move.worker_id]
            worker.set_policy(self.scenario.policy_for(move.to_pool))
            self.pool_moves[move.worker_id] += 1
            self._wake_soon(worker)

    # ---- results -------------------------------------------------------------------------
    def _result(self, seed: int) -> SimResult:
        workers = tuple(self._worker_stats(w, s) for w, s in self._reporting)
        return SimResult(self.records, workers, self.records.end_s() - self.requests[0].arrival_s, self.num_events,
                         seed, self.kv_tokens_sent, self.kv_tokens_reused, self.placements_refused,
                         tuple(self.cls.adapter_placements))

    def _worker_stats(self, worker: SimWorker, state: WorkerState) -> WorkerStats:
        return WorkerStats(worker.worker_id, self._hardware_of[worker.worker_id], state.home.value, state.pool.value,
                           worker.iterations, worker.busy_s, worker.num_prefills, self.pool_moves[worker.worker_id],
                           worker.prefill_tokens, worker.policy.adapter_swaps, worker.draft_tokens,
                           worker.accepted_tokens, worker.host_restored_tokens)
