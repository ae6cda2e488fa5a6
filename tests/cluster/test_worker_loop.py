"""The Ray-free worker loop: two WorkerLoops in this process (a prompt and a token worker, each
its own engine thread), joined by gRPC links on 127.0.0.1.

Reference: the greedy tokens of the offline `LLM("demo")` on the same prompts. Commands go in
through `loop.call(...)`, as the Ray actor sends them; tokens come out through per-request sinks.
"""
from __future__ import annotations

import queue

import pytest

from splitserve.cluster.worker_loop import TokenDelta, WorkerLoop
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.prefix_hash import prompt_block_hashes
from splitserve.engine.sampling_params import SamplingParams
from splitserve.placement.state import WorkerLoad
from splitserve.transfer.grpc_link import GrpcFabric
from splitserve.transfer.handoff import make_transport
from splitserve.transfer.transport import TransferTicket
from tests.engine.engine_helpers import one_thread  # noqa: F401  (pytest fixture)
from tests.transfer.cluster import _free_port

ENGINE = {"num_kv_blocks": 40, "max_model_len": 640}  # 640 token slots, a small KV tensor
BLOCK = 16  # the engine's default block size
LAYERWISE = 16  # prompts of this many tokens or more stream their KV layer by layer
LINK_TIMEOUT_S = 10.0
WAIT_S = 30.0
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SHORT = [256] + [ord(c) for c in "a short one"]  # 12 tokens: one push after the prefill
LONG = [256] + [(i * 7 + 3) % 256 for i in range(59)]  # 60 tokens: streamed per layer
FORTY = [(i * 5 + 1) % 256 for i in range(40)]


class Sink:
    """Collects one request's TokenDeltas from the engine thread."""

    def __init__(self):
        self.deltas: queue.SimpleQueue[TokenDelta] = queue.SimpleQueue()

    def __call__(self, delta: TokenDelta) -> None:
        self.deltas.put(delta)

    def next(self) -> TokenDelta:
        return self.deltas.get(timeout=WAIT_S)

    def until_final(self) -> list[TokenDelta]:
        got = [self.next()]
        while not got[-1].final:
            got.append(self.next())
        return got

    def pending(self) -> list[TokenDelta]:
        got = []
        while not self.deltas.empty():
            got.append(self.deltas.get())
        return got


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


