"""Does a long-lived Ray streaming call hold native memory per item? An async actor hands small
batches (like a token feed's) to a caller in three ways: one streaming call for the whole run
(`stream`, as splitserve's token feeds do), a new streaming call every `--every` items (`rotate`),
or one plain call per item (`calls`). Reported per item, from the run's first quarter to its end:
each side's growth of resident memory and of glibc's heap in use (`mallinfo2`).

    python scripts/ray_stream_memory.py --items 160000 --json stream-memory.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import memory_trace  # this script's folder


def source_class():
    import ray

    @ray.remote(num_cpus=0)
    class Source:
        def __init__(self):
            self.queue = asyncio.Queue()

        async def put(self, n: int) -> None:
            for i in range(n):
                self.queue.put_nowait([(f"request-{i}", ("some text", i))])

        async def feed(self, n: int | None = None):
            sent = 0
            while n is None or sent < n:
                yield await self.queue.get()
                sent += 1

        async def one(self, i: int) -> list:
            return [(f"request-{i}", ("some text", i))]

        def heap(self) -> dict:
            return memory_trace.heap_state()

    return Source


async def measure(mode: str, items: int, every: int) -> dict:
    source = source_class().remote()
    await source.heap.remote()
    stream = source.feed.remote() if mode == "stream" else None
    marks, done = [], 0
    while done < items:
        if mode == "calls":
            for i in range(every):
                await source.one.remote(i)
        else:
            await source.put.remote(every)
            if mode == "rotate":
                async for ref in source.feed.remote(every):
                    await ref
            else:
                for _ in range(every):
                    await (await stream.__anext__())
        done += every
        marks.append((done, memory_trace.heap_state(), await source.heap.remote()))
    (first_n, caller_0, callee_0), (last_n, caller_1, callee_1) = marks[len(marks) // 4], marks[-1]
    per_item = {side: {f"{key}_bytes": round((end[key] - start[key]) / (last_n - first_n), 1) for key in end}
                for side, start, end in (("caller", caller_0, caller_1), ("callee", callee_0, callee_1))}
    return {"mode": mode, "items": last_n, "every": every, "items_measured": last_n - first_n, **per_item,
            "caller_in_use_mb": round(caller_1["malloc_in_use"] / 2**20, 1),
            "callee_in_use_mb": round(callee_1["malloc_in_use"] / 2**20, 1)}


def main(argv: list[str] | None = None) -> dict:
    import ray
    from ray import cloudpickle

    from local_ray import start_ray  # this script's folder

    from splitserve.machine import cpu_name

    cloudpickle.register_pickle_by_value(memory_trace)  # the actor runs its heap_state; workers cannot import it

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=80000)
    parser.add_argument("--every", type=int, default=5000, help="items a call (rotate), and between measurements")
    parser.add_argument("--modes", default="stream,rotate,calls")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    start_ray(2)
    try:
        rows = []
        for mode in args.modes.split(","):
            rows.append(asyncio.run(measure(mode, args.items, args.every)))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    result = {"rows": rows, "ray": ray.__version__, "hardware": cpu_name()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
