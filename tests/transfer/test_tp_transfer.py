"""KV transfer between tensor-parallel workers, in this process over gloo, or written straight into
the token ranks' caches (ipc: shared memory): each worker's rank 0 a WorkerLoop, its other ranks
TPFollowers on threads, every rank with a transport of its own. For prompt / token TP (1, 2),
(2, 1), (2, 2) and (4, 2), one-shot and layer-wise, the disaggregated output equals the colocated
one-rank engine's, and both sides end clean (no request, every block free); later turns of a
conversation travel from the token worker's cached prefix on; an export ended without a hand-off
leaves no block held for any prompt rank's direct part; a prompt rank that dies fails the transfer
on the token side with no block leaked (direct: once the prompt worker is gone)."""
from __future__ import annotations

import datetime
import itertools
import time

import pytest
import torch
import torch.distributed as dist

from splitserve.cluster.worker_loop import WorkerLoop
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer.direct_link import DirectFabric
from splitserve.transfer.follower_kv import FollowerKV
from splitserve.transfer.handoff import make_transport
from splitserve.transfer.kv_routes import rank_peer
from splitserve.transfer.torch_link import TorchFabric
from tests.cluster.test_worker_loop import Sink, assert_clean, run, tokens
from tests.engine.engine_helpers import one_thread  # noqa: F401  (pytest fixture, module-wide)
from tests.engine.hf_checkpoints import prompt_ids, tokenizers_by_kind, write_checkpoint  # noqa: F401
from tests.engine.tp_helpers import Followers, join, store_server

ENGINE = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=128)
LAYERWISE = 24  # prompts this long or longer stream layer by layer
TIMEOUT = 10.0
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
_names = itertools.count()


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizers_by_kind):  # noqa: F811
    path = tmp_path_factory.mktemp("tp_transfer") / "llama_mha"  # 4 KV heads
    write_checkpoint(path, "llama_mha", tokenizers_by_kind)
    return str(path)


@pytest.fixture(scope="module")
def server():
    return store_server()


def fabric(server, worker_id: str, backend: str, cache: torch.Tensor) -> TorchFabric | DirectFabric:
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    torch_fabric = TorchFabric(client, worker_id, torch.device("cpu"), TIMEOUT)
    return torch_fabric if backend == "gloo" else DirectFabric(client, worker_id, cache, torch_fabric, TIMEOUT)


class TPWorker:
    """One worker of `size` ranks in `role`: a WorkerLoop on rank 0, followers on threads."""

    def __init__(self, server, model: str, worker_id: str, role: str, size: int, dies: bool = False,
                 backend: str = "gloo", chunk: int | None = None):
        """`dies`: rank 1 leaves its loop at the first command it gets; `chunk`: prompts longer than
        this prefill in chunks of it."""
        chunks = {} if chunk is None else {"prompt_chunk_tokens": chunk, "prompt_token_budget": chunk}
        config = EngineConfig(policy=role, **ENGINE, **chunks)
        self.followers = None
        group = None
        if size > 1:
            name = f"{worker_id}-tp"

            def setup(follower):
                peer = rank_peer(worker_id, follower.group.rank)
                FollowerKV(follower, make_transport(follower, fabric(server, peer, backend, follower.kv_cache.data),
                                                    TIMEOUT))
                if dies and follower.group.rank == 1:
                    follower.on_command = _die

            self.followers = Followers(server, name, size, model, config, TIMEOUT, setup=setup)
            group = join(server, name, 0, size, TIMEOUT)
        engine = LLMEngine(model, config, tp=group)
        if self.followers is not None:
            self.followers.wait_ready()
        transport = make_transport(engine, fabric(server, worker_id, backend, engine.kv_cache.data), TIMEOUT)
        self.loop = WorkerLoop(engine, transport, worker_id, LAYERWISE)
        self.loop.start()

    def close(self) -> None:
        self.loop.stop()
        if self.followers is not None:
            if self.loop.engine.tp_leader.broken is None:
                self.loop.engine.tp_leader.stop()
            self.followers.join(5)


def _die(command):
    raise RuntimeError(f"rank 1 died at {type(command).__name__}")


@pytest.fixture(scope="module")
def colocated(model):
    engine = LLMEngine(model, **ENGINE)

    def want(prompt):
        engine.add_request("r", prompt, GREEDY)
        while engine.has_unfinished_requests():
            outs = [o for o in engine.step() if o.finished]
        return outs[0]

    return want


