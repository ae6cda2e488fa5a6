"""Tensor parallelism on CPU (gloo): what a TP-2 worker's step costs against TP 1, how much of it
is the all-reduces, and how the KV transfer overlaps when the prompt and token workers' TP differ.

Every rank is a process of its own with one torch thread (as a Ray actor of one CPU gets), so TP 2
uses two cores where TP 1 uses one; "TP 1, 2 threads" is the same two cores spent on torch's
intra-op threads instead. The model is bench_kv_transfer's larger dummy shape (hidden 512, 8
layers, 8 query / 4 KV heads, vocabulary 32,000, float32). Medians of --repeats runs.

Collectives: `TPGroup.all_reduce` alone between two rank processes, at the steps' tensor shapes
(tokens x hidden, float32): the floor under every all-reduce of a step.

Steps (rank 0 of the worker, time.perf_counter around `LLMEngine.step`):
- step_ms: a prefill of N tokens (one request), or one decode step of a batch at context 256;
- all_reduce_ms: time rank 0 spent inside the model's all-reduces (waiting for the other rank
  included); all_reduce_min_ms: the smaller of the two ranks' (the later rank to arrive waits
  least, so this is the collectives' own cost); control_ms: rank 0's broadcast of the step and
  gather of the reports.

Transfers (prompt TP, token TP) in (1, 1), (1, 2), (2, 1), each side's ranks as processes, gloo
links over loopback, measured as bench_kv_transfer measures them:
- serialized_ms: one-shot push after the prefill, from the first token until the token worker's
  rank 0 knows every part has landed (it polls as a worker loop with only imports in flight does:
  its own transport for IMPORT_WAIT_S, then a round with its other ranks);
- visible_ms: layer-wise streaming's cost on the critical path: the prompt leader's time packing
  and pushing during the prefill plus the tail from the first token to the last part landing.

    python scripts/bench_tp.py --json tp.json
    python scripts/bench_tp.py --quick            # smoke run
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from bench_kv_transfer import LARGER  # this script's folder
from call_timer import timed
from kv_pair import NEVER, kv_bytes_per_token

from splitserve.cluster.worker_loop import IMPORT_WAIT_S
from splitserve.engine.dummy_weights import write_shape_checkpoint

TIMEOUT = 120.0
DECODE_CONTEXT = 256


# ---- time spent in the group's collectives, per process -------------------------------------------
_spent = {"all_reduce": 0.0, "control": 0.0}


def _time_collectives() -> None:
    """Wrap TPGroup's collectives (before any model binds `all_reduce`) to add up their time."""
    from splitserve.engine.tensor_parallel import TPGroup

    TPGroup.all_reduce = timed(TPGroup.all_reduce, partial(_spend, "all_reduce"))
    TPGroup.broadcast = timed(TPGroup.broadcast, partial(_spend, "control"))
    TPGroup.gather = timed(TPGroup.gather, partial(_spend, "control"))


def _spend(key: str, seconds: float) -> None:
    _spent[key] += seconds


def _take_spent() -> dict[str, float]:
    spent = dict(_spent)
    _spent.update(all_reduce=0.0, control=0.0)
    return spent


# ---- one rank of one worker, in a process of its own -------------------------------------------
def rank_process(spec: dict, rank: int, port: int, conn) -> None:
    """spec: worker id, side (steps, prompt or token), role (an engine policy), model, tp size, torch
    threads per rank, whether it transfers, and (token side) its prompt worker's id."""
    from splitserve.engine.engine_config import EngineConfig
    from splitserve.engine.tensor_parallel import TPGroup

    torch.set_num_threads(spec["threads"])
    _time_collectives()
    worker, size = spec["worker"], spec["tp"]
    config = EngineConfig(policy=spec["role"], device="cpu", dtype="float32", load_format="dummy",
                          enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30)
    group = None
    if size > 1:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        group = TPGroup(dist.PrefixStore(f"{worker}-tp", store), rank, size, torch.device("cpu"), TIMEOUT)
    if rank == 0:
        leader_process(spec, config, group, port, conn)
    else:
        follower_process(spec, config, group, port, conn)


