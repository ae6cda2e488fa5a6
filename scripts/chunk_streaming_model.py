"""What streaming each chunk's KV as it lands saves a long prompt, by the simulator's own models (no
measurement): a lone prompt prefilled in chunks of `prompt_chunk_tokens` on a prompt worker, its
KV sent layer by layer to a token worker over a link of the given bandwidth. Per prompt length
and bandwidth: the time to first token (the prefill's iterations, then what the transfer leaves
visible after the last) when every chunk streams its pieces (`KVExport`, as the prompt worker
does), against the whole KV streaming during the last chunk only (splitserve before wire=3).

The prefill's iterations come from the Splitwise profiles' performance model (Llama2-70B, TP 8,
an H100 machine by default); those profiles have no chunked sweep, so a chunk costs the same
whatever the context before it (a real chunk's attention grows with it: the last chunk is longer,
and hides more, than modelled here). The link is `TransferModel`'s (Llama2-70B's KV, 80 layers).

    python scripts/chunk_streaming_model.py --lens 16384,32768,131072 --gbps 400,100
"""
from __future__ import annotations

import argparse
import dataclasses

from splitserve.sim.perf_model import load_perf_models
from splitserve.sim.transfer import KVExport, TransferModel


def ttft(perf, transfer: TransferModel, prompt_tokens: int, chunk: int) -> tuple[float, float, float]:
    """(prefill seconds, visible transfer streaming each chunk, visible streaming in the last chunk only)."""
    export, start, duration = KVExport(prompt_tokens, 0, (0,), "p0"), 0.0, 0.0
    for lo in range(0, prompt_tokens, chunk):
        hi = min(lo + chunk, prompt_tokens)
        duration = perf.iteration_time(hi - lo, 0, 0, (hi - lo) * lo)
        if hi < prompt_tokens:
            export.chunk_done(transfer, start, duration, hi)
            start += duration
    last_chunk_only = transfer.visible_time(prompt_tokens, duration)
    return start + duration, export.hand_off(transfer, start, duration), last_chunk_only


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lens", default="8192,16384,32768,65536,131072", help="prompt lengths (tokens)")
    p.add_argument("--gbps", default="400,100", help="link bandwidths (Gb/s)")
    p.add_argument("--chunk", type=int, default=8192, help="prompt_chunk_tokens")
    p.add_argument("--hardware", default="h100-80gb")
    args = p.parse_args(argv)
    perf = load_perf_models()[("llama2-70b", args.hardware, 8)]
    rows = []
    print(f"Llama2-70B, TP 8 on {args.hardware}, chunks of {args.chunk}; seconds\n")
    print("| prompt tokens | link Gb/s | prefill | visible, each chunk streams | visible, last chunk only "
          "| TTFT ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for gbps in (float(x) for x in args.gbps.split(",")):
        transfer = dataclasses.replace(TransferModel(), bandwidth_bytes_per_s=gbps * 1e9 / 8)
        for n in (int(x) for x in args.lens.split(",")):
            prefill, streamed, last_only = ttft(perf, transfer, n, args.chunk)
            rows.append({"prompt_tokens": n, "gbps": gbps, "prefill_s": prefill, "visible_streamed_s": streamed,
                         "visible_last_chunk_s": last_only,
                         "ttft_ratio": (prefill + streamed) / (prefill + last_only)})
            print(f"| {n} | {gbps:g} | {prefill:.2f} | {streamed:.3f} | {last_only:.3f} "
                  f"| {rows[-1]['ttft_ratio']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
