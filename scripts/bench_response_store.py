"""Benchmark the response store: what keeping responses on disk (`ingress.persist_stored_responses`)
costs per call of the store actor, against the same store in memory, and how long a restarted
store takes to read its directory back. The store keeps JSON text: an ingress replica encodes
each response it keeps and decodes what a continuation reads, timed here apart from the store's
calls; one full pass of the collector over the process holding both stores is timed after the
puts, and one response's size as the Python objects it decodes to is set beside its text's,
with what pickling each (as Ray does between processes) costs both ways.

Each response is a Response with one message of --text-chars characters that read a conversation
of --turns items of the same size (a continuation's copy of its earlier turns). The two stores
take the same calls interleaved (put to one, then the other), each call timed; then every kept
response is read once (`get`, then `context` as a continuation does); then a new store opens the
directory. The store's bound (--keep) is below --responses, so the last puts also drop the oldest.
With --logprob-tokens, each message also carries that many tokens' logprobs at top 5 (a response
that asked for `message.output_text.logprobs`): 20,000 make an entry of about 6 MB.

Then one conversation (`/v1/conversations`) grows by --conversation-turns turns (a user item and an
assistant item of --text-chars each, as a response in it adds them), in memory and on disk, where
each change rewrites the conversation's file whole: the add's cost at the first and the last tenth
of the turns shows how that grows with the conversation.

    python scripts/bench_response_store.py                 # ~10 s on 2 shared cores
    python scripts/bench_response_store.py --responses 20000 --json response_store.json
    python scripts/bench_response_store.py --responses 20 --keep 10 --logprob-tokens 20000   # large entries
    python scripts/bench_response_store.py --responses 12 --keep 10 --logprob-tokens 20000 --ray

With --ray, the store also runs as a Ray actor on a local cluster of its own (as the controller
runs it), and a caller keeps --keep responses there and retrieves each once, as an ingress replica
does: its put timed with the caller's encode, its retrieve until the body's bytes are in hand.
"""
from __future__ import annotations

import argparse
import gc
import json
import pickle
import platform
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from splitserve.api.conversation_store import ConversationStore
from splitserve.api.json_pieces import json_text
from splitserve.api.response_store import ResponseStore, Stored
from splitserve.cluster.stored_responses import continued
from splitserve.cluster.persisted_responses import PersistedResponseStore
from splitserve.machine import cpu_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--responses", type=int, default=3000, help="responses kept (3000)")
    p.add_argument("--keep", type=int, default=2000, help="the store's bound on responses (2000)")
    p.add_argument("--text-chars", type=int, default=2000, help="characters of each message (2000)")
    p.add_argument("--turns", type=int, default=4, help="conversation items each response read (4)")
    p.add_argument("--logprob-tokens", type=int, default=0, help="tokens' logprobs each message carries (0)")
    p.add_argument("--conversation-turns", type=int, default=500, help="turns one conversation grows by (500)")
    p.add_argument("--dir", type=Path, help="directory for the files (a fresh temporary one)")
    p.add_argument("--ray", action="store_true", help="also time puts and retrieves through a Ray actor")
    p.add_argument("--json", type=Path, help="write the rows here")
    return p.parse_args(argv)


def message(item_id: str, role: str, kind: str, text: str) -> dict:
    return {"type": "message", "id": item_id, "role": role, "status": "completed",
            "content": [{"type": kind, "text": text, **({"annotations": []} if kind == "output_text" else {})}]}


def logprobs(tokens: int) -> list[dict]:
    """The Responses API's logprobs of `tokens` tokens, each with 5 alternatives."""
    return [{"token": "a", "logprob": -0.1, "bytes": [97],
             "top_logprobs": [{"token": chr(48 + j), "logprob": -1.0 - j, "bytes": [48 + j]} for j in range(5)]}
            for _ in range(tokens)]


def response(n: int, text: str, logprob_tokens: int = 0) -> dict:
    out = message(f"msg_out{n}", "assistant", "output_text", text)
    if logprob_tokens:
        out["content"][0]["logprobs"] = logprobs(logprob_tokens)
    return {"id": f"resp_{n:08d}", "object": "response", "created_at": 1796000000 + n, "status": "completed",
            "model": "demo", "background": False, "store": True, "output": [out],
            "usage": {"input_tokens": 512, "output_tokens": 128, "total_tokens": 640}}