def _transport(engine, peer_id: str, port: int):
    from splitserve.transfer.handoff import make_transport
    from splitserve.transfer.torch_link import TorchFabric

    return make_transport(engine, TorchFabric.join("127.0.0.1", port, peer_id, torch.device("cpu"), TIMEOUT), TIMEOUT)


def follower_process(spec: dict, config, group, port: int, conn) -> None:
    from splitserve.engine.tp_step import TPFollower
    from splitserve.transfer.follower_kv import FollowerKV
    from splitserve.transfer.kv_routes import rank_peer

    follower = TPFollower(spec["model"], config, group)
    if spec["transfer"]:
        FollowerKV(follower, _transport(follower, rank_peer(spec["worker"], group.rank), port))
    else:  # each round reports this rank's time in collectives
        follower.report = _take_spent
    conn.send("ready")
    follower.serve()


def leader_process(spec: dict, config, group, port: int, conn) -> None:
    from splitserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(spec["model"], config, tp=group)
    follower_spent: list[dict] = []
    if engine.tp_leader is not None and not spec["transfer"]:
        engine.tp_leader.listeners.append(lambda reports: follower_spent.extend(reports))
    serve = {"prompt": _prompt_side, "token": _token_side, "steps": _steps}[spec["side"]]
    conn.send("ready")
    try:
        serve(engine, spec, port, conn, follower_spent)
    finally:
        if engine.tp_leader is not None:
            engine.tp_leader.stop()


def _prompt(n: int) -> list[int]:
    return [1] + [(7 * i) % 250 + 3 for i in range(n - 1)]


def _steps(engine, spec, port, conn, follower_spent: list[dict]) -> None:
    """("prefill", n) or ("decode", batch): time steps; reply one dict per timed step."""
    from splitserve.engine.sampling_params import SamplingParams

    count = 0
    while (cmd := conn.recv()) != "stop":
        kind, n, repeats = cmd
        rows = []
        if kind == "decode":  # `n` requests at DECODE_CONTEXT, prefilled first, then `repeats` timed steps
            params = SamplingParams(temperature=0, max_tokens=repeats + 2, ignore_eos=True)
            ids = {f"d{count}-{i}" for i in range(n)}
            for i, request_id in enumerate(sorted(ids)):
                engine.add_request(request_id, _prompt(DECODE_CONTEXT - 1) + [i + 3], params)
            while ids:
                ids -= {out.request_id for out in engine.step()}
        for _ in range(repeats):
            if kind == "prefill":
                count += 1
                engine.add_request(f"p{count}", _prompt(n), SamplingParams(temperature=0, max_tokens=1))
            _take_spent()
            follower_spent.clear()
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            mine = _take_spent()
            theirs = follower_spent[-1]["all_reduce"] if follower_spent else mine["all_reduce"]
            rows.append({"step": step, "all_reduce": mine["all_reduce"], "control": mine["control"],
                         "all_reduce_min": min(mine["all_reduce"], theirs)})
        while engine.has_unfinished_requests():
            engine.step()
        count += 1
        conn.send(rows)


def _prompt_side(engine, spec, port, conn, _) -> None:
    """("push", ticket, prompt): prefill with the exporter; reply (start, first token, stream s)."""
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.transfer.exporter import KVExporter

    exporter = KVExporter(engine, _transport(engine, spec["worker"], port))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    while (cmd := conn.recv()) != "stop":
        _, ticket, prompt = cmd
        start = time.monotonic()
        exporter.add(ticket, prompt, params, start)
        first = exporter.step()[0].token_timestamps[0]
        conn.send((start, first, exporter.stream_seconds))


def _token_side(engine, spec, port, conn, _) -> None:
    """("reserve", id, prompt, threshold, prompt tp): reply the ticket, then when every part landed."""
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.transfer.importer import KVImporter

    importer = KVImporter(engine, _transport(engine, spec["worker"], port), spec["worker"])
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    while (cmd := conn.recv()) != "stop":
        _, request_id, prompt, threshold, prompt_tp = cmd
        importer.layerwise_threshold = threshold
        conn.send(importer.reserve(request_id, prompt, params, spec["peer"], prompt_tp=prompt_tp))
        landed = []
        while not landed:  # as a token worker with only imports in flight polls them
            landed, failures = importer.poll(timeout=IMPORT_WAIT_S)
            if failures:
                raise RuntimeError(failures)
        landed_at = time.monotonic()
        while engine.has_unfinished_requests():
            engine.step()
        conn.send(landed_at)


