"""A token worker of a sliding-window model importing long prompts: its windowed layer groups
reserving only the blocks the first decode reaches (what the engine does:
`BlockManager.reserve_for_import`) against reserving every block of the prompt and releasing the
ones out of reach when the import completes (`whole`, as before): how many imports land at once,
how long a request waits for its second token, and what that does to the token worker's throughput.

The model is the demo's shape as a Mistral with a --window on every layer (or on every other one,
`--layers alternate`), dummy weights, unless --model names a checkpoint directory with windows. A
prompt engine prefills every prompt once; their KV and first tokens are then handed to a token
engine (token policy, `max_num_seqs` = the number of requests, KV blocks for --fit sequences'
whole prompt and output) as a token worker takes them: every request arrives at once (a forced
output length) and is reserved, in order, as soon as its reservation fits, as placement does before
the prompt worker prefills it; the prompt worker prefills the reserved ones in order, one each
--prefill-steps decode steps, and each lands (its KV copied into the reserved blocks) then, or at
once when nothing decodes. Both layouts run side by side in one process, interleaved after a
warm-up, medians with [min-max] over --repeats; their greedy tokens must be equal (the script
fails if not). The clock counts the token engine only (reservations, KV copies, decode steps).

    python scripts/bench_windowed_imports.py --json imports.json            # on CPU, float32
    python scripts/bench_windowed_imports.py --layers alternate --json imports-alternate.json
"""
from __future__ import annotations

import argparse
import tempfile
from collections import deque

import torch

from bench_kv_cache_dtype import StepLog, interleaved  # this script's folder
from bench_sliding_window_kv import parsed, prompts_for, report, window_args, windowed_checkpoint
from splitserve.engine.block_manager import BlockManager, OutOfBlocksError
from splitserve.engine.kv_groups import kv_groups
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import load_model_config
from splitserve.engine.policies import make_policy
from splitserve.engine.policies.base import EngineFullError
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer.codec import pack_all, slot_index, unpack_all

LAYOUTS = ("window", "whole")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    window_args(p, requests=16, prompt_len=1024, output_len=128, fit=2)
    p.add_argument("--prefill-steps", type=int, default=4,
                   help="decode steps the prompt worker takes to prefill and send one prompt")
    return parsed(p, argv, ("prefill_steps",))


class WholeImports(BlockManager):
    """The block manager as it reserved an import before: every block of the prompt in every group."""

    def reserve_for_import(self, seq, reuse_prefix: bool = False, others=()) -> list[list[int]]:
        self.allocate(seq, use_prefix_cache=reuse_prefix)
        return self.export_blocks(seq.seq_id)


def engine_args(args, model: str) -> dict:
    return dict(device=args.device, dtype=args.dtype, load_format="auto" if args.model else "dummy",
                block_size=args.block_size, max_model_len=args.prompt_len + args.output_len + args.block_size,
                enable_prefix_caching=False)


def prefill(args, model: str, prompts: list[list[int]]) -> list[tuple[torch.Tensor, int]]:
    """Each prompt's KV on the wire and its first token, from a prompt engine."""
    engine = LLMEngine(model, policy="prompt", prompt_token_budget=args.prompt_len, max_num_seqs=len(prompts),
                       **engine_args(args, model))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    handed = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seq, blocks = engine.export_request(out.request_id)
            cache = engine.kv_cache
            slots = slot_index(blocks, cache.block_size, seq.num_prompt_tokens, cache.data.device)
            handed[out.request_id] = (pack_all(cache, slots), out.token_ids[0])
            engine.release_request(out.request_id)
    return [handed[str(i)] for i in range(len(prompts))]


def run(args, model: str, layout: str, prompts: list[list[int]], handed: list[tuple[torch.Tensor, int]]) -> dict:
    groups = kv_groups(load_model_config(model)).num_groups  # a token block takes a block of each
    blocks = args.fit * groups * -(-(args.prompt_len + args.output_len) // args.block_size) + 1  # + NULL_BLOCK
    engine = LLMEngine(model, policy="token", num_kv_blocks=blocks, max_num_seqs=len(prompts),
                       **engine_args(args, model))
    if layout == "whole":
        bm = engine.block_manager
        engine.block_manager = WholeImports(bm.num_blocks + 1, bm.block_size, bm.enable_prefix_caching,
                                            windows=bm.windows)  # + NULL_BLOCK
        engine.policy = make_policy("token", engine.block_manager, engine.policy.limits)
    return drive(engine, prompts, handed, args.output_len, args.prefill_steps)


def drive(engine: LLMEngine, prompts: list[list[int]], handed: list[tuple[torch.Tensor, int]], output_len: int,
          prefill_steps: int) -> dict:
    """Reserve the imports in order while they fit; land the oldest reserved one each
    `prefill_steps` decode steps (at once when nothing decodes); step; until every request is
    done. Times each request's second token from the start."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    cache, pending, reserved, tables = engine.kv_cache, list(range(len(prompts))), deque(), {}
    next_landing = prefill_steps
    log = StepLog()
    while pending or reserved or engine.has_unfinished_requests():
        while pending:
            try:
                _, tables[pending[0]] = engine.reserve_import(str(pending[0]), prompts[pending[0]], params)
            except (OutOfBlocksError, EngineFullError):
                break
            reserved.append(pending.pop(0))
        if reserved and (len(log.running) >= next_landing or not engine.has_unfinished_requests()):
            i = reserved.popleft()
            unpack_all(cache, slot_index(tables.pop(i), cache.block_size, len(prompts[i]), cache.data.device),
                       handed[i][0])
            engine.complete_import(str(i), handed[i][1])
            next_landing = len(log.running) + prefill_steps
        log.step(engine)
    return log.result(engine, len(prompts), output_len, "second_token")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    prompts = prompts_for(args)
    with tempfile.TemporaryDirectory() as scratch:
        model = windowed_checkpoint(args, scratch)
        handed = prefill(args, model, prompts)
        runs = interleaved(LAYOUTS, args.repeats, prompts,
                           lambda layout, some: run(args, model, layout, some, handed[:len(some)]))
        window = max(w or 0 for w in kv_groups(load_model_config(model)).windows)
    return report(args, runs, "whole", "reservation", "second_token", window,
                  f"token worker KV: {runs['window'][0]['kv_blocks']} blocks of {args.block_size} ({args.fit} "
                  f"sequences of {args.prompt_len + args.output_len} tokens); window {window} on {args.layers} "
                  f"layer; {args.requests} imports of {args.prompt_len}-token prompts at once")


if __name__ == "__main__":
    main()
