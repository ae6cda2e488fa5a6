"""What a worker did between two reports to the CLS, for the cluster's metrics: observations
(one per step, request or transfer) since the last report, and running totals."""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.outputs import StepStats
from splitserve.transfer.exporter import TransferStats


@dataclass(frozen=True)
class WorkerStats:
    steps: tuple[StepStats, ...] = ()
    queue_seconds: tuple[float, ...] = ()        # per request: arrival to its first step here
    transfers: tuple[TransferStats, ...] = ()    # per step that pushed KV
    preemptions: int = 0                         # running totals from here on
    kv_bytes_sent: int = 0
    kv_tokens_reused: int = 0                    # imported prompt tokens whose KV the prefix cache held (not received)
    kv_failures: int = 0
    leases_expired: int = 0                      # KV reservations / prefills that outlived their lease
    step_failures: int = 0                       # steps that raised (their requests failed over)
    aborted_requests: int = 0                    # requests stopped here before they finished
    lora_swaps: int = 0                          # LoRA adapters copied into a device slot from host memory
    kv_host_saved_tokens: int = 0                # the prefix cache's evicted tokens kept in host memory (host tier)
    kv_host_restored_tokens: int = 0             # and copied back for a prefix hit
    kv_blocks_used: int = 0                      # now
    kv_blocks_free: int = 0


class StatsRecorder:
    """Collects on the engine thread; `drain` hands over and starts afresh (totals keep counting)."""

    def __init__(self):
        self._steps: list[StepStats] = []
        self._queue: list[float] = []
        self._transfers: list[TransferStats] = []
        self.kv_failures = self.leases_expired = self.step_failures = self.aborted_requests = 0

    def step(self, stats: StepStats) -> None:
        self._steps.append(stats)

    def queued(self, seconds: float) -> None:
        self._queue.append(seconds)

    def transfer(self, stats: TransferStats) -> None:
        self._transfers.append(stats)

    def drain(self, preemptions: int, kv_bytes_sent: int, kv_tokens_reused: int, blocks_used: int,
              blocks_free: int, lora_swaps: int = 0, host_tokens: tuple[int, int] = (0, 0)) -> WorkerStats:
        """`host_tokens`: the host tier's tokens saved and restored so far."""
        stats = WorkerStats(tuple(self._steps), tuple(self._queue), tuple(self._transfers), preemptions,
                            kv_bytes_sent, kv_tokens_reused, self.kv_failures, self.leases_expired, self.step_failures,
                            self.aborted_requests, lora_swaps, *host_tokens, blocks_used, blocks_free)
        self._steps, self._queue, self._transfers = [], [], []
        return stats
