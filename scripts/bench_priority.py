"""What priority scheduling buys an interactive class sharing an engine with a backlog: the same
workload through one engine serving first come, first served and one serving by priority.

    python scripts/bench_priority.py                       # the demo model on this CPU
    python scripts/bench_priority.py --repeats 3 --json priority.json

The backlog (priority 1) is queued at once, `--backlog` requests of `--backlog-prompt` tokens
generating `--backlog-tokens` each; then an interactive request (priority 0, `--chat-prompt`
tokens, `--chat-tokens` out) joins every `--every` engine steps. Arrivals are counted in engine
steps, so both engines see the same workload; TTFT (arrival to first token) is wall-clock time
around `LLMEngine.step`, and in steps. Every request's output must be the same under both.
Greedy, mixed policy (Sarathi-Serve), `--max-num-seqs` running at once.
The two engines run in turn, `--repeats` times; a row reports the median run and the range.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

from bench_moe import emit, print_markdown, ratio, spread, summarize_runs  # this script's folder

from splitserve.bench.report import percentiles
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams

POLICIES = ("fcfs", "priority")


def run(policy: str, args) -> dict:
    """One engine through the whole workload: each class's TTFTs, the total time, the preemptions."""
    engine = LLMEngine(args.model, scheduling_policy=policy, max_num_seqs=args.max_num_seqs,
                       enable_prefix_caching=False, max_model_len=args.backlog_prompt + args.backlog_tokens + 8,
                       num_kv_blocks=args.num_kv_blocks)
    vocab = engine.model_config.vocab_size

    def add(request_id: str, prompt: int, tokens: int, priority: int) -> None:  # at step `steps`
        ids = [(hash((request_id, i)) % (vocab - 3)) + 1 for i in range(prompt)]
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                priority=priority if policy == "priority" else 0)
        engine.add_request(request_id, ids, params)
        added[request_id] = time.perf_counter(), steps

    added, first, outputs = {}, {}, {}
    steps = chats = 0
    for i in range(args.backlog):
        add(f"backlog-{i}", args.backlog_prompt, args.backlog_tokens, 1)
    start = time.perf_counter()
    while engine.has_unfinished_requests() or chats < args.chats:
        if chats < args.chats and steps % args.every == 0:
            add(f"chat-{chats}", args.chat_prompt, args.chat_tokens, 0)
            chats += 1
        steps += 1
        for out in engine.step():
            first.setdefault(out.request_id, (time.perf_counter(), steps))
            if out.finished:
                outputs[out.request_id] = out.token_ids
    total = time.perf_counter() - start
    chat, backlog = (percentiles([first[r][0] - added[r][0] for r in added if r.startswith(kind)], (50, 99))
                     for kind in ("chat", "backlog"))
    chat_steps = [first[r][1] - added[r][1] for r in added if r.startswith("chat")]
    return {"policy": policy, "total_s": total, "steps": steps, "preemptions": engine.policy.num_preemptions,
            "chat_ttft_p50_s": chat["p50"], "chat_ttft_p99_s": chat["p99"], "backlog_ttft_p50_s": backlog["p50"],
            "chat_ttft_max_steps": max(chat_steps), "outputs": outputs}


def summarize(runs: list[dict]) -> list[dict]:
    """Per policy: each figure's median over the repeats, with its range."""
    rows = summarize_runs(runs, "policy", list(POLICIES), ("total_s", "chat_ttft_p50_s", "chat_ttft_p99_s",
                                                           "backlog_ttft_p50_s", "preemptions", "chat_ttft_max_steps"))
    fcfs, priority = rows
    fcfs["same_outputs"] = priority["same_outputs"] = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    for key in ("chat_ttft_p50_s", "chat_ttft_p99_s", "total_s"):
        priority[f"{key}_vs_fcfs"] = priority[key]["median"] / fcfs[key]["median"]
    return rows


def show(result: dict) -> None:
    print_markdown(["scheduling", "chat TTFT p50 ms:", "chat TTFT p99 ms:", "chat TTFT max steps:",
                    "backlog TTFT p50 ms:", "total s:", "preemptions:"],
                   [[r["policy"], spread(r["chat_ttft_p50_s"], 1000), spread(r["chat_ttft_p99_s"], 1000),
                     spread(r["chat_ttft_max_steps"]), spread(r["backlog_ttft_p50_s"], 1000),
                     spread(r["total_s"], digits=2), spread(r["preemptions"])] for r in result["rows"]])
    priority = result["rows"][1]
    print(f"\npriority / fcfs: chat TTFT p50 {ratio(priority['chat_ttft_p50_s_vs_fcfs'])}, "
          f"p99 {ratio(priority['chat_ttft_p99_s_vs_fcfs'])}, total time {ratio(priority['total_s_vs_fcfs'])}; "
          f"every request's output the same in every run: {priority['same_outputs']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--backlog", type=int, default=48)
    p.add_argument("--backlog-prompt", type=int, default=256)
    p.add_argument("--backlog-tokens", type=int, default=64)
    p.add_argument("--chats", type=int, default=24)
    p.add_argument("--chat-prompt", type=int, default=32)
    p.add_argument("--chat-tokens", type=int, default=16)
    p.add_argument("--every", type=int, default=8, help="engine steps between interactive arrivals")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks of 16 tokens (default: the engine's CPU budget): fewer than the batch needs "
                        "makes the engine preempt, by priority the backlog's requests first")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    for name in ("backlog", "chats", "every", "max_num_seqs", "repeats", "backlog_prompt", "backlog_tokens",
                 "chat_prompt", "chat_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    runs = [run(policy, args) for _ in range(args.repeats) for policy in POLICIES]
    result = {"device": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()},
              "rows": summarize(runs), "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs]}
    return emit(args, result, show)


if __name__ == "__main__":
    sys.exit(main())
