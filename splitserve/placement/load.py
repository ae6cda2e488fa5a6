"""What a worker reports to the CLS, computed from its scheduler's queues and block manager: one
definition for the real worker (`WorkerLoop.load`) and the simulated one (`SimWorker.load`)."""
from __future__ import annotations

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies import Policy
from splitserve.placement.state import PrefixDelta, WorkerLoad


def load_of(policy: Policy, blocks: BlockManager) -> WorkerLoad:
    """Prompt tokens still to prefill here (handed-off ones included); decode load: sequences that
    decode here, imports included (their KV is arriving); their full layer groups' growth to their
    max_tokens, in KV tokens rounded up (what a windowed import leaves room for); LoRA adapter slots."""
    queued = [*policy.waiting, *policy.running]
    adapters = policy.adapters
    local = [s for s in (*queued, *policy.held.values()) if not s.hand_off]
    return WorkerLoad(
        pending_prompt_tokens=sum(s.num_uncomputed_tokens for s in queued if not s.is_decoding),
        decode_tokens=sum(s.num_tokens for s in local), num_decoding=len(local),
        num_waiting=len(policy.waiting), num_preempted=policy.num_preempted_waiting,
        free_kv_tokens=blocks.tokens_of(blocks.num_free_blocks),
        total_kv_tokens=blocks.tokens_of(blocks.num_blocks), kv_groups=blocks.num_groups,
        kv_full_groups=blocks.windows.count(None), kv_window_tokens=blocks.window_tokens,
        kv_growth_tokens=-(-sum(map(blocks.full_growth, policy.decodes())) // blocks.num_groups) * blocks.block_size,
        **({} if adapters is None else dict(lora_slots=len(adapters.identity), lora_resident=adapters.resident(),
                                            lora_idle_slots=adapters.idle_slots())))


def prefix_delta_of(blocks: BlockManager, snapshot: bool) -> PrefixDelta:
    """The prefix cache's change since the last call, or with `snapshot` everything it holds."""
    if snapshot:
        return PrefixDelta(blocks.block_size, blocks.num_cacheable_blocks, blocks.take_prefix_snapshot(), snapshot=True)
    added, removed = blocks.take_prefix_delta()
    return PrefixDelta(blocks.block_size, blocks.num_cacheable_blocks, added, removed)