def percentiles(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"p50_us": round(statistics.median(ordered) * 1e6, 1),
            "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6, 1)}


def timed(call, *args) -> float:
    started = time.perf_counter()
    call(*args)
    return time.perf_counter() - started


def run(args: argparse.Namespace, root: Path) -> dict:
    text = ("splitserve keeps this " * (args.text_chars // 22 + 1))[:args.text_chars]
    items = [message(f"msg_in{k}", "user" if k % 2 == 0 else "assistant",
                     "input_text" if k % 2 == 0 else "output_text", text) for k in range(args.turns)]
    bound = 1 << 40  # bytes: the count bound is the one exercised
    stores = {"memory": ResponseStore(args.keep, bound), "disk": PersistedResponseStore(args.keep, bound, root)}
    put = {name: [] for name in stores}
    read = {name: [] for name in stores}
    encode, decode = [], []  # an ingress replica's part
    for n in range(args.responses):
        kept_response = response(n, text, args.logprob_tokens)
        started = time.perf_counter()
        stored, items_text = Stored.encode(kept_response), json_text(items)
        encode.append(time.perf_counter() - started)
        for name, store in stores.items():
            put[name].append(timed(store.put, stored, items_text))
    started = time.perf_counter()
    gc.collect()
    collection_s = time.perf_counter() - started
    kept = [f"resp_{n:08d}" for n in range(args.responses - args.keep, args.responses)]
    for response_id in kept:
        for name, store in stores.items():
            read[name].append(timed(lambda: (store.get(response_id), store.context(response_id))))
        decode.append(timed(continued, *stores["memory"].context(response_id)))
    stores["disk"]._lock.release()  # as its process would on exit
    started = time.perf_counter()
    reopened = PersistedResponseStore(args.keep, bound, root)
    load_s = time.perf_counter() - started
    files = list(root.glob("*.json"))
    rows = [{"store": name, "puts": len(put[name]), "reads": len(read[name]),
             **{f"put_{k}": v for k, v in percentiles(put[name]).items()},
             **{f"read_{k}": v for k, v in percentiles(read[name]).items()}} for name in stores]
    return {"cpu": cpu_name(), "python": platform.python_version(), "responses": args.responses, "keep": args.keep,
            "entry_bytes": reopened.bytes // max(len(reopened), 1), "rows": rows,
            "put_ratio_disk_vs_memory": round(rows[1]["put_p50_us"] / rows[0]["put_p50_us"], 2),
            **{f"replica_encode_{k}": v for k, v in percentiles(encode).items()},
            **{f"replica_decode_{k}": v for k, v in percentiles(decode).items()},
            "full_collection_s": round(collection_s, 6), **one_response(stores["memory"].get(kept[-1])),
            "files": len(files), "directory_bytes": sum(path.stat().st_size for path in files),
            "reopen_s": round(load_s, 3), "reopened": len(reopened),
            "reopened_equal": all(reopened.get(r) == stores["memory"].get(r) for r in kept), "text": text}


def one_response(text: str) -> dict:
    """One kept response as its text and as the objects it decodes to: their sizes, and a pickle
    round trip of each (what crossing between processes costs, through Ray)."""
    tracemalloc.start()
    value = json.loads(text)
    objects_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"text_bytes": len(text), "objects_bytes": objects_bytes,
            "pickle_text_s": round(timed(lambda: pickle.loads(pickle.dumps(text, protocol=5))), 4),
            "pickle_objects_s": round(timed(lambda: pickle.loads(pickle.dumps(value, protocol=5))), 4)}


def through_ray(args: argparse.Namespace, text: str) -> dict:
    """--keep responses kept in a store actor, then each retrieved once, as an ingress replica does."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        store = ray.remote(ResponseStore).remote(args.keep, 1 << 40)
        ids = [f"resp_{n:08d}" for n in range(args.keep)]
        ray.get(store.status.remote(ids[0]))  # started
        puts = [timed(lambda kept: ray.get(store.put.remote(Stored.encode(kept), "[]")),
                      response(n, text, args.logprob_tokens)) for n in range(args.keep)]
        retrieves = [timed(lambda response_id: ray.get(store.get.remote(response_id)).encode(), response_id)
                     for response_id in ids]
    finally:
        ray.shutdown()
    return {**{f"ray_put_{k}": v for k, v in percentiles(puts).items()},
            **{f"ray_retrieve_{k}": v for k, v in percentiles(retrieves).items()}}


def grow_conversation(args: argparse.Namespace, root: Path, text: str) -> list[dict]:
    """One conversation's adds, in memory and on disk (a store of its own in `root`/grow)."""
    bound = 1 << 40
    stores = {"memory": ResponseStore(10, bound, conversations=ConversationStore(10, bound)),
              "disk": PersistedResponseStore(10, bound, root / "grow", max_conversations=10,
                                             max_conversation_bytes=bound)}
    ids = {name: store.conversation("create", {}, [])["id"] for name, store in stores.items()}
    adds = {name: [] for name in stores}
    for turn in range(args.conversation_turns):
        items = [message(f"msg_u{turn}", "user", "input_text", text),
                 message(f"msg_a{turn}", "assistant", "output_text", text)]
        for name, store in stores.items():
            adds[name].append(timed(store.conversation, "add", ids[name], items))
    tenth = max(1, args.conversation_turns // 10)
    size = stores["memory"].conversations.bytes
    return [{"store": name, "turns": args.conversation_turns, "conversation_bytes": size,
             **{f"first_add_{k}": v for k, v in percentiles(adds[name][:tenth]).items()},
             **{f"last_add_{k}": v for k, v in percentiles(adds[name][-tenth:]).items()}} for name in stores]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="response-store-") as scratch:
        result = run(args, args.dir or Path(scratch))
        text = result.pop("text")
        result["conversation_rows"] = grow_conversation(args, args.dir or Path(scratch), text)
    if args.ray:
        result.update(through_ray(args, text))
    print(f"CPU: {result['cpu']}; {result['responses']} responses of {result['entry_bytes']} bytes, "
          f"the store bound to {result['keep']}")
    print("| store | put p50 us | put p99 us | get+context p50 us | get+context p99 us |")
    print("|---|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['store']} | {row['put_p50_us']} | {row['put_p99_us']} | {row['read_p50_us']} | "
              f"{row['read_p99_us']} |")
    print(f"the replica's encode of a response and its items: p50 {result['replica_encode_p50_us']} us; its "
          f"decode of a continuation's context: p50 {result['replica_decode_p50_us']} us")
    print(f"a full collection over both stores: {result['full_collection_s']} s; one response: "
          f"{result['text_bytes'] / 1e6:.2f} MB of text, {result['objects_bytes'] / 1e6:.2f} MB as objects; "
          f"a pickle round trip: {result['pickle_text_s']} s as text, {result['pickle_objects_s']} s as objects")
    print(f"disk/memory put (p50): {result['put_ratio_disk_vs_memory']}x; {result['files']} files, "
          f"{result['directory_bytes'] / 1e6:.1f} MB, read back in {result['reopen_s']} s "
          f"({result['reopened']} responses, equal: {result['reopened_equal']})")
    print(f"one conversation grown by {args.conversation_turns} turns "
          f"({result['conversation_rows'][0]['conversation_bytes'] / 1e6:.1f} MB of JSON at the end):")
    print("| store | add p50 us, first tenth | add p50 us, last tenth | add p99 us, last tenth |")
    print("|---|---|---|---|")
    for row in result["conversation_rows"]:
        print(f"| {row['store']} | {row['first_add_p50_us']} | {row['last_add_p50_us']} | {row['last_add_p99_us']} |")
    if args.ray:
        print(f"through a Ray actor: put p50 {result['ray_put_p50_us'] / 1e3:.1f} ms (p99 "
              f"{result['ray_put_p99_us'] / 1e3:.1f}), retrieve p50 {result['ray_retrieve_p50_us'] / 1e3:.1f} ms "
              f"(p99 {result['ray_retrieve_p99_us'] / 1e3:.1f})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