class Worker:
    """A worker's ranks as processes; `leader` is the pipe to rank 0."""

    def __init__(self, store: dist.TCPStore, spec: dict):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(spec["tp"]):
            mine, theirs = ctx.Pipe()
            self.conns.append(mine)
            self.procs.append(ctx.Process(target=rank_process, args=(spec, rank, store.port, theirs), daemon=True))
            self.procs[-1].start()
        deadline = time.monotonic() + TIMEOUT
        for rank, conn in enumerate(self.conns):
            while not conn.poll(0.2):
                if not self.procs[rank].is_alive() or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"{spec['worker']}: rank {rank} did not start")
            conn.recv()
        self.leader = self.conns[0]

    def close(self) -> None:
        if self.procs[0].is_alive():
            self.conns[0].send("stop")
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def collective_process(rank: int, port: int, tokens: list[int], repeats: int, conn) -> None:
    """One of two ranks timing TPGroup.all_reduce alone on [tokens, hidden] float32 tensors."""
    from splitserve.engine.tensor_parallel import TPGroup

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    group = TPGroup(dist.PrefixStore("collective", store), rank, 2, torch.device("cpu"), TIMEOUT)
    timed = []
    for n in tokens:
        tensor = torch.randn(n, LARGER["hidden_size"])
        times = []
        for i in range(repeats + 5):  # 5 warm-ups
            start = time.perf_counter()
            group.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        timed.append(statistics.median(times[5:]))
    conn.send(timed)