def disaggregate(prompt_worker: TPWorker, token_worker: TPWorker, prompt_tp: int, request_id: str, prompt):
    token_sink, prompt_sink = Sink(), Sink()
    ticket = run(token_worker.loop, lambda *a: token_worker.loop.reserve(*a, prompt_tp=prompt_tp), request_id,
                 prompt, GREEDY, prompt_worker.loop.worker_id, token_sink)
    run(prompt_worker.loop, prompt_worker.loop.prefill, ticket, prompt, GREEDY, prompt_sink)
    return ticket, prompt_sink, token_sink


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
@pytest.mark.parametrize("prompt_tp, token_tp", [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2)])
def test_disaggregated_equals_colocated(server, model, colocated, prompt_tp, token_tp, backend):
    n = next(_names)
    prompt_worker = TPWorker(server, model, f"p{n}", "prompt", prompt_tp, backend=backend)
    token_worker = TPWorker(server, model, f"t{n}", "token", token_tp, backend=backend)
    try:
        for i, length in enumerate((9, 40)):  # one-shot, then layer-wise
            prompt = prompt_ids(i + 7, length, 300)
            ticket, prompt_sink, token_sink = disaggregate(prompt_worker, token_worker, prompt_tp, f"r{i}", prompt)
            assert len(ticket.parts) == max(prompt_tp, token_tp) and ticket.parts[0].layerwise == (length >= LAYERWISE)
            assert all((part.dest is not None) == (backend == "ipc") for part in ticket.parts)
            deltas = token_sink.until_final()
            assert deltas[-1].error is None
            reference = colocated(prompt)
            assert prompt_sink.next().token_ids == tuple(reference.token_ids[:1])
            assert tokens(deltas) == reference.token_ids
            logprobs = [lp for d in deltas for lp in d.logprobs]  # the first token's come from the prompt side
            assert len(logprobs) == len(reference.token_ids) and logprobs[0] == {}
            for got, want in zip(logprobs[1:], reference.outputs[0].logprobs[1:]):
                assert got.keys() == want.keys() and max(abs(got[k] - want[k]) for k in got) < 1e-4
        assert_clean(prompt_worker.loop)
        assert_clean(token_worker.loop)
    finally:
        prompt_worker.close()
        token_worker.close()


def test_later_turns_travel_from_the_token_workers_cached_prefix_on(server, model, colocated):
    """Prompt TP 2 -> token TP 2: turn 2 (layer-wise) and turn 3 (one-shot) carry only the KV after
    the blocks the token worker cached from the turns before, on every part."""
    n = next(_names)
    prompt_worker = TPWorker(server, model, f"p{n}", "prompt", 2)
    token_worker = TPWorker(server, model, f"t{n}", "token", 2)
    try:
        prompt, reused = prompt_ids(21, 20, 300), 0
        for turn, (more, start, layerwise) in enumerate([(0, 0, False), (30, 24, True), (4, 64, False)]):
            prompt = prompt + prompt_ids(turn, more + 1, 300)[1:]  # turn 1: 20 tokens, 2: 58, 3: 70
            ticket, _, token_sink = disaggregate(prompt_worker, token_worker, 2, f"r{turn}", prompt)
            assert {(p.start_token, p.layerwise) for p in (ticket, *ticket.parts)} == {(start, layerwise)}
            deltas = token_sink.until_final()
            assert deltas[-1].error is None and tokens(deltas) == colocated(prompt).token_ids
            prompt = prompt + tokens(deltas)  # the answer: its KV, but its last token's, is cached now
            reused += start
        assert run(token_worker.loop, lambda: token_worker.loop.importer.kv_tokens_reused) == reused
        assert_clean(prompt_worker.loop)
        assert_clean(token_worker.loop)
    finally:
        prompt_worker.close()
        token_worker.close()


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunks"])
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_windowed_layers_travel_from_their_windows_reach_on_every_rank(
        server, tmp_path, tokenizers_by_kind, backend, chunk):  # noqa: F811
    """Gemma 2 (a window of 16 on every other layer: two layer groups), prompt TP 2 -> token TP 2:
    each part carries the windowed layers from the block their first decode reaches, the full
    ones whole, one-shot and layer-wise; the output is the one-rank engine's. The layer-wise
    threshold counts a layer's tokens on average: 26 tokens, (26 + 18) / 2 of them a layer, go in
    one shot. With 16-token chunks every rank streams each chunk's pieces (the windowed layers'
    from position 24 on: none in the first chunk)."""
    path = str(tmp_path / "gemma2")
    write_checkpoint(path, "gemma2", tokenizers_by_kind)
    reference = LLMEngine(path, **ENGINE)
    n = next(_names)
    prompt_worker = TPWorker(server, path, f"p{n}", "prompt", 2, backend=backend, chunk=chunk)
    token_worker = TPWorker(server, path, f"t{n}", "token", 2, backend=backend)
    try:
        for i, length in enumerate((26, 41)):  # one-shot, then layer-wise
            prompt = prompt_ids(i + 30, length, 300)
            ticket, _, token_sink = disaggregate(prompt_worker, token_worker, 2, f"r{i}", prompt)
            reach = (length - 16 + 1) // ENGINE["block_size"] * ENGINE["block_size"]
            windowed = reference.kv_cache.groups.windows.index(16)
            assert reach and {p.group_starts[windowed] for p in (ticket, *ticket.parts)} == {reach}
            assert {p.group_starts[1 - windowed] for p in (ticket, *ticket.parts)} == {0}
            assert ticket.parts[0].layerwise == (length == 41)
            deltas = token_sink.until_final()
            reference.add_request(f"r{i}", prompt, GREEDY)
            while reference.has_unfinished_requests():
                want = [o for o in reference.step() if o.finished]
            assert deltas[-1].error is None and tokens(deltas) == want[0].token_ids
        assert_clean(prompt_worker.loop)
        assert_clean(token_worker.loop)
    finally:
        prompt_worker.close()
        token_worker.close()


