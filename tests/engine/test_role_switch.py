"""Live role switching of one engine (`LLMEngine.set_policy`) and per-request hand-off.

Reference: the greedy tokens of one undisturbed `mixed` engine on the same prompts. A request
handed off (held PREFILLED after its first token) is finished by exporting its KV into a token
engine, as a token worker would; a switch must keep every queued, running and held request.
"""
from __future__ import annotations

import pytest

from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import SequenceStatus
from splitserve.transfer.codec import pack_all, slot_index, unpack_all
from tests.engine.engine_helpers import (
    ENGINE,
    GREEDY,
    PROMPTS,
    assert_all_free,
    one_thread,  # noqa: F401  (pytest fixture)
)

ROLES = ("prompt", "token", "mixed", "prefill_first", "orca", "accelgen", "accelgen_prompt")
MAX_STEPS = 300


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    """Greedy tokens per prompt of PROMPTS from one undisturbed mixed engine."""
    outputs = LLM("demo", policy="mixed", **ENGINE).generate(PROMPTS, GREEDY)
    return [out.token_ids for out in outputs]


def drive(engine: LLMEngine, outputs: dict[str, RequestOutput], steps: int | None = None) -> None:
    """Step `steps` times (None: until no work is left), integrity checked after every step."""
    for n in range(MAX_STEPS):
        if (steps is not None and n == steps) or (steps is None and not engine.has_unfinished_requests()):
            return
        outputs.update((out.request_id, out) for out in engine.step())
        engine.check_integrity()
    stuck = {rid: (status.value, computed, len(ids)) for rid, (status, computed, ids, _) in snapshot(engine).items()}
    pytest.fail(f"no progress after {MAX_STEPS} steps; (status, computed, tokens): {stuck}")


def snapshot(engine: LLMEngine) -> dict[str, tuple]:
    """Every live sequence: where it is and how far it got."""
    policy = engine.policy
    seqs = [*policy.waiting, *policy.running, *policy.held.values()]
    return {s.seq_id: (s.status, s.num_computed_tokens, tuple(s.token_ids), s.hand_off) for s in seqs}


def switch(engine: LLMEngine, role: str) -> None:
    before = snapshot(engine)
    engine.set_policy(role)
    assert engine.policy.name == role
    assert snapshot(engine) == before
    engine.check_integrity()


def hand_over(src: LLMEngine, dst: LLMEngine, request_id: str) -> RequestOutput:
    """Move a held request's KV from `src` into `dst` (as the KV transfer does); dst decodes on."""
    seq, block_ids = src.export_request(request_id)
    n = seq.num_prompt_tokens
    kv = pack_all(src.kv_cache, slot_index(block_ids, src.kv_cache.block_size, n, src.kv_cache.data.device))
    _, dst_blocks = dst.reserve_import(request_id, seq.prompt_token_ids, seq.params)
    unpack_all(dst.kv_cache, slot_index(dst_blocks, dst.kv_cache.block_size, n, dst.kv_cache.data.device), kv)
    first = dst.complete_import(request_id, seq.output_token_ids[0])
    src.release_request(request_id)
    src.check_integrity()
    return first


def finish_held(src: LLMEngine, outputs: dict[str, RequestOutput]) -> set[str]:
    """Hand every held request over to a fresh token engine and run it there; returns their ids."""
    held = set(src.policy.held)
    assert all(s.status is SequenceStatus.PREFILLED and s.num_output_tokens == 1 for s in src.policy.held.values())
    token_engine = LLMEngine("demo", policy="token", **ENGINE)
    for request_id in held:
        outputs[request_id] = hand_over(src, token_engine, request_id)
    drive(token_engine, outputs)
    assert_all_free(token_engine)
    return held


# ---------------------------------------------------------------------------------------------
# switching roles mid-run
# ---------------------------------------------------------------------------------------------

# (role to switch to, requests to add as (id, index into PROMPTS, hand_off), steps to run then)
SCRIPT = [
    ("prompt", [("a", 0, None), ("b", 1, False), ("c", 2, None), ("d", 3, False), ("e", 4, None)], 2),
    ("mixed", [("f", 5, True), ("g", 6, None)], 2),
    ("token", [("h", 7, None)], 2),
    ("prompt", [("i", 2, None)], None),
]
HANDED_OFF = {"a", "c", "e", "f", "i"}  # prompt role's default, or asked for


def test_switching_roles_keeps_every_request(want):
    engine = LLMEngine("demo", policy="prompt", prompt_token_budget=64, **ENGINE)
    outputs: dict[str, RequestOutput] = {}
    index = {}
    for role, requests, steps in SCRIPT:
        if role != engine.policy.name:
            if role in ("token", "prompt"):  # these never schedule a chunk: see test_switch_mid_chunked_prefill
                assert all(s.is_decoding for s in engine.policy.running)
            switch(engine, role)
        for request_id, i, hand_off in requests:
            engine.add_request(request_id, PROMPTS[i], GREEDY, hand_off=hand_off)
            index[request_id] = i
        if role == "mixed":  # the first switch moved work of every kind
            statuses = {status for status, *_ in snapshot(engine).values()}
            assert {SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.PREFILLED} <= statuses
        drive(engine, outputs, steps)
    assert {rid for rid, out in outputs.items() if out.finished} == set(index) - HANDED_OFF
    assert finish_held(engine, outputs) == HANDED_OFF
    assert_all_free(engine)
    assert {rid: outputs[rid].token_ids for rid in index} == {rid: want[i] for rid, i in index.items()}
    assert all(outputs[rid].finish_reason == "length" for rid in index)


