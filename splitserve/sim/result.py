"""What a simulated run gives: its requests' records, each worker's statistics, and the report a
real run's records give (`summary`)."""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.bench.report import summarize
from splitserve.bench.slo import Baseline, SLOSpec
from splitserve.sim.records import SimRecords


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    hardware: str
    home: str         # pool at the end (re-purposing changes it)
    pool: str         # pool at the end
    iterations: int
    busy_s: float     # simulated seconds spent in iterations
    num_prefills: int  # first tokens sampled here
    pool_moves: int
    prefill_tokens: int  # prompt tokens computed here (cached ones are not)
    lora_swaps: int = 0  # LoRA adapters written into a slot here (engine/lora_residency.py)
    draft_tokens: int = 0  # drafts its decodes checked (Scenario.drafts)
    accepted_tokens: int = 0  # ... and kept
    host_restored_tokens: int = 0  # prompt tokens a prefix hit took from the host tier (Scenario.host_kv)


@dataclass(frozen=True)
class SimResult:
    records: SimRecords  # one `RequestRecord` per request, in index order
    workers: tuple[WorkerStats, ...]    # by worker id
    duration_s: float                   # first arrival to the last token (or refusal), simulated
    num_events: int
    seed: int  # as given: every seed gives the same run (the only draws, of drafts kept, are seeded by worker name)
    kv_tokens_sent: int = 0    # prompt tokens whose KV went from a prompt worker to a token worker
    kv_tokens_reused: int = 0  # prompt tokens of split requests whose KV the token worker's cache held
    placements_refused: int = 0  # placements whose token worker refused the reservation (a stale report)
    adapter_placements: tuple[int, int, int] = (0, 0, 0)  # the CLS's (ClusterState.adapter_placements)

    def summary(self, slo: SLOSpec | None = None, baseline: Baseline | None = None) -> dict:
        """`splitserve.bench.report.summarize` of the records: the report a real run gives."""
        return summarize(self.records, self.duration_s, slo, baseline, self.records.columns())
