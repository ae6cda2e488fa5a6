"""KV transfer from a prompt worker to a token worker, against a colocated engine (CPU).

Two processes per backend, one torch thread each: a prompt worker (prompt-policy engine +
KVExporter) and a token worker (token-policy engine + KVImporter), meeting through a TCPStore:
`gloo` sends the KV over a gloo pair on loopback, `ipc` writes it straight into the token worker's
cache in shared memory (the same-node path; CUDA IPC on GPUs). The colocated reference is a plain
engine in the prompt worker's process (same core). Per prompt length, median of --repeats runs,
the backends interleaved, times from time.monotonic(), which is system-wide on Linux and so
comparable across processes:

- prefill_ms: the colocated prefill step (TTFT of the colocated engine);
- serialized_transfer_ms: one-shot push after the prefill, until the last byte has landed and the
  token worker holds the request (first token sampled -> KV landed);
- visible_transfer_ms: with layer-wise streaming, what the transfer adds to the critical path in
  the same run: the compute thread's time packing and pushing layers during the prefill, plus the
  tail from the first token to the last layer landing (the part not hidden behind compute);
- ttft_ms: disaggregated time to first token (prompt worker), against colocated ttft;
- second_token_overhead: (second-token latency disaggregated / colocated) - 1, where the second
  token's latency is the time from the first token to the second one.

    python scripts/bench_kv_transfer.py --json kv.json           # demo model and a larger dummy shape
    python scripts/bench_kv_transfer.py --backends ipc --quick    # smoke run of one backend
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

LARGER = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408,
          "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 4160,
          "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
NEVER = 10**9  # a layer-wise threshold no prompt reaches: one-shot transfer


def write_dummy_checkpoint(root: Path) -> str:
    """config.json plus a word-level tokenizer.json: enough for load_format='dummy'."""
    from tokenizers import Tokenizer, models

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(LARGER))
    Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>")).save(str(root / "tokenizer.json"))
    return str(root)


def engine_args(model: str) -> dict:
    args = {"device": "cpu", "dtype": "float32", "enable_prefix_caching": False, "kv_cache_memory_bytes": 1 << 30}
    return args if model == "demo" else {**args, "load_format": "dummy"}


# ---- the two worker processes --------------------------------------------------------------
def _transport(engine, worker_id: str, port: int, backend: str):
    from splitserve.transfer.direct_link import DirectFabric
    from splitserve.transfer.handoff import make_transport
    from splitserve.transfer.torch_link import TorchFabric

    fabric = TorchFabric.join("127.0.0.1", port, worker_id, torch.device("cpu"), 120.0)
    if backend == "ipc":
        fabric = DirectFabric(fabric.store, worker_id, engine.kv_cache.data, fabric, 120.0)
    return make_transport(engine, fabric, 120.0)


def prompt_process(model: str, port: int, backend: str, conn) -> None:
    from splitserve import LLMEngine, SamplingParams
    from splitserve.transfer.handoff import KVExporter

    torch.set_num_threads(1)
    engine = LLMEngine(model, policy="prompt", **engine_args(model))
    colocated = LLMEngine(model, policy="prefill_first", **engine_args(model))
    exporter = KVExporter(engine, _transport(engine, "prompt", port, backend))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    conn.send("ready")
    while (cmd := conn.recv()) != "stop":
        if cmd[0] == "colocated":
            start = time.monotonic()
            colocated.add_request(cmd[1], cmd[2], params, start)
            first = colocated.step()[0].token_timestamps[0]
            second = colocated.step()[0].token_timestamps[1]
            conn.send((first - start, second - first))
        else:  # ("push", ticket, prompt)
            start = time.monotonic()
            exporter.add(cmd[1], cmd[2], params, start)
            first = exporter.step()[0].token_timestamps[0]
            conn.send((start, first, exporter.stream_seconds))


def token_process(model: str, port: int, backend: str, conn) -> None:
    from splitserve import LLMEngine, SamplingParams
    from splitserve.transfer.handoff import KVImporter

    torch.set_num_threads(1)
    engine = LLMEngine(model, policy="token", **engine_args(model))
    importer = KVImporter(engine, _transport(engine, "token", port, backend), "token")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    conn.send("ready")
    while (cmd := conn.recv()) != "stop":
        _, request_id, prompt, threshold = cmd
        importer.layerwise_threshold = threshold
        conn.send(importer.reserve(request_id, prompt, params, "prompt"))
        landed = []
        while not landed:
            landed, failures = importer.poll(timeout=1.0)
            if failures:
                raise RuntimeError(failures)
        landed_at = time.monotonic()
        second = engine.step()[0].token_timestamps[1]
        conn.send((landed_at, second))


# ---- measuring -------------------------------------------------------------------------------
class Pair:
    def __init__(self, model: str, backend: str):
        ctx = mp.get_context("spawn")
        self.backend = backend
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.prompt, prompt_end = ctx.Pipe()
        self.token, token_end = ctx.Pipe()
        args = (model, self.store.port, backend)
        self.procs = [ctx.Process(target=prompt_process, args=(*args, prompt_end), daemon=True),
                      ctx.Process(target=token_process, args=(*args, token_end), daemon=True)]
        for proc in self.procs:
            proc.start()
        self.prompt.recv(), self.token.recv()
        self.count = 0

    def disaggregated(self, prompt: list[int], threshold: int) -> dict:
        self.count += 1
        request_id = f"r{self.count}"
        self.token.send(("reserve", request_id, prompt, threshold))
        self.prompt.send(("push", self.token.recv(), prompt))
        start, first, streaming = self.prompt.recv()
        landed, second = self.token.recv()
        return {"start": start, "first": first, "streaming": streaming, "landed": landed, "second": second}

    def colocated(self, prompt: list[int]) -> tuple[float, float]:
        self.count += 1
        self.prompt.send(("colocated", f"c{self.count}", prompt))
        return self.prompt.recv()

    def close(self) -> None:
        self.prompt.send("stop"), self.token.send("stop")
        for proc in self.procs:
            proc.join(30)


def measure(pairs: list[Pair], model: str, n: int, repeats: int, kv_bytes_per_token: int) -> list[dict]:
    """One row per pair (backend); the pairs' runs interleaved."""
    prompt = [1] + [(7 * i) % 250 + 3 for i in range(n - 1)]
    rows = {pair.backend: {k: [] for k in ("prefill", "coloc_second", "serialized", "visible", "ttft", "second")}
            for pair in pairs}
    for pair in pairs:
        pair.colocated(prompt)  # warm-up: both engines' first steps, and the link's set-up, are not measured
        pair.disaggregated(prompt, NEVER)
        pair.disaggregated(prompt, 0)
    for _ in range(repeats):
        for pair in pairs:
            ttft, second = pair.colocated(prompt)
            one_shot = pair.disaggregated(prompt, NEVER)
            layered = pair.disaggregated(prompt, 0)
            got = rows[pair.backend]
            got["prefill"].append(ttft)
            got["coloc_second"].append(second)
            got["serialized"].append(one_shot["landed"] - one_shot["first"])
            got["visible"].append(layered["landed"] - layered["first"] + layered["streaming"])
            got["ttft"].append(layered["first"] - layered["start"])
            got["second"].append(layered["second"] - layered["first"])
    return [_row(backend, got, model, n, repeats, kv_bytes_per_token) for backend, got in rows.items()]