# ---- measuring -----------------------------------------------------------------------------
def collective_rows(store, tokens: list[int], repeats: int) -> list[dict]:
    """All-reduce latency between two rank processes, the step's tensor shapes, nothing else running."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=collective_process, args=(rank, store.port, tokens, repeats, pipes[rank][1]),
                         daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    timed = [pipe.recv() for pipe, _ in pipes]
    for proc in procs:
        proc.join(30)
    return [{"tokens": n, "bytes": n * LARGER["hidden_size"] * 4,
             "all_reduce_us": min(timed[0][i], timed[1][i]) * 1e6, "repeats": repeats}
            for i, n in enumerate(tokens)]


def step_rows(store, model: str, tp: int, threads: int, prefill_lens, decode_batches, repeats: int) -> list[dict]:
    worker = Worker(store, {"worker": f"steps-tp{tp}x{threads}", "side": "steps", "role": "prefill_first",
                            "model": model, "tp": tp, "threads": threads, "transfer": False})
    rows = []
    try:
        worker.leader.send(("prefill", 64, 2)), worker.leader.recv()  # warm-up
        for kind, sizes in (("prefill", prefill_lens), ("decode", decode_batches)):
            for n in sizes:
                worker.leader.send((kind, n, repeats))
                timed = worker.leader.recv()
                med = {k: statistics.median(t[k] for t in timed) * 1e3 for k in timed[0]}
                rows.append({"tp": tp, "threads_per_rank": threads, "kind": kind,
                             "tokens" if kind == "prefill" else "batch": n, "step_ms": med["step"],
                             "all_reduce_ms": med["all_reduce"], "all_reduce_min_ms": med["all_reduce_min"],
                             "control_ms": med["control"], "all_reduce_share": med["all_reduce_min"] / med["step"],
                             "repeats": repeats})
    finally:
        worker.close()
    return rows


def transfer_rows(store, model: str, prompt_tp: int, token_tp: int, lens, repeats: int) -> list[dict]:
    names = {"prompt": f"prompt-{prompt_tp}to{token_tp}", "token": f"token-{prompt_tp}to{token_tp}"}
    prompt, token = (Worker(store, {"worker": names[side], "side": side, "peer": names["prompt"], "role": side,
                                    "model": model, "tp": tp, "threads": 1, "transfer": True})
                     for side, tp in (("prompt", prompt_tp), ("token", token_tp)))
    count = 0

    def once(tokens: list[int], threshold: int) -> dict:
        nonlocal count
        count += 1
        token.leader.send(("reserve", f"r{count}", tokens, threshold, prompt_tp))
        prompt.leader.send(("push", token.leader.recv(), tokens))
        start, first, streaming = prompt.leader.recv()
        return {"ttft": first - start, "tail": token.leader.recv() - first, "streaming": streaming}

    rows = []
    try:
        for n in lens:
            tokens = _prompt(n)
            once(tokens, NEVER), once(tokens, 0)  # warm-up: the links' set-up is not measured
            one_shot, layered = [], []
            for _ in range(repeats):
                one_shot.append(once(tokens, NEVER))
                layered.append(once(tokens, 0))
            serialized = statistics.median(r["tail"] for r in one_shot) * 1e3
            visible = statistics.median(r["tail"] + r["streaming"] for r in layered) * 1e3
            rows.append({"prompt_tp": prompt_tp, "token_tp": token_tp, "prompt_tokens": n,
                         "kv_bytes": n * kv_bytes_per_token(model, 4),
                         "prefill_ms": statistics.median(r["ttft"] for r in one_shot) * 1e3,
                         "layerwise_ttft_ms": statistics.median(r["ttft"] for r in layered) * 1e3,
                         "serialized_transfer_ms": serialized, "visible_transfer_ms": visible,
                         "visible_fraction": visible / serialized, "repeats": repeats})
    finally:
        prompt.close()
        token.close()
    return rows


def print_tables(collectives: list[dict], steps: list[dict], transfers: list[dict]) -> None:
    print(f"Hardware: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo over loopback\n")
    print("| all-reduce of | KB | us |")
    print("|---|---:|---:|")
    for r in collectives:
        print(f"| {r['tokens']} x {LARGER['hidden_size']} float32 | {r['bytes'] / 1024:.0f} | {r['all_reduce_us']:.0f} |")
    print()
    print("| TP x threads | step | step ms | all-reduce ms (rank 0) | all-reduce ms (min of ranks) | control ms "
          "| all-reduce share |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in steps:
        what = f"prefill {r['tokens']}" if r["kind"] == "prefill" else f"decode x{r['batch']}"
        print(f"| {r['tp']} x {r['threads_per_rank']} | {what} | {r['step_ms']:.1f} | {r['all_reduce_ms']:.2f} "
              f"| {r['all_reduce_min_ms']:.2f} | {r['control_ms']:.2f} | {r['all_reduce_share']:.0%} |")
    print("\n| prompt TP -> token TP | prompt tokens | KV MB | prefill ms | layer-wise TTFT ms | serialized ms "
          "| visible ms | visible / serialized |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in transfers:
        print(f"| {r['prompt_tp']} -> {r['token_tp']} | {r['prompt_tokens']} | {r['kv_bytes'] / 2**20:.1f} "
              f"| {r['prefill_ms']:.1f} | {r['layerwise_ttft_ms']:.1f} | {r['serialized_transfer_ms']:.2f} "
              f"| {r['visible_transfer_ms']:.2f} | {r['visible_fraction']:.0%} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short prompts, small batches, two repeats")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill-lens", default="128,512,2048")
    p.add_argument("--decode-batches", default="1,8,32")
    p.add_argument("--transfer-lens", default="512,2048")
    p.add_argument("--json", type=Path, help="write {'collectives', 'steps', 'transfers'} rows to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.prefill_lens, args.decode_batches, args.transfer_lens = 2, "128", "4", "128"
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        model = write_shape_checkpoint(Path(tmp) / "larger", LARGER)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        collectives = collective_rows(store, sorted({1, *ints(args.decode_batches), *ints(args.prefill_lens)}),
                                      20 * args.repeats)
        steps = []
        for tp, threads in ((1, 1), (2, 1), (1, 2)):
            steps += step_rows(store, model, tp, threads, ints(args.prefill_lens), ints(args.decode_batches),
                               args.repeats)
        transfers = []
        for prompt_tp, token_tp in ((1, 1), (1, 2), (2, 1)):
            transfers += transfer_rows(store, model, prompt_tp, token_tp, ints(args.transfer_lens), args.repeats)
    print_tables(collectives, steps, transfers)
    if args.json:
        args.json.write_text(json.dumps({"collectives": collectives, "steps": steps, "transfers": transfers},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
