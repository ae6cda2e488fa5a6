"""Driving an engine's model runner directly, a plan at a time (the tests against transformers)."""
from __future__ import annotations

import torch

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.policies import Plan, ScheduledSeq
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence


def new_seq(engine: LLMEngine, seq_id: str, ids: list[int], params: SamplingParams = SamplingParams()) -> Sequence:
    identity = None if params.lora is None else engine.lora_identities[params.lora]
    seq = Sequence(seq_id, list(ids), params, adapter_identity=identity)
    if engine.policy.adapters is not None:
        engine.policy.adapters.bind(seq)  # into a slot as admission does, from host memory if need be
    engine.block_manager.allocate(seq, use_prefix_cache=False)
    assert seq.num_computed_tokens == 0
    return seq


@torch.inference_mode()
def run_plan(engine: LLMEngine, items: list[ScheduledSeq]) -> dict[str, torch.Tensor]:
    """Run one iteration; return each sequence's logits [num_new_tokens, vocab] (float32), and
    advance its num_computed_tokens as the policy would."""
    plan = Plan(tuple(items))
    ordered = sorted(plan.scheduled, key=lambda item: item.num_new_tokens != 1)  # as ModelRunner.execute
    tables = {item.seq.seq_id: engine.block_manager.block_tables(item.seq.seq_id) for item in ordered}
    runner = engine.runner
    batch = runner.prepare(ordered, tables)
    logits = runner.model.compute_logits(runner.forward(batch)).float()
    out = {}
    for i, item in enumerate(ordered):
        out[item.seq.seq_id] = logits[batch.query_starts[i]:batch.query_starts[i + 1]]
        item.seq.num_computed_tokens = item.start + item.num_new_tokens
    return out


def append(engine: LLMEngine, seq: Sequence, token_id: int) -> None:
    seq.append_token(token_id)
    engine.block_manager.grow(seq, seq.num_tokens)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()