@pytest.mark.parametrize("role", ["token", "prompt", "prefill_first", "orca"])
def test_switch_mid_chunked_prefill(want, role):
    engine = LLMEngine("demo", policy="mixed", chunk_token_budget=32, **ENGINE)
    engine.add_request("r", PROMPTS[4], GREEDY, hand_off=False)
    outputs: dict[str, RequestOutput] = {}
    drive(engine, outputs, 1)
    assert engine.policy.find("r").num_computed_tokens == 32  # 32 of its 150 prompt tokens
    switch(engine, role)
    drive(engine, outputs)
    assert outputs["r"].token_ids == want[4]


def test_preemption_counters_survive_a_switch():
    prompts = [[(7 * i + j) % 256 for j in range(10 + 9 * i)] for i in range(5)]  # 10..46 tokens
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    reference = LLM("demo", policy="mixed", max_model_len=80, num_kv_blocks=64).generate(prompts, params)
    # 6 blocks of 16 = 96 slots: one request always fits, five do not
    engine = LLMEngine("demo", policy="token", max_model_len=80, num_kv_blocks=6)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs: dict[str, RequestOutput] = {}
    for _ in range(MAX_STEPS):
        if engine.policy.num_preemptions:
            break
        drive(engine, outputs, 1)
    preempted = engine.policy.num_preemptions
    per_seq = {s.seq_id: s.num_preemptions for s in [*engine.policy.running, *engine.policy.waiting]}
    assert preempted > 0 and sum(per_seq.values()) == preempted
    for role in ("mixed", "prefill_first"):
        switch(engine, role)
        assert engine.policy.num_preemptions == preempted
        assert {s.seq_id: s.num_preemptions for s in [*engine.policy.running, *engine.policy.waiting]} == per_seq
    drive(engine, outputs)
    assert engine.policy.num_preemptions >= preempted
    assert [outputs[str(i)].token_ids for i in range(5)] == [out.token_ids for out in reference]
    assert_all_free(engine)


# ---------------------------------------------------------------------------------------------
# hand-off per request, and its default per role
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("hand_off", [None, True, False])
@pytest.mark.parametrize("role", ROLES)
def test_hand_off_per_request(want, role, hand_off):
    """Held after the first token when handed off (the role's default: only the prompt roles hand off),
    ready for export; otherwise decoded to completion on this engine, whatever its role."""
    engine = LLMEngine("demo", policy=role, **ENGINE)
    seq = engine.add_request("r", PROMPTS[3], GREEDY, hand_off=hand_off)
    expect_held = role in ("prompt", "accelgen_prompt") if hand_off is None else hand_off
    assert seq.hand_off is expect_held
    outputs: dict[str, RequestOutput] = {}
    drive(engine, outputs)
    assert outputs["r"].finished is not expect_held
    if expect_held:
        assert seq.status is SequenceStatus.PREFILLED and outputs["r"].token_ids == want[3][:1]
        assert finish_held(engine, outputs) == {"r"}
    assert outputs["r"].token_ids == want[3] and outputs["r"].finish_reason == "length"
    assert_all_free(engine)


def test_hand_off_default_follows_the_current_role(want):
    engine = LLMEngine("demo", policy="prompt", **ENGINE)
    defaults = {}
    for request_id, role in (("x", "prompt"), ("y", "mixed"), ("z", "token"), ("w", "prompt")):
        if role != engine.policy.name:
            switch(engine, role)
        defaults[request_id] = engine.add_request(request_id, PROMPTS[2], GREEDY).hand_off
    assert defaults == {"x": True, "y": False, "z": False, "w": True}
    outputs: dict[str, RequestOutput] = {}
    drive(engine, outputs)  # under the prompt role: x and w are held, y and z decode here
    assert {rid for rid, out in outputs.items() if out.finished} == {"y", "z"}
    assert finish_held(engine, outputs) == {"x", "w"}
    assert {rid: out.token_ids for rid, out in outputs.items()} == dict.fromkeys("xyzw", want[2])
    assert_all_free(engine)


# ---------------------------------------------------------------------------------------------
# a bad switch changes nothing
# ---------------------------------------------------------------------------------------------

def test_unknown_policy_is_rejected_and_the_engine_keeps_working(want):
    engine = LLMEngine("demo", policy="mixed", **ENGINE)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, GREEDY)
    outputs: dict[str, RequestOutput] = {}
    drive(engine, outputs, 2)
    policy, before = engine.policy, snapshot(engine)
    with pytest.raises(ValueError, match="policy must be one of .*'decode'"):
        engine.set_policy("decode")
    assert engine.policy is policy and snapshot(engine) == before
    engine.check_integrity()
    drive(engine, outputs)
    assert [outputs[str(i)].token_ids for i in range(4)] == want[:4]
    assert_all_free(engine)
