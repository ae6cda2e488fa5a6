"""Randomized simulations of the scheduling policies (`splitserve.engine.policies`), no model.

The simulations also simulate the KV cache itself: every slot a step (or a KV import) writes
records an id of the whole token prefix up to that position, and before a step computes
`token_ids[start:start + n]` every position < start must read back its own prefix id through the
block table. That checks that policies only ever schedule work whose context KV is really there
(chunking, preemption by recompute, prefix sharing, imports).
"""
from __future__ import annotations

import random

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.policies import SchedulerLimits, SLOOptions, make_policy
from splitserve.engine.policies.base import WATERMARK_FRACTION
from splitserve.engine.policies.orca import MAX_SKIPS
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence, SequenceStatus
from tests.engine.policy_helpers import EOS

# ---------------------------------------------------------------------------------------------
# randomized simulations
# ---------------------------------------------------------------------------------------------

class FakeKV:
    """Slot -> id of the token prefix whose last token's KV sits there."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.slots: dict[int, int] = {}
        self._prefix_ids: dict[int, list[int]] = {}

    def prefix_id(self, seq: Sequence, pos: int) -> int:
        ids = self._prefix_ids.setdefault(id(seq), [])
        while len(ids) <= pos:
            ids.append(hash((ids[-1] if ids else None, seq.token_ids[len(ids)])))
        return ids[pos]

    def slot(self, seq: Sequence, pos: int) -> int:
        table = self.blocks.block_table(seq.seq_id)
        assert pos // self.blocks.block_size < len(table), f"{seq.seq_id}: no block for position {pos}"
        return table[pos // self.blocks.block_size] * self.blocks.block_size + pos % self.blocks.block_size

    def check(self, seq: Sequence, upto: int) -> None:
        for pos in range(upto):
            assert self.slots.get(self.slot(seq, pos)) == self.prefix_id(seq, pos), \
                f"{seq.seq_id}: stale KV at position {pos}"

    def write(self, seq: Sequence, start: int, n: int) -> None:
        for pos in range(start, start + n):
            self.slots[self.slot(seq, pos)] = self.prefix_id(seq, pos)


def expected_outputs(tokens: list[int], params: SamplingParams, prompt_len: int, max_model_len: int):
    """The stop rules, written out independently."""
    out = []
    for tok in tokens:
        out.append(tok)
        if len(out) >= params.min_tokens and (tok in params.stop_token_ids or (not params.ignore_eos and tok == EOS)):
            return out, "stop"
        if len(out) >= params.max_tokens or prompt_len + len(out) >= max_model_len:
            return out, "length"
    raise AssertionError("token stream too short")


class Sim:
    """Requests with shared prefixes arrive at random steps; a few are aborted; sampled tokens are a
    fixed function of (request, output index), so preemption must not change any output."""

    MAX_MODEL_LEN = 64

    def __init__(self, seed: int, name: str):
        rng = self.rng = random.Random(seed)
        self.name = name
        self.num_requests = 40
        bases = [[rng.randrange(6) for _ in range(rng.randint(4, 30))] for _ in range(4)]
        self.requests = []
        for i in range(self.num_requests):
            base = rng.choice(bases)
            prompt = base[:rng.randint(0, len(base))] + [rng.randrange(6) for _ in range(rng.randint(1, 12))]
            max_tokens = rng.randint(1, 30)
            slos = {"ttft_slo_s": rng.choice([None, 0.05, 2.0]), "tbt_slo_s": rng.choice([None, 0.03, 0.5])}
            params = SamplingParams(max_tokens=max_tokens, min_tokens=min(max_tokens, rng.choice([0, 0, 2])),
                                    ignore_eos=rng.random() < 0.3,
                                    stop_token_ids=[5] if rng.random() < 0.3 else [], **slos)
            tokens = [EOS if rng.random() < 0.05 else rng.randrange(6) for _ in range(self.MAX_MODEL_LEN)]
            self.requests.append((str(i), prompt, params, tokens))
        self.arrivals = sorted(rng.randrange(60) for _ in range(self.num_requests))

    def limits(self) -> SchedulerLimits:
        rng = self.rng
        # accelgen: 16 tokens take 10 ms (a 0.03 s TBT allows 48 tokens), prompts of 20+ tokens are long
        slo = SLOOptions(pivot_tokens=16, pivot_time_s=0.01, tile_tokens=4, max_budget_tokens=rng.choice([8, 64]),
                         window_s=0.05, long_prompt_tokens=20, default_ttft_s=0.2, default_tbt_s=0.1)
        return SchedulerLimits(max_num_seqs=rng.choice([2, 6, 64]), max_model_len=self.MAX_MODEL_LEN,
                               prompt_token_budget=rng.choice([8, 32, 128]),
                               chunk_token_budget=rng.choice([3, 16, 64]), slo=slo,
                               prompt_chunk_tokens=rng.choice([8192, 5, 24]))

    def blocks(self, block_size: int | None = None) -> BlockManager:
        rng = self.rng
        block_size = block_size or rng.choice([1, 4, 8])
        # at least max_model_len tokens, plus the admission watermark (>= 100 blocks keep one)
        min_blocks = -(-self.MAX_MODEL_LEN // block_size)
        num_blocks = rng.choice([min_blocks, min_blocks + 3, 2 * min_blocks, 120])
        num_blocks = max(num_blocks, min_blocks + int(WATERMARK_FRACTION * num_blocks))
        return BlockManager(num_blocks, block_size, enable_prefix_caching=rng.random() < 0.8)

    def new_seq(self, index: int) -> Sequence:
        seq_id, prompt, params, _ = self.requests[index]
        return Sequence(seq_id, list(prompt), params, eos_token_ids=frozenset({EOS}))

    def token_for(self, seq: Sequence) -> int:
        return self.requests[int(seq.seq_id)][3][seq.num_output_tokens]

    def run_policy_step(self, policy, kv: FakeKV) -> None:
        """schedule, check the plan, simulate the model (KV reads and writes), complete."""
        running_before = {s.seq_id: s.is_decoding for s in policy.running}
        waiting_before = {s.seq_id for s in policy.waiting}
        plan = policy.schedule()
        policy.blocks.check_integrity()
        self.check_plan(policy, plan, running_before, waiting_before)
        for item in plan.scheduled:
            kv.check(item.seq, item.start)
            kv.write(item.seq, item.start, item.num_new_tokens)
        sampled = {item.seq.seq_id: (self.token_for(item.seq),) for item in plan.scheduled if item.samples}
        policy.complete_step(plan, sampled)
        policy.blocks.check_integrity()
        self.check_state(policy)

    def check_plan(self, policy, plan, running_before, waiting_before) -> None:
        """Every policy's invariants, then its own rules."""
        items = plan.scheduled
        ids = [item.seq.seq_id for item in items]
        assert len(set(ids)) == len(ids)
        limits = policy.limits
        assert plan.num_tokens <= policy.max_step_tokens(limits)  # what the KV cache's memory profile runs
        for item in items:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING and seq in policy.running
            assert item.start == seq.num_computed_tokens and item.num_new_tokens >= 1
            assert item.start + item.num_new_tokens <= seq.num_tokens
            assert item.samples == (item.start + item.num_new_tokens == seq.num_tokens)
            assert seq.seq_id in running_before or seq.seq_id in waiting_before
        new = [item for item in items if item.seq.seq_id in waiting_before]
        if new:  # admission from the queue respects max_num_seqs (imports are not counted against it)
            assert len(policy.running) <= limits.max_num_seqs
        for seq in plan.preempted:
            assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
            assert seq.seq_id in running_before and not policy.blocks.has_blocks(seq.seq_id)
            assert seq.seq_id not in ids
        if plan.preempted and not self.name.startswith("accelgen"):  # accelgen: an urgent prompt may preempt
            assert not new, "a prompt was admitted in a step that preempted"
        kinds = ["new" if i.seq.seq_id in waiting_before else
                 "decode" if running_before[i.seq.seq_id] else "partial" for i in items]
        self.check_rules(policy, plan, kinds, new, running_before)

    def check_rules(self, policy, plan, kinds, new, running_before) -> None:
        """The policy's own rules; `kinds`: each scheduled item's (new, decode or partial)."""
        served = {i.seq.seq_id for i in plan.scheduled} | {s.seq_id for s in plan.preempted}
        if self.name in ("token", "mixed"):
            # every sequence that was decoding is decoded (or preempted)
            assert all(sid in served for sid, dec in running_before.items() if dec)
            assert all(i.num_new_tokens == 1 for i, k in zip(plan.scheduled, kinds) if k == "decode")
        if self.name.startswith("accelgen"):
            self.check_accelgen(policy, plan, kinds)
            return
        if self.name == "mixed":
            self.check_mixed(policy, plan, kinds)
        elif self.name in ("prompt", "token"):
            self.check_chunks(policy, plan, kinds, new)
        else:
            # whole prompts only: every non-decode item runs to the end and samples
            assert all(i.samples for i in plan.scheduled)
            assert "partial" not in kinds
            if len(new) > 1:
                assert sum(i.num_new_tokens for i in new) <= policy.limits.prompt_token_budget
        if self.name == "orca":
            self.check_orca(policy, plan, kinds, running_before)
        if self.name == "prefill_first":
            assert set(kinds) <= {"new"} or set(kinds) <= {"decode"}
            if not new:  # a step without prefills decodes every decoding sequence
                assert all(sid in served for sid, dec in running_before.items() if dec)

    @staticmethod
    def check_chunks(policy, plan, kinds, new) -> None:
        """Whole prompts up to the budget, and a prompt longer than a chunk a chunk at a time."""
        chunk = policy.limits.prompt_chunk_tokens
        for item, kind in zip(plan.scheduled, kinds):
            if kind != "decode":
                assert item.num_new_tokens <= chunk and (item.samples or item.num_new_tokens == chunk)
        if len(new) > 1:
            assert sum(i.num_new_tokens for i in new) <= policy.limits.prompt_token_budget

    @staticmethod
    def check_accelgen(policy, plan, kinds) -> None:
        """Within the budget (once the decodes fit); one long prompt in prefill (ERA)."""
        if kinds.count("decode") <= policy.budget:
            assert plan.num_tokens <= policy.budget <= policy.limits.slo.max_budget_tokens
        long = [s for s in policy.running if not s.is_decoding and s.num_prompt_tokens >= 20]
        assert len(long) <= 1

    @staticmethod
    def check_mixed(policy, plan, kinds) -> None:
        """Decodes, then partial prefills, then new ones; each prefill chunk as large as the budget left."""
        order = {"decode": 0, "partial": 1, "new": 2}
        assert [order[k] for k in kinds] == sorted(order[k] for k in kinds)
        budget = policy.limits.chunk_token_budget
        num_decodes = kinds.count("decode")
        if num_decodes <= budget:
            assert plan.num_tokens <= budget
        used = num_decodes
        for item, kind in zip(plan.scheduled, kinds):
            if kind != "decode":
                assert item.num_new_tokens == min(item.seq.num_tokens - item.start, budget - used)
                used += item.num_new_tokens

    @staticmethod
    def check_orca(policy, plan, kinds, running_before) -> None:
        """A decode is left out only when the batch's tokens fill the budget, never MAX_SKIPS times in a row."""
        preempted = {s.seq_id for s in plan.preempted}
        decoding = [sid for sid, dec in running_before.items() if dec and sid not in preempted]
        if kinds.count("decode") < len(decoding):
            assert plan.num_tokens >= policy.limits.prompt_token_budget
        assert all(s.num_skips <= MAX_SKIPS for s in policy.running)

    def check_state(self, policy) -> None:
        for seq in policy.running:
            assert seq.status is SequenceStatus.RUNNING and policy.blocks.has_blocks(seq.seq_id)
            assert seq.num_computed_tokens < seq.num_tokens
        for seq in policy.waiting:
            assert seq.status is SequenceStatus.WAITING and not policy.blocks.has_blocks(seq.seq_id)
            assert seq.num_computed_tokens == 0
        for seq in policy.held.values():
            assert seq.status in (SequenceStatus.PREFILLED, SequenceStatus.IMPORTING)
            assert policy.blocks.has_blocks(seq.seq_id)

    def check_finished(self, seqs: dict[str, Sequence], aborted: set[str]) -> None:
        assert len(seqs) == self.num_requests
        for seq_id, prompt, params, tokens in self.requests:
            seq = seqs[seq_id]
            assert seq.is_finished, seq_id
            assert seq.prompt_token_ids == prompt
            if seq_id in aborted:
                assert seq.finish_reason == "abort"
                continue
            out, reason = expected_outputs(tokens, params, len(prompt), self.MAX_MODEL_LEN)
            assert (seq.output_token_ids, seq.finish_reason) == (out, reason), seq_id


