"""Helpers shared by the scheduling-policy tests (test_policies, test_policy_lifecycle,
test_policy_simulation): a policy is driven the way the engine drives it, `schedule()` -> fake
sampled tokens -> `complete_step()`."""
from __future__ import annotations

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies import SchedulerLimits, make_policy
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence

EOS = 999
BS = 4


def make_seq(seq_id: str, n: int, start: int = 0, **params) -> Sequence:
    """A sequence with prompt `start .. start + n - 1` (distinct starts: no accidental prefix hits)."""
    params.setdefault("max_tokens", 16)
    return Sequence(seq_id, list(range(start, start + n)), SamplingParams(**params),
                    eos_token_ids=frozenset({EOS}))


def make(name: str, num_blocks: int = 64, block_size: int = BS, prefix: bool = True, **limits):
    return make_policy(name, BlockManager(num_blocks, block_size, prefix), SchedulerLimits(**limits))


def shape(plan) -> list[tuple[str, int]]:
    return [(item.seq.seq_id, item.num_new_tokens) for item in plan.scheduled]


def complete(policy, plan, token: int = 7, tokens: dict[str, int] | None = None):
    sampled = {item.seq.seq_id: ((tokens or {}).get(item.seq.seq_id, token),)
               for item in plan.scheduled if item.samples}
    updated = policy.complete_step(plan, sampled)
    policy.blocks.check_integrity()
    return updated


def step(policy, token: int = 7, tokens: dict[str, int] | None = None):
    plan = policy.schedule()
    policy.blocks.check_integrity()
    return plan, complete(policy, plan, token, tokens)


def import_seq(policy, seq: Sequence, first_token: int = 7) -> Sequence:
    policy.reserve_import(seq)
    return policy.complete_import(seq.seq_id, first_token)
