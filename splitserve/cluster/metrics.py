"""The cluster's Prometheus metrics (prefix `splitserve_`), in one registry held by the CLS actor.

How Prometheus finds them: every ingress replica serves `GET /metrics` on the Serve HTTP port
and answers with this registry's text, so any replica gives the same cluster-wide view (scrape
the Serve service, e.g. `http://127.0.0.1:8000/metrics`). Feeding it:
- ingress replicas batch one `RequestObservation` per finished request and send them to the CLS
  (each second, and before answering a scrape), its times between tokens already bucketed;
- workers hand their `WorkerStats` to the CLS's load poll, with their load;
- the CLS itself records pools, pool moves and worker failures.
Series that only move on rare events (restarts, failures, transitions) start at zero. Request
series carry a `lora` label: the LoRA adapter the request named, "" for the base model, and a
`kind` label: `generate` (completions, chat, responses) or `pooling` (embeddings, /score and /rerank:
a prefill whose answer is no token, so no TTFT or TBT, its end to end the time to its vectors).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.cluster.bucket_counts import BucketCounts, CountedHistogram
from splitserve.cluster.worker_stats import WorkerStats
from splitserve.placement.state import ADAPTER_WAITS, Role, WorkerLoad

if TYPE_CHECKING:
    from splitserve.engine.sampling_params import SamplingParams

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
OUTCOMES = ("completed", "failed", "rejected", "aborted")
SLOS = ("ttft", "tbt", "e2e")
WORKER_LABELS = ("model", "worker", "pool", "hardware")
REQUEST_LABELS = ("model", "lora", "kind")
REQUEST_KINDS = ("generate", "pooling")


def kind_of(params: SamplingParams) -> str:
    """A request's `kind` label: pooling where it asks for its prompt's vectors, else generate."""
    return "pooling" if params.embed else "generate"


@dataclass(frozen=True)
class RequestObservation:
    """One finished request as the client saw it (times in seconds; None where it never got there)."""

    outcome: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0  # of its prompt tokens, those whose KV the prefix cache held
    ttft: float | None = None
    tbt: BucketCounts | None = None  # its times between tokens, over LATENCY_BUCKETS (None: no token)
    e2e: float | None = None
    restarts: int = 0
    refused_placements: int = 0  # placements whose token worker refused the reservation
    lora: str | None = None  # the LoRA adapter it ran under
    kind: str = "generate"   # one of REQUEST_KINDS


@dataclass(frozen=True)
class SLOBounds:
    ttft: float
    tbt: float  # per request: its mean time between tokens
    e2e: float


class ClusterMetrics:
    def __init__(self, model: str, slo: SLOBounds, adapters: tuple[str, ...] = ()):
        """`adapters`: the LoRA adapters' names (their request series start at zero too)."""
        self.model, self.slo = model, slo
        self.registry = CollectorRegistry()
        self._define_requests(adapters)
        self._define_workers()
        self._define_pools()
        self._worker_labels: dict[str, tuple[str, ...]] = {}
        self._totals: dict[str, WorkerStats] = {}

    # ---- definitions ------------------------------------------------------------------------
    def _histogram(self, name: str, doc: str, labels=("model",), buckets=LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def _define_requests(self, adapters: tuple[str, ...]) -> None:
        self.ttft = self._histogram("splitserve_request_ttft_seconds", "Time to first token, at the ingress",
                                    REQUEST_LABELS)
        self.tbt = CountedHistogram("splitserve_request_tbt_seconds", "Time between tokens, at the ingress",
                                    REQUEST_LABELS, LATENCY_BUCKETS, self.registry)
        self.e2e = self._histogram("splitserve_request_e2e_seconds", "End-to-end request latency", REQUEST_LABELS)
        self.queue = self._histogram("splitserve_request_queue_seconds",
                                     "Time a request waited in a worker's queue before its prefill").labels(self.model)
        self.requests = Counter("splitserve_requests", "Requests by outcome", (*REQUEST_LABELS, "outcome"),
                                registry=self.registry)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens", REQUEST_LABELS,
                                     registry=self.registry)
        self.generation_tokens = Counter("splitserve_generation_tokens", "Generated tokens", REQUEST_LABELS,
                                         registry=self.registry)
        self.cached_prompt_tokens = Counter("splitserve_prompt_cached_tokens", "Prompt tokens whose KV the prefill's "
                                            "prefix cache held (usage's cached_tokens)", REQUEST_LABELS,
                                            registry=self.registry)
        self.slo_requests = Counter("splitserve_slo_requests", "Completed requests checked against an SLO",
                                    (*REQUEST_LABELS, "slo"), registry=self.registry)
        self.slo_met = Counter("splitserve_slo_met", "Completed requests within an SLO", (*REQUEST_LABELS, "slo"),
                               registry=self.registry)
        self.restarted = Counter("splitserve_requests_restarted", "Requests placed again after a failure",
                                 REQUEST_LABELS, registry=self.registry)
        self.refused_placements = Counter("splitserve_placements_refused", "Placements whose token worker refused "
                                          "the reservation (the CLS placed by a stale load report): the request was "
                                          "placed again, or answered 429", REQUEST_LABELS, registry=self.registry)
        for lora, kind in ((lora, kind) for lora in ("", *adapters) for kind in REQUEST_KINDS):
            labels = (self.model, lora, kind)
            for family in (self.ttft, self.e2e, self.prompt_tokens, self.generation_tokens, self.cached_prompt_tokens,
                           self.restarted, self.refused_placements):
                family.labels(*labels)
            self.tbt.start(labels)
            for outcome in OUTCOMES:
                self.requests.labels(*labels, outcome)
            for slo in SLOS:
                self.slo_requests.labels(*labels, slo), self.slo_met.labels(*labels, slo)

    def _define_workers(self) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, WORKER_LABELS, registry=self.registry)

        self.pending_prompt = gauge("splitserve_worker_pending_prompt_tokens", "Prompt tokens not yet prefilled")
        self.decode_tokens = gauge("splitserve_worker_decode_tokens", "Context tokens of sequences decoding here")
        self.running = gauge("splitserve_worker_running_requests", "Requests decoding or importing here")
        self.waiting = gauge("splitserve_worker_waiting_requests", "Requests waiting for their prefill")
        self.blocks_used = gauge("splitserve_worker_kv_blocks_used", "KV cache blocks in use")
        self.blocks_free = gauge("splitserve_worker_kv_blocks_free", "KV cache blocks free")
        self.preemptions = Counter("splitserve_worker_preemptions", "Sequences preempted (recomputed later)",
                                   WORKER_LABELS, registry=self.registry)
        self.batch_tokens = self._histogram("splitserve_worker_batch_tokens", "Tokens per iteration",
                                            WORKER_LABELS, TOKEN_BUCKETS)
        self.step_seconds = self._histogram("splitserve_worker_step_seconds", "Iteration time by phase",
                                            (*WORKER_LABELS, "phase"))
        self.kv_bytes = Counter("splitserve_kv_transfer_bytes", "KV bytes sent", ("model", "worker"),
                                registry=self.registry)
        self.lora_swaps = Counter("splitserve_worker_lora_swaps", "LoRA adapters copied into a device slot from "
                                  "host memory (engine.max_cpu_loras past max_loras)", ("model", "worker"),
                                  registry=self.registry)
        self.prefill_tokens = Counter("splitserve_worker_prefill_tokens", "Prompt tokens prefilled (computed)",
                                      ("model", "worker"), registry=self.registry)
        self.draft_tokens = Counter("splitserve_spec_decode_draft_tokens", "Tokens decodes drafted by n-gram lookup "
                                    "and a step checked (engine.num_speculative_tokens)", ("model", "worker"),
                                    registry=self.registry)
        self.accepted_tokens = Counter("splitserve_spec_decode_accepted_tokens", "Drafted tokens the check kept (each "
                                       "one a step saved)", ("model", "worker"), registry=self.registry)
        self.host_saved = Counter("splitserve_kv_host_saved_tokens", "Tokens of prefix-cache blocks the KV cache "
                                  "evicted into host memory (engine.kv_host_cache_bytes)", ("model", "worker"),
                                  registry=self.registry)
        self.host_restored = Counter("splitserve_kv_host_restored_tokens", "Tokens of prefix-cache blocks copied "
                                     "back from host memory for a prefix hit (not computed again)", ("model", "worker"),
                                     registry=self.registry)
        self.kv_reused = Counter("splitserve_kv_import_reused_tokens", "Imported prompt tokens whose KV the token "
                                 "worker's prefix cache held (not received)", ("model", "worker"), registry=self.registry)
        self.kv_visible = self._histogram("splitserve_kv_transfer_visible_seconds",
                                          "KV transfer time on the critical path, per step", ("model", "worker"))
        self.kv_overlap = self._histogram("splitserve_kv_transfer_overlap_ratio",
                                          "Fraction of the KV transfer hidden behind compute", ("model", "worker"),
                                          RATIO_BUCKETS)
        self.kv_failures = Counter("splitserve_kv_transfer_failures", "Requests whose KV transfer failed",
                                   ("model", "worker"), registry=self.registry)
        self.leases_expired = Counter("splitserve_kv_leases_expired", "KV reservations and prefills cancelled when "
                                      "their lease ran out (blocks freed)", ("model", "worker"), registry=self.registry)
        self.step_failures = Counter("splitserve_worker_step_failures", "Engine steps that raised (their requests "
                                     "failed over)", ("model", "worker"), registry=self.registry)
        self.worker_aborts = Counter("splitserve_worker_aborted_requests", "Requests a worker stopped before they "
                                     "finished (client gone, stop string, failover)", ("model", "worker"),
                                     registry=self.registry)

    def _define_pools(self) -> None:
        self.pool_workers = Gauge("splitserve_pool_workers", "Workers per pool and hardware class",
                                  ("model", "pool", "hardware"), registry=self.registry)
        self.transitions = Counter("splitserve_pool_transitions", "Workers moved between pools",
                                   ("model", "from_pool", "to_pool"), registry=self.registry)
        self.mixed_occupancy = Gauge("splitserve_mixed_pool_occupancy", "Fraction of workers in the mixed pool",
                                     ("model",), registry=self.registry).labels(self.model)
        self.worker_failures = Counter("splitserve_worker_failures", "Workers that died or were replaced as "
                                       "unhealthy or stuck", ("model",),
                                       registry=self.registry).labels(self.model)
        self.lora_placements = Counter("splitserve_lora_placements", "Workers placed on under a LoRA adapter, by "
                                       "what their slots held by the last report (and placements since): the "
                                       "adapter (held), an idle slot to take it (idle), or every slot busy with "
                                       "other adapters: the request waits for one there (busy)",
                                       ("model", "slot"), registry=self.registry)
        self._adapter_placements = [0, 0, 0]
        for slot in ADAPTER_WAITS:
            self.lora_placements.labels(self.model, slot)
        for origin, target in (("prompt", "mixed"), ("token", "mixed"), ("mixed", "prompt"), ("mixed", "token"),
                               ("prompt", "token"), ("token", "prompt")):
            self.transitions.labels(self.model, origin, target)

    # ---- recording --------------------------------------------------------------------------
    def record_requests(self, observations: list[RequestObservation]) -> None:
        for obs in observations:
            labels = (self.model, obs.lora or "", obs.kind)
            self.requests.labels(*labels, obs.outcome).inc()
            self.prompt_tokens.labels(*labels).inc(obs.prompt_tokens)
            self.generation_tokens.labels(*labels).inc(obs.generated_tokens)
            self.cached_prompt_tokens.labels(*labels).inc(obs.cached_prompt_tokens)
            self.restarted.labels(*labels).inc(obs.restarts)
            self.refused_placements.labels(*labels).inc(obs.refused_placements)
            if obs.outcome == "completed":
                self._record_latencies(obs, labels)

    def _record_latencies(self, obs: RequestObservation, labels: tuple[str, str, str]) -> None:
        if obs.ttft is not None:
            self.ttft.labels(*labels).observe(obs.ttft)
        if obs.tbt is not None:
            self.tbt.add(labels, obs.tbt)
        if obs.e2e is not None:
            self.e2e.labels(*labels).observe(obs.e2e)
        mean_tbt = obs.tbt.mean if obs.tbt is not None else 0.0
        for slo, value, bound in (("ttft", obs.ttft, self.slo.ttft), ("tbt", mean_tbt, self.slo.tbt),
                                  ("e2e", obs.e2e, self.slo.e2e)):
            if value is not None:
                self.slo_requests.labels(*labels, slo).inc()
                if value <= bound:
                    self.slo_met.labels(*labels, slo).inc()

    def record_worker(self, worker_id: str, pool: Role, hardware: str, load: WorkerLoad, stats: WorkerStats) -> None:
        labels = (self.model, worker_id, pool.value, hardware)
        self._relabel(worker_id, labels)
        for gauge, value in ((self.pending_prompt, load.pending_prompt_tokens), (self.decode_tokens, load.decode_tokens),
                             (self.running, load.num_decoding), (self.waiting, load.num_waiting),
                             (self.blocks_used, stats.kv_blocks_used), (self.blocks_free, stats.kv_blocks_free)):
            gauge.labels(*labels).set(value)
        for step in stats.steps:
            self.batch_tokens.labels(*labels).observe(step.prefill_tokens + step.decode_tokens)
            self.step_seconds.labels(*labels, step.phase).observe(step.seconds)
        for counter, field in ((self.prefill_tokens, "prefill_tokens"), (self.draft_tokens, "draft_tokens"),
                               (self.accepted_tokens, "accepted_tokens")):
            counter.labels(self.model, worker_id).inc(sum(getattr(step, field) for step in stats.steps))
        for seconds in stats.queue_seconds:
            self.queue.observe(seconds)
        self._record_transfers(worker_id, labels, stats)

    def _record_transfers(self, worker_id: str, labels: tuple[str, ...], stats: WorkerStats) -> None:
        last = self._totals.get(worker_id, WorkerStats())
        self.preemptions.labels(*labels).inc(max(0, stats.preemptions - last.preemptions))
        sender = (self.model, worker_id)
        self.kv_bytes.labels(*sender).inc(max(0, stats.kv_bytes_sent - last.kv_bytes_sent))
        self.kv_reused.labels(*sender).inc(max(0, stats.kv_tokens_reused - last.kv_tokens_reused))
        for counter, now, before in ((self.kv_failures, stats.kv_failures, last.kv_failures),
                                     (self.leases_expired, stats.leases_expired, last.leases_expired),
                                     (self.step_failures, stats.step_failures, last.step_failures),
                                     (self.worker_aborts, stats.aborted_requests, last.aborted_requests),
                                     (self.lora_swaps, stats.lora_swaps, last.lora_swaps),
                                     (self.host_saved, stats.kv_host_saved_tokens, last.kv_host_saved_tokens),
                                     (self.host_restored, stats.kv_host_restored_tokens, last.kv_host_restored_tokens)):
            counter.labels(*sender).inc(max(0, now - before))
        for transfer in stats.transfers:
            self.kv_visible.labels(*sender).observe(transfer.visible_seconds)
            self.kv_overlap.labels(*sender).observe(transfer.overlap_ratio)
        self._totals[worker_id] = stats

    def _relabel(self, worker_id: str, labels: tuple[str, ...]) -> None:
        """A worker that changed pool drops its series under the old pool label."""
        old = self._worker_labels.get(worker_id)
        if old is not None and old != labels:
            self._drop_series(old)
        self._worker_labels[worker_id] = labels

    def remove_worker(self, worker_id: str) -> None:
        """Its series go (a replacement comes under a new id: kept, they would pile up)."""
        labels = self._worker_labels.pop(worker_id, None)
        if labels is not None:
            self._drop_series(labels)
        for metric in (self.kv_bytes, self.prefill_tokens, self.draft_tokens, self.accepted_tokens, self.kv_reused,
                       self.kv_visible, self.kv_overlap, self.kv_failures, self.leases_expired, self.step_failures,
                       self.worker_aborts, self.lora_swaps, self.host_saved, self.host_restored):
            _remove(metric, (self.model, worker_id))
        self._totals.pop(worker_id, None)

    def _drop_series(self, labels: tuple[str, ...]) -> None:
        for metric in (self.pending_prompt, self.decode_tokens, self.running, self.waiting, self.blocks_used,
                       self.blocks_free, self.preemptions, self.batch_tokens):
            _remove(metric, labels)
        for phase in ("prefill", "decode", "mixed"):
            _remove(self.step_seconds, (*labels, phase))

    def record_pools(self, members: dict[str, tuple[Role, str]]) -> None:
        """Pool sizes now: worker id -> (pool, hardware)."""
        self.pool_workers.clear()
        counts: dict[tuple[str, str], int] = {}
        for pool, hardware in members.values():
            counts[pool.value, hardware] = counts.get((pool.value, hardware), 0) + 1
        for hardware in {hw for _, hw in members.values()}:  # every pool of a class, 0 when empty
            for pool in Role:
                self.pool_workers.labels(self.model, pool.value, hardware).set(counts.get((pool.value, hardware), 0))
        mixed = sum(1 for pool, _ in members.values() if pool is Role.MIXED)
        self.mixed_occupancy.set(mixed / len(members) if members else 0.0)

    def record_adapter_placements(self, totals: list[int]) -> None:
        """The CLS's counts so far (`ClusterState.adapter_placements`)."""
        for slot, total, before in zip(ADAPTER_WAITS, totals, self._adapter_placements):
            self.lora_placements.labels(self.model, slot).inc(total - before)
        self._adapter_placements = list(totals)

    def record_transition(self, origin: Role, target: Role) -> None:
        self.transitions.labels(self.model, origin.value, target.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _remove(metric, labels: tuple[str, ...]) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # that series was never created
        pass