def _row(backend: str, rows: dict, model: str, n: int, repeats: int, kv_bytes_per_token: int) -> dict:
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    return {"backend": backend, "model": model, "prompt_tokens": n, "kv_bytes": n * kv_bytes_per_token,
            "prefill_ms": med["prefill"], "serialized_transfer_ms": med["serialized"],
            "visible_transfer_ms": med["visible"], "visible_fraction": med["visible"] / med["serialized"],
            "ttft_ms": med["ttft"], "colocated_ttft_ms": med["prefill"],
            "second_token_ms": med["second"], "colocated_second_token_ms": med["coloc_second"],
            "second_token_overhead": med["second"] / med["coloc_second"] - 1, "repeats": repeats}


def kv_bytes_per_token(model: str) -> int:
    from splitserve.engine.demo import demo_model_config
    from splitserve.engine.loader import load_model_config

    c = demo_model_config() if model == "demo" else load_model_config(model)
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4


def print_table(rows: list[dict]) -> None:
    print(f"Hardware: {os.cpu_count()} CPU cores, torch {torch.__version__}; gloo over loopback, ipc through shared "
          "memory; 1 thread per worker\n")
    print("| backend | model | prompt tokens | KV MB | prefill ms | serialized transfer ms | visible transfer ms "
          "| visible / serialized | TTFT ms (coloc) | 2nd token ms (coloc) | 2nd token overhead |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['backend']} | {r['model']} | {r['prompt_tokens']} | {r['kv_bytes'] / 2**20:.1f} | {r['prefill_ms']:.1f} "
              f"| {r['serialized_transfer_ms']:.2f} | {r['visible_transfer_ms']:.2f} | {r['visible_fraction']:.0%} "
              f"| {r['ttft_ms']:.1f} ({r['colocated_ttft_ms']:.1f}) | {r['second_token_ms']:.2f} "
              f"({r['colocated_second_token_ms']:.2f}) | {r['second_token_overhead']:+.0%} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="demo model, two short prompts, one repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--demo-lens", default="128,256,512,1024,2000")
    p.add_argument("--larger-lens", default="128,512,1024,2048,4096", help="'' skips the larger dummy shape")
    p.add_argument("--backends", default="gloo,ipc", help="comma-separated, measured interleaved: gloo, ipc")
    p.add_argument("--json", type=Path, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    backends = args.backends.split(",")
    if not backends or set(backends) - {"gloo", "ipc"}:
        p.error(f"--backends takes gloo and/or ipc, got {args.backends!r}")
    if args.quick:
        args.repeats, args.demo_lens, args.larger_lens = 1, "128,600", ""
    runs = [("demo", args.demo_lens)]
    tmp = tempfile.TemporaryDirectory()
    if args.larger_lens:
        runs.append((write_dummy_checkpoint(Path(tmp.name) / "larger"), args.larger_lens))
    rows = []
    for model, lens in runs:
        pairs = [Pair(model, backend) for backend in backends]
        try:
            for n in (int(x) for x in lens.split(",")):
                for row in measure(pairs, model, n, args.repeats, kv_bytes_per_token(model)):
                    rows.append({**row, "model": "demo" if model == "demo" else "larger (dummy)"})
        finally:
            for pair in pairs:
                pair.close()
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