def maybe_abort(sim: Sim, policy, seqs, aborted) -> None:
    if sim.rng.random() < 0.03:
        live = [s for s in seqs.values() if not s.is_finished]
        if live:
            victim = sim.rng.choice(live)
            policy.finish(victim, "abort")
            aborted.add(victim.seq_id)
            policy.blocks.check_integrity()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ["mixed", "prefill_first", "orca", "token", "accelgen"])
def test_random_simulation_runs_to_completion(name, seed):
    sim = Sim(seed, name)
    blocks = sim.blocks()
    steps = 0
    policy = make_policy(name, blocks, sim.limits(), clock=lambda: steps * 0.01)
    kv = FakeKV(blocks)
    seqs: dict[str, Sequence] = {}
    aborted: set[str] = set()
    importing: list[Sequence] = []
    arrived = 0
    while arrived < sim.num_requests or policy.has_work() or importing or policy.held:
        while arrived < sim.num_requests and sim.arrivals[arrived] <= steps:
            seq = seqs.setdefault(str(arrived), sim.new_seq(arrived))
            arrived += 1
            has_room = (len(policy.running) + len(policy.held) < policy.limits.max_num_seqs
                        and not policy.num_preempted_waiting)  # those go first
            if (name in ("token", "accelgen") and has_room and sim.rng.random() < 0.7
                    and blocks.num_free_blocks >= blocks.blocks_for(seq.num_tokens)):
                # the KV arrives from a prompt machine: reserve, "transfer", complete next step
                policy.reserve_import(seq)
                kv.write(seq, 0, seq.num_prompt_tokens)
                importing.append(seq)
            else:
                policy.add(seq)
        if importing and sim.rng.random() < 0.7:
            seq = importing.pop(0)
            if not seq.is_finished:
                policy.complete_import(seq.seq_id, sim.token_for(seq))
                blocks.check_integrity()
        maybe_abort(sim, policy, seqs, aborted)
        sim.run_policy_step(policy, kv)
        steps += 1
        assert steps < 3000, "simulation does not make progress"
    sim.check_finished(seqs, aborted)
    assert blocks.num_free_blocks == blocks.num_blocks
    blocks.check_integrity()
    assert not policy.running and not policy.waiting and not policy.held


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prompt_name", ["prompt", "accelgen_prompt"])
def test_random_simulation_prompt_to_token_handoff(prompt_name, seed):
    """A prompt policy prefills and holds; its KV moves to a token policy's own blocks."""
    sim = Sim(seed, prompt_name)
    prompt_blocks = sim.blocks()
    token_blocks = sim.blocks(prompt_blocks.block_size)  # a block copy needs the same block size
    steps = 0
    prompt = make_policy(prompt_name, prompt_blocks, sim.limits(), clock=lambda: steps * 0.01)
    token = make_policy("token", token_blocks, sim.limits())
    prompt_kv, token_kv = FakeKV(prompt_blocks), FakeKV(token_blocks)
    prompt_seqs: dict[str, Sequence] = {}
    token_seqs: dict[str, Sequence] = {}
    aborted: set[str] = set()
    arrived, steps = 0, 0
    token_sim = Sim(seed, "token")
    while arrived < sim.num_requests or prompt.has_work() or prompt.held or token.has_work():
        while arrived < sim.num_requests and sim.arrivals[arrived] <= steps:
            prompt.add(prompt_seqs.setdefault(str(arrived), sim.new_seq(arrived)))
            arrived += 1
        maybe_abort(sim, prompt, prompt_seqs, aborted)
        # export the held (prefilled) sequences whose KV fits on the token side
        for seq in list(prompt.held.values()):
            assert seq.status is SequenceStatus.PREFILLED and seq.num_output_tokens == 1
            if sim.rng.random() < 0.3:
                continue
            dst = Sequence(seq.seq_id, list(seq.prompt_token_ids), seq.params, seq.arrival_time, seq.eos_token_ids)
            if token_blocks.num_free_blocks < token_blocks.blocks_for(dst.num_tokens):  # imports take fresh blocks
                continue
            if len(token.running) + len(token.held) >= token.limits.max_num_seqs \
                    or token.num_preempted_waiting:  # a preempted sequence goes first
                continue
            [src_ids] = prompt_blocks.export_blocks(seq.seq_id)
            [dst_ids] = token.reserve_import(dst)
            assert len(src_ids) == len(dst_ids) == token_blocks.blocks_for(seq.num_prompt_tokens)
            prompt_kv.check(seq, seq.num_prompt_tokens)
            for pos in range(seq.num_prompt_tokens):  # the block copy
                token_kv.slots[token_kv.slot(dst, pos)] = prompt_kv.slots[prompt_kv.slot(seq, pos)]
            token.complete_import(seq.seq_id, seq.output_token_ids[0])
            prompt.finish(seq, "abort")  # release_request
            token_seqs[seq.seq_id] = dst
            prompt_blocks.check_integrity()
            token_blocks.check_integrity()
        sim.run_policy_step(prompt, prompt_kv)
        token_sim.run_policy_step(token, token_kv)
        steps += 1
        assert steps < 3000, "simulation does not make progress"
    # a request ends on the prompt side (aborted, or stopped by its first token) or on the token side
    final = {sid: token_seqs.get(sid, seq) for sid, seq in prompt_seqs.items()}
    sim.check_finished(final, aborted)
    for blocks in (prompt_blocks, token_blocks):
        blocks.check_integrity()
        assert blocks.num_free_blocks == blocks.num_blocks