@pytest.fixture(scope="module")
def offline():
    """Greedy tokens of the offline engine, per prompt (as a tuple), for any params."""
    llm, cache = LLM("demo", **ENGINE), {}

    def want(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = llm.generate([prompt], params)[0].token_ids
        return cache[key]

    return want


class Pair:
    """A prompt loop `p0` and a token loop `t0`, engines in their roles, linked over gRPC."""

    def __init__(self, leases: dict[str, float] | None = None, **engine_args: dict):
        """`leases`: KV lease per worker id (default none); `engine_args`: per worker id, settings that
        differ from ENGINE."""
        directory = {w: f"127.0.0.1:{_free_port()}" for w in ("p0", "t0")}
        self.fabrics, self.loops = [], {}
        for worker_id, role in (("p0", "prompt"), ("t0", "token")):
            engine = LLMEngine("demo", policy=role, **{**ENGINE, **engine_args.get(worker_id, {})})
            self.fabrics.append(GrpcFabric(worker_id, directory, LINK_TIMEOUT_S))
            transport = make_transport(engine, self.fabrics[-1], LINK_TIMEOUT_S)
            lease_s = (leases or {}).get(worker_id, float("inf"))
            self.loops[worker_id] = WorkerLoop(engine, transport, worker_id, LAYERWISE, lease_s)
        self.prompt, self.token = self.loops["p0"], self.loops["t0"]
        self.started = False

    def start(self) -> Pair:
        for loop in self.loops.values():
            loop.start()
        self.started = True
        return self

    def close(self) -> None:
        for loop in self.loops.values() if self.started else ():
            loop.stop()
        for fabric in self.fabrics:
            fabric.close()

    def disaggregate(self, request_id: str, prompt: list[int], params: SamplingParams = GREEDY):
        """Reserve on the token loop, then prefill on the prompt loop, as the controller routes."""
        prompt_sink, token_sink = Sink(), Sink()
        ticket = run(self.token, self.token.reserve, request_id, prompt, params, "p0", token_sink)
        run(self.prompt, self.prompt.prefill, ticket, prompt, params, prompt_sink)
        return ticket, prompt_sink, token_sink


def run(loop: WorkerLoop, fn, *args):
    return loop.call(fn, *args).result(timeout=WAIT_S)


def assert_clean(loop: WorkerLoop) -> None:
    """No request left; every block free (cached-but-free prefix blocks count as free)."""
    def check():
        loop.engine.check_integrity()
        return loop.engine.num_requests, loop.engine.block_manager.num_free_blocks

    assert run(loop, check) == (0, loop.engine.block_manager.num_blocks)


@pytest.fixture
def pair():
    p = Pair()
    yield p.start()
    p.close()


@pytest.fixture
def idle_pair():
    """Not started: the test drives the engines on its own thread."""
    p = Pair()
    yield p
    p.close()


# ---------------------------------------------------------------------------------------------
# local and disaggregated requests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("worker", ["p0", "t0"])
def test_local_request_streams_the_offline_tokens(pair, offline, worker):
    loop, sink = pair.loops[worker], Sink()
    run(loop, loop.generate, "r", LONG, GREEDY, sink)
    deltas = sink.until_final()
    assert tokens(deltas) == offline(LONG)
    assert deltas[-1].finish_reason == "length" and deltas[-1].error is None
    assert all(d.finish_reason is None and d.token_ids for d in deltas[:-1])
    assert_clean(loop)


@pytest.mark.parametrize("prompt, layerwise", [(SHORT, False), (LONG, True)], ids=["one-shot", "layer-wise"])
def test_disaggregated_request_equals_offline(pair, offline, prompt, layerwise):
    ticket, prompt_sink, token_sink = pair.disaggregate("r", prompt)
    assert ticket.layerwise is layerwise and ticket.num_tokens == len(prompt)
    deltas = token_sink.until_final()
    want = offline(prompt)
    assert tokens(deltas) == want and deltas[-1].finish_reason == "length"
    assert deltas[0].token_ids[0] == want[0]
    assert prompt_sink.next() == TokenDelta((want[0],), cached_tokens=0,
                                            cache_write_tokens=len(prompt) // BLOCK * BLOCK)
    assert_clean(pair.prompt)
    assert_clean(pair.token)
    assert prompt_sink.pending() == []  # the first token was all the prompt worker sent


def test_keeping_the_live_peers_closes_the_links_to_the_others(pair):
    """What an adopted worker's first report asks for: its links to workers that died while no
    controller ran (none named them gone) close; links to live ones stay."""
    _, _, token_sink = pair.disaggregate("r", SHORT)
    token_sink.until_final()

    def linked():  # read on the loop's thread
        return pair.prompt.exporter.transport.peers()

    run(pair.prompt, pair.prompt.keep_peers, ("p0", "t0", "t7"))  # t7: a live worker never linked to
    assert run(pair.prompt, linked) == {"t0"}
    run(pair.prompt, pair.prompt.keep_peers, ("p0",))
    assert run(pair.prompt, linked) == frozenset()


def test_the_first_delta_names_the_prompt_tokens_the_prefix_cache_held(pair, offline):
    """Usage's cached_tokens and cache_write_tokens: the first delta of a request (the prompt
    worker's first token when disaggregated) carries its prefill's prefix-cache hit and the prompt
    tokens it added to the cache, every later delta None."""
    for turn, hit in enumerate((0, 3 * BLOCK)):  # LONG is 60 tokens: 3 full blocks come back
        ticket, prompt_sink, token_sink = pair.disaggregate(f"d{turn}", LONG)
        assert ticket.start_token == hit  # the token worker holds them too: they do not travel again
        assert prompt_sink.next() == TokenDelta((offline(LONG)[0],), cached_tokens=hit,
                                                cache_write_tokens=3 * BLOCK - hit)
        assert tokens(token_sink.until_final()) == offline(LONG)
        sink = Sink()
        run(pair.token, pair.token.generate, f"l{turn}", FORTY, GREEDY, sink)
        deltas = sink.until_final()
        assert (deltas[0].cached_tokens, deltas[0].cache_write_tokens) == ((0, 2 * BLOCK), (2 * BLOCK, 0))[turn]
        assert tokens(deltas) == offline(FORTY) and {d.cached_tokens for d in deltas[1:]} == {None}


def test_requests_of_every_kind_in_flight_at_once(pair, offline):
    prompts = {"d0": LONG, "d1": SHORT, "d2": FORTY, "d3": LONG[:33]}
    sinks = {rid: pair.disaggregate(rid, prompt)[2] for rid, prompt in prompts.items()}
    for worker, prompt in (("p0", FORTY), ("t0", SHORT)):
        sinks[worker] = Sink()
        run(pair.loops[worker], pair.loops[worker].generate, worker, prompt, GREEDY, sinks[worker])
        prompts[worker] = prompt
    assert {rid: tokens(sink.until_final()) for rid, sink in sinks.items()} == \
        {rid: offline(prompt) for rid, prompt in prompts.items()}
    assert_clean(pair.prompt)
    assert_clean(pair.token)


def test_role_switch_while_requests_run_changes_no_output(pair, offline):
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    prompts = {"d0": LONG, "d1": SHORT}
    sinks = {rid: pair.disaggregate(rid, prompt, params)[2] for rid, prompt in prompts.items()}
    sinks["local"], prompts["local"] = Sink(), FORTY
    run(pair.token, pair.token.generate, "local", FORTY, params, sinks["local"])
    firsts = {rid: sink.next() for rid, sink in sinks.items()}  # every request has started decoding

    def switch():
        pair.token.set_role("mixed")
        return pair.token.engine.policy.name, pair.token.engine.num_requests

    assert run(pair.token, switch) == ("mixed", 3)
    assert not any(delta.final for delta in firsts.values())
    sinks["after"], prompts["after"] = pair.disaggregate("after", FORTY, params)[2], FORTY  # imports still land
    got = {rid: tokens([firsts.get(rid, TokenDelta()), *sink.until_final()]) for rid, sink in sinks.items()}
    assert got == {rid: offline(prompt, params) for rid, prompt in prompts.items()}
    assert_clean(pair.token)


# ---------------------------------------------------------------------------------------------
# abort
# ---------------------------------------------------------------------------------------------

def test_abort_of_a_reserved_import_frees_its_blocks(pair):
    sink = Sink()
    ticket = run(pair.token, pair.token.reserve, "r", LONG, GREEDY, "p0", sink)
    free = run(pair.token, lambda: pair.token.engine.block_manager.num_free_blocks)
    assert free == pair.token.engine.block_manager.num_blocks - 4  # 60 tokens in blocks of 16
    assert isinstance(ticket, TransferTicket) and ticket.token_peer == "t0" and ticket.prompt_peer == "p0"
    run(pair.token, pair.token.abort, "r")
    assert_clean(pair.token)
    assert sink.pending() == [TokenDelta(finish_reason="abort")]


def test_abort_of_a_running_local_request_stops_its_deltas(pair, offline):
    sink, other = Sink(), Sink()
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    run(pair.token, pair.token.generate, "r", LONG, params, sink)
    started = [sink.next(), sink.next()]
    run(pair.token, pair.token.abort, "r")
    *before_abort, last = started + sink.pending()
    assert not any(d.final for d in before_abort) and len(tokens(before_abort)) < 300
    assert last == TokenDelta(finish_reason="abort")
    run(pair.token, pair.token.generate, "later", SHORT, GREEDY, other)  # several steps after the abort
    assert tokens(other.until_final()) == offline(SHORT)
    assert sink.pending() == []
    assert_clean(pair.token)


def test_abort_of_a_prefill_before_its_first_token_ends_its_callers_wait(pair, offline):
    """The prompt worker's caller waits for one delta (the first token): an abort sends it the
    final one; the token side's reservation goes with the transfer's CANCEL. The CANCEL, pushed
    between steps, counts with the next step's pushes, even in steps that push nothing (a request
    decoding there, untouched)."""
    prompt_sink, token_sink, local = Sink(), Sink(), Sink()
    ticket = run(pair.token, pair.token.reserve, "r", LONG, GREEDY, "p0", token_sink)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    run(pair.prompt, lambda: (pair.prompt.generate("local", FORTY, params, local),
                              pair.prompt.prefill(ticket, LONG, GREEDY, prompt_sink), pair.prompt.abort("r")))
    assert prompt_sink.next() == TokenDelta(finish_reason="abort")
    assert token_sink.next().error is not None  # the ingress dropped this one's queue before its abort
    assert tokens(local.until_final()) == offline(FORTY, params)
    assert prompt_sink.pending() == [] and token_sink.pending() == []
    assert_clean(pair.prompt)
    assert_clean(pair.token)


# ---------------------------------------------------------------------------------------------
# load reports and a loop without a transport
# ---------------------------------------------------------------------------------------------

def test_load_of_a_local_request(idle_pair):
    loop = idle_pair.token  # not started: the engine is driven here, on the test thread
    total = ENGINE["num_kv_blocks"] * BLOCK
    loop.generate("r", FORTY, GREEDY, Sink())
    assert loop.load() == WorkerLoad(pending_prompt_tokens=40, decode_tokens=40, num_decoding=1, num_waiting=1,
                                     free_kv_tokens=total, total_kv_tokens=total)
    loop.engine.step()  # prefill: 40 prompt tokens + 1 sampled, in 3 blocks; max_tokens=10 take a 4th
    assert loop.load() == WorkerLoad(pending_prompt_tokens=0, decode_tokens=41, num_decoding=1, num_waiting=0,
                                     free_kv_tokens=total - 3 * BLOCK, total_kv_tokens=total, kv_growth_tokens=BLOCK)


def test_load_of_a_request_to_prefill_and_hand_off(idle_pair):
    loop, total = idle_pair.prompt, ENGINE["num_kv_blocks"] * BLOCK
    ticket = TransferTicket("r", 0, "p0", "t0", 40, True, loop.exporter.transport.layout)
    loop.prefill(ticket, FORTY, GREEDY, Sink())
    assert loop.load() == WorkerLoad(pending_prompt_tokens=40, decode_tokens=0, num_decoding=0, num_waiting=1,
                                     free_kv_tokens=total, total_kv_tokens=total)


def test_load_of_a_reserved_import(idle_pair):
    loop, total = idle_pair.token, ENGINE["num_kv_blocks"] * BLOCK
    loop.reserve("r", FORTY, GREEDY, "p0", Sink())  # an import decodes here: it grows by a block
    assert loop.load() == WorkerLoad(pending_prompt_tokens=0, decode_tokens=40, num_decoding=1, num_waiting=0,
                                     free_kv_tokens=total - 3 * BLOCK, total_kv_tokens=total, kv_growth_tokens=BLOCK)


def test_prefix_delta_names_the_blocks_the_ingress_names(idle_pair):
    loop = idle_pair.token
    loop.generate("r", FORTY, GREEDY, Sink())
    loop.engine.step()  # prefill: 40 prompt tokens computed, 2 full blocks cached
    delta = loop.prefix_delta(snapshot=False)
    assert (delta.block_size, delta.num_blocks) == (BLOCK, ENGINE["num_kv_blocks"])
    assert delta.added == prompt_block_hashes(FORTY, BLOCK, 100) and len(delta.added) == 2 and not delta.removed
    assert loop.prefix_delta(snapshot=False).added == ()
    assert loop.prefix_delta(snapshot=True).added == delta.added


def test_loop_without_transport_rejects_disaggregated_work(offline):
    loop = WorkerLoop(LLMEngine("demo", policy="mixed", **ENGINE), None, "solo", layerwise_threshold=LAYERWISE)
    loop.start()
    try:
        ticket = TransferTicket("p", 0, "solo", "t0", len(SHORT), False)
        for fn, args in ((loop.reserve, ("r", SHORT, GREEDY, "p0")), (loop.prefill, (ticket, SHORT, GREEDY))):
            with pytest.raises(RuntimeError, match="worker solo has no KV transport"):
                run(loop, fn, *args, Sink())
        sink = Sink()
        run(loop, loop.generate, "ok", SHORT, GREEDY, sink)  # the loop goes on
        assert tokens(sink.until_final()) == offline(SHORT)
        assert_clean(loop)
    finally:
        loop.stop()


# ---------------------------------------------------------------------------------------------
# stats for the metrics
# ---------------------------------------------------------------------------------------------

def test_stats_record_steps_queue_times_and_transfers(pair, offline):
    _, _, token_sink = pair.disaggregate("r", LONG)
    token_sink.until_final()
    prompt_stats = run(pair.prompt, pair.prompt.drain_stats)
    token_stats = run(pair.token, pair.token.drain_stats)
    assert [(s.phase, s.prefill_tokens) for s in prompt_stats.steps] == [("prefill", len(LONG))]
    assert len(prompt_stats.queue_seconds) == 1 and 0 <= prompt_stats.queue_seconds[0] < WAIT_S
    assert len(prompt_stats.transfers) == 1 and 0 <= prompt_stats.transfers[0].overlap_ratio <= 1
    assert prompt_stats.kv_bytes_sent > 0 and prompt_stats.kv_failures == 0
    # the token side decoded the other tokens one step each and queued nothing (its KV came in)
    assert {s.phase for s in token_stats.steps} == {"decode"}
    assert sum(s.decode_tokens for s in token_stats.steps) == len(offline(LONG)) - 1
    assert token_stats.queue_seconds == () and token_stats.kv_bytes_sent == 0
    assert run(pair.prompt, pair.prompt.drain_stats).steps == ()  # drained: only totals carry over


def test_stats_count_the_prompt_tokens_a_later_turn_did_not_receive(pair, offline):
    _, _, token_sink = pair.disaggregate("turn-1", LONG)
    answer = tokens(token_sink.until_final())
    assert run(pair.token, pair.token.drain_stats).kv_tokens_reused == 0
    turn_2 = LONG + answer + SHORT[1:]
    ticket, _, token_sink = pair.disaggregate("turn-2", turn_2)
    assert tokens(token_sink.until_final()) == offline(turn_2)
    assert ticket.start_token == (len(LONG) + len(answer) - 1) // BLOCK * BLOCK  # turn 1's computed full blocks
    assert run(pair.token, pair.token.drain_stats).kv_tokens_reused == ticket.start_token