@pytest.mark.parametrize("prompt_tp, token_tp", [(2, 1), (2, 2)])
def test_an_export_ended_without_hand_off_releases_every_ranks_direct_part(server, model, prompt_tp, token_tp):
    """Direct, layer-wise: the first token ends the request (max_tokens=1), so rank 0 cancels the
    transfer after prompt rank 1 claimed its part and wrote into the token ranks' caches. Rank 1
    cancels its part too, so the token side holds no block for it (it would wait for that
    sender's last message, or its link's end, for as long as the prompt worker lives)."""
    n = next(_names)
    prompt_worker = TPWorker(server, model, f"p{n}", "prompt", prompt_tp, backend="ipc")
    token_worker = TPWorker(server, model, f"t{n}", "token", token_tp, backend="ipc")
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        for i in range(2):
            prompt = prompt_ids(i + 11, 40, 300)
            token_sink, prompt_sink = Sink(), Sink()
            ticket = run(token_worker.loop, lambda *a: token_worker.loop.reserve(*a, prompt_tp=prompt_tp),
                         f"r{i}", prompt, one, prompt_worker.loop.worker_id, token_sink)
            assert ticket.layerwise and any(part.prompt_rank == 1 and part.dest for part in ticket.parts)
            run(prompt_worker.loop, prompt_worker.loop.prefill, ticket, prompt, one, prompt_sink)
            assert prompt_sink.until_final()[-1].finish_reason == "length"
            # the token side hears the cancel on a later poll: done once it holds no request at all
            wait_until(lambda: run(token_worker.loop, lambda: token_worker.loop.engine.num_requests) == 0)
        assert_clean(prompt_worker.loop)
        assert_clean(token_worker.loop)
    finally:
        prompt_worker.close()
        token_worker.close()


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_prompt_rank_that_dies_fails_the_transfer_and_leaks_no_block(server, model, backend):
    """Prompt TP 2 -> token TP 2, layer-wise: prompt rank 1 stops at its first command, so rank 0's
    step never completes (its all-reduce has no partner) and no part is pushed. The token side fails
    the whole import when a part has been silent for the transport's timeout, abandons the other
    and frees every block; the prompt worker reports itself broken instead of stepping again. A
    direct transfer's blocks are held while the prompt worker that claimed it lives (it could still
    write), and freed once it stops."""
    n = next(_names)
    prompt_worker = TPWorker(server, model, f"p{n}", "prompt", 2, dies=True, backend=backend)
    token_worker = TPWorker(server, model, f"t{n}", "token", 2, backend=backend)
    try:
        _, _, token_sink = disaggregate(prompt_worker, token_worker, 2, "r", prompt_ids(3, 40, 300))
        deltas = token_sink.until_final()
        assert deltas[-1].error is not None and f"peer 'p{n}" in deltas[-1].error
        if backend == "ipc":  # rank 0 claimed its part: held while its worker lives
            assert run(token_worker.loop, lambda: token_worker.loop.importer.num_held) == 1
        else:
            assert_clean(token_worker.loop)
        assert "died" in str(prompt_worker.followers.errors[1])
        assert not run(prompt_worker.loop, lambda: prompt_worker.loop.health().healthy)
        if backend == "ipc":
            prompt_worker.close()  # its links close: it writes no more
            wait_until(lambda: run(token_worker.loop, lambda: token_worker.loop.importer.num_held) == 0)
            assert_clean(token_worker.loop)
    finally:
        prompt_worker.close()
        token_worker.close()


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
