"""The values the cluster-level scheduler (CLS) works with: pools, worker loads, requests, placements."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from splitserve.placement.hardware import HardwareProfile

MAX_PREFIX_BLOCKS = 2048  # block hashes a request names at most (its first ones: still a chain)
MAX_ADAPTER_SLOTS = 64  # LoRA adapter slots a worker reports at most (EngineConfig.max_loras' bound)
MAX_IDENTITY_CHARS = 256  # the longest adapter identity a request or report names
ADAPTER_WAITS = ("held", "idle", "busy")  # what `WorkerState.adapter_wait` 0, 1, 2 found, as reports name it
# placements a request gets while the token workers chosen refuse its reservation (the CLS placed
# by load reports the decodes since have outgrown): each excludes the ones before, then a 429
REFUSED_TRIES = 3


class Role(str, enum.Enum):
    """A pool, and the engine role of the workers in it (prompt / token / mixed policy)."""

    PROMPT = "prompt"
    TOKEN = "token"
    MIXED = "mixed"


def _require_non_negative_ints(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _require_aware_and_weights(obj: object, weights: tuple[str, ...]) -> None:
    """An `aware` switch, a bool, and weights, finite numbers >= 0."""
    if not isinstance(obj.aware, bool):
        raise ValueError(f"aware must be a bool, got {obj.aware!r}")
    for name in weights:
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _is_identity(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_IDENTITY_CHARS


def _require_hashes(obj: object, name: str, limit: int) -> None:
    value = getattr(obj, name)
    if not isinstance(value, tuple) or not all(type(h) is int for h in value):
        raise ValueError(f"{name} must be a tuple of integers (block hashes), got {type(value).__name__}")
    if len(value) > limit:
        raise ValueError(f"{name} must hold at most {limit} block hashes, got {len(value)}")


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker reports periodically (not every iteration, Splitwise IV-A)."""

    pending_prompt_tokens: int = 0  # prompt tokens not yet prefilled on it (waiting or mid-prefill)
    decode_tokens: int = 0  # context tokens (prompt + generated) of sequences decoding or importing KV on it
    num_decoding: int = 0  # sequences decoding or importing on it
    num_waiting: int = 0
    num_preempted: int = 0  # of them, preempted ones: the worker takes no import until they run again
    free_kv_tokens: int = 0  # a token is a block slot in every layer group
    total_kv_tokens: int = 0  # 0: KV capacity not reported yet, so placement skips the KV room check
    # What a sequence holds of them (`kv_tokens`): a model with sliding-window layers has them in
    # groups of their own (engine.kv_groups), whose tables stop growing at `kv_window_tokens`
    # slots (0: no windowed group); the other `kv_full_groups` of its `kv_groups` hold every token.
    kv_groups: int = 1
    kv_full_groups: int = 1
    kv_window_tokens: int = 0
    kv_growth_tokens: int = 0  # what the full groups of the sequences decoding here take to their max_tokens
    # Its LoRA adapter slots (engine/lora_residency.py): how many (0: none), the adapters they hold,
    # and how many no sequence is bound to (an adapter not held takes one of those without waiting).
    lora_slots: int = 0
    lora_resident: tuple[str, ...] = ()
    lora_idle_slots: int = 0

    def __post_init__(self) -> None:
        _require_non_negative_ints(self, ("pending_prompt_tokens", "decode_tokens", "num_decoding", "num_waiting",
                                          "num_preempted", "free_kv_tokens", "total_kv_tokens", "kv_full_groups",
                                          "kv_window_tokens", "kv_growth_tokens", "lora_slots", "lora_idle_slots"))
        if self.lora_slots > MAX_ADAPTER_SLOTS or self.lora_idle_slots > self.lora_slots:
            raise ValueError(f"lora_slots must be at most {MAX_ADAPTER_SLOTS} and lora_idle_slots at most lora_slots, "
                             f"got {self.lora_slots} and {self.lora_idle_slots}")
        if (not isinstance(self.lora_resident, tuple) or len(self.lora_resident) > self.lora_slots
                or not all(_is_identity(identity) for identity in self.lora_resident)):
            raise ValueError(f"lora_resident must be a tuple of at most lora_slots={self.lora_slots} adapter "
                             f"identities, got {self.lora_resident!r:.200}")
        if not isinstance(self.kv_groups, int) or not 1 <= self.kv_groups or self.kv_full_groups > self.kv_groups:
            raise ValueError(f"kv_groups must be an integer >= 1 and >= kv_full_groups={self.kv_full_groups}, "
                             f"got {self.kv_groups!r}")

    def kv_tokens(self, num_tokens: int) -> int:
        """The free KV tokens a sequence of `num_tokens` tokens holds here at most."""
        if not self.kv_window_tokens:
            return num_tokens
        windowed = (self.kv_groups - self.kv_full_groups) * min(num_tokens, self.kv_window_tokens)
        return -(-(self.kv_full_groups * num_tokens + windowed) // self.kv_groups)

    def import_tokens(self, num_tokens: int, max_tokens: int) -> int:
        """The free KV tokens an import of `num_tokens` tokens that may generate `max_tokens` asks
        here: what it holds, and with a windowed group room for the full groups' growth, its own and
        the decodes' here, at most what its window skips: never more than a whole prompt's
        (`Policy.reserve_import`)."""
        if not self.kv_window_tokens:
            return num_tokens
        growth = -(-self.kv_full_groups * max_tokens // self.kv_groups) + self.kv_growth_tokens
        return min(num_tokens, self.kv_tokens(num_tokens) + growth)

    @property
    def idle(self) -> bool:
        """Nothing queued, prefilling, decoding or importing."""
        return self.pending_prompt_tokens == self.num_decoding == self.num_waiting == 0


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    # an earlier choice of the same prompt (`n` > 1): its workers hold the prompt's KV in their
    # prefix caches, so the request goes there while they still qualify
    follow: Placement | None = None
    # the hashes of the prompt's leading full blocks, as a prefix-cache lookup tries them
    # (engine/prefix_hash.py: prompt_block_hashes), for prefix-aware placement; () names none
    prefix_hashes: tuple[int, ...] = ()
    priority: int = 0  # SamplingParams.priority: above 0, background work (`PlacementThresholds.background_share`)
    lora: str | None = None  # the identity of the LoRA adapter it runs under (None: the base model)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if self.lora is not None and not _is_identity(self.lora):
            raise ValueError(f"lora must be None or an adapter identity of 1 to {MAX_IDENTITY_CHARS} characters, "
                             f"got {self.lora!r:.80}")
        if not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if not isinstance(self.num_prompt_tokens, int) or self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be an integer >= 1, got {self.num_prompt_tokens!r}")
        _require_non_negative_ints(self, ("max_tokens",))
        if self.prefix_hashes:
            _require_hashes(self, "prefix_hashes", MAX_PREFIX_BLOCKS)

    @property
    def prompt_only(self) -> bool:
        """Its one token is the one its prefill samples (max_tokens 1: a prompt scored, a one-token
        answer): nothing decodes, so it runs whole on a prompt worker and no KV moves."""
        return self.max_tokens <= 1


@dataclass(frozen=True)
class Placement:
    prompt_worker: str
    token_worker: str
    lora_identity: str | None = None  # the LoRA adapter's identity the CLS placed the request under

    @property
    def local(self) -> bool:
        """Same worker: the whole request runs there with mixed batching, no KV transfer."""
        return self.prompt_worker == self.token_worker


@dataclass(frozen=True)
class PoolMove:
    """A worker changing pool; the controller switches its engine role to `to_pool.value`."""

    worker_id: str
    to_pool: Role
    reason: str
    repurposed: bool = False  # its home pool changed too: the new home is `to_pool`


@dataclass(frozen=True)
class PlacementThresholds:
    """Queues are speed-weighted token counts (see `WorkerState.prompt_queue` / `token_queue`)."""

    mixed_prompt_tokens: float = 2048  # a prompt queue above this overflows into the mixed pool
    mixed_decode_tokens: float = 65536  # same for a token queue
    max_queue_tokens: float = 16384  # backpressure: a worker whose prompt queue is this long takes nothing more
    repurpose_after_s: float = 60.0  # in the mixed pool this long without a break: home pool changes (one per period)
    max_decode_queue_tokens: float = 262144  # backpressure on token queues; above mixed_decode_tokens so overflow acts
    # a request of priority above 0 is placed only while some worker's prompt queue is under this
    # share of max_queue_tokens: the rest is kept for requests of priority 0 and below
    background_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("mixed_prompt_tokens", "mixed_decode_tokens", "max_queue_tokens", "repurpose_after_s",
                     "max_decode_queue_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (isinstance(self.background_share, (int, float)) and 0 < self.background_share <= 1):
            raise ValueError(f"background_share must be in (0, 1], got {self.background_share!r}")


@dataclass(frozen=True)
class PrefixOptions:
    """Prefix-aware placement (`affinity.py`): a worker's queue, less the work its cached prefix
    of the request saves. Weights are per cached prompt token."""

    aware: bool = True  # False: placement blind to prefix caches
    prefill_saved_weight: float = 1.0  # prompt-queue tokens saved on a prompt or mixed worker, before its speed
    transfer_saved_weight: float = 1.0  # token-queue tokens saved on a token worker (KV it need not receive)
    max_index_blocks: int = 1 << 20  # (worker, block) entries the prefix index keeps at most

    def __post_init__(self) -> None:
        _require_aware_and_weights(self, ("prefill_saved_weight", "transfer_saved_weight"))
        if not isinstance(self.max_index_blocks, int) or self.max_index_blocks < 1:
            raise ValueError(f"max_index_blocks must be an integer >= 1, got {self.max_index_blocks!r}")


@dataclass(frozen=True)
class AdapterOptions:
    """LoRA-aware placement (`affinity.py`): a worker that does not hold a request's adapter in a
    slot counts as more loaded, by a share of each overflow threshold (`mixed_prompt_tokens` on the
    prompt side, `mixed_decode_tokens` on the token side, 1 = the whole threshold, in
    `base.combined_load` for a worker running it whole): `swap_share` where a slot no sequence is
    bound to takes it (a copy from host memory, and the adapter it evicts), `wait_share` where every
    slot is busy with other adapters (the request waits for one)."""

    aware: bool = True  # False: placement blind to adapter slots
    swap_share: float = 0.05
    wait_share: float = 1.0

    def __post_init__(self) -> None:
        _require_aware_and_weights(self, ("swap_share", "wait_share"))


@dataclass(frozen=True)
class PrefixDelta:
    """What a worker reports of its prefix cache (`BlockManager.take_prefix_delta`): the block
    hashes cached (oldest first) and evicted since its last report, or with `snapshot` everything
    it holds (in `added`), which replaces what the CLS knew."""

    block_size: int  # tokens per block
    num_blocks: int  # the blocks its prefix cache can hold (its KV cache's and host tier's): it never holds more
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    snapshot: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        _require_non_negative_ints(self, ("num_blocks",))
        _require_hashes(self, "added", self.num_blocks)
        _require_hashes(self, "removed", self.num_blocks)


@dataclass(slots=True)
class WorkerState:
    """The CLS's live view of one worker: its last report plus what was placed on it since."""

    worker_id: str
    home: Role  # the pool it belongs to; it returns there from the mixed pool
    hardware: HardwareProfile
    pool: Role  # the pool it serves in now
    load: WorkerLoad
    placed_prompt_tokens: int = 0  # placed here since its last report (a report replaces the estimate)
    placed_decode_tokens: int = 0
    placed_kv_tokens: int = 0  # the KV (load.kv_tokens) of the sequences placed_decode_tokens counts
    mixed_since: float | None = None  # when it entered the mixed pool as a guest (None: not a guest there)
    reported_at: float = 0.0  # time of its last report (or of joining)
    placed_adapters: tuple[str, ...] = ()  # adapters not in a slot by its last report, placed here since

    def adapter_wait(self, identity: str | None) -> int:
        """What running under adapter `identity` here needs: 0 nothing (no adapter, or it is in a
        slot, or was placed here since the report), 1 a swap into an idle slot (or no slots
        reported yet: a worker starts with empty ones), 2 a wait for a slot (every one bound to
        other adapters' sequences, or taken by those placed since)."""
        if identity is None or identity in self.load.lora_resident or identity in self.placed_adapters:
            return 0
        return 1 if self.has_idle_slot() else 2

    def has_idle_slot(self) -> bool:
        """An adapter it does not hold takes a slot at once: one was idle by its report and not
        taken by those placed since (or it has reported no slots yet: a worker starts with empty ones)."""
        return not self.load.lora_slots or self.load.lora_idle_slots > len(self.placed_adapters)

    def prompt_queue(self) -> float:
        return (self.load.pending_prompt_tokens + self.placed_prompt_tokens) / self.hardware.prompt_speed

    def token_queue(self) -> float:
        return (self.load.decode_tokens + self.placed_decode_tokens) / self.hardware.token_speed

    def free_kv_tokens(self) -> int:
        return self.load.free_kv_tokens - self.placed_kv_tokens
