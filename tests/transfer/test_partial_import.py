"""Partial import: a token worker whose prefix cache holds the start of a prompt (the earlier turn
of a conversation it decoded) asks only for the KV after it (`TransferTicket.start_token`).

One prompt engine and two token engines in this process, one reusing its prefix cache and one
not (`KVImporter(reuse_prefix=False)`, a whole-prompt transfer), exporter and importers driven on
the test thread over gloo and over gRPC. Turn 1 travels whole to both; turn 2 (turn 1, its answer
and more) travels from the first cached position on. Greedy output equals the whole transfer's and
the colocated engine's (which ran turn 1 too) token for token, the bytes pushed are those of the
positions sent, and every engine ends clean; a partial import cancelled frees only its own blocks."""
from __future__ import annotations

import datetime
import itertools
import time

import pytest
import torch
import torch.distributed as dist

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer.grpc_link import GrpcFabric
from splitserve.transfer.exporter import KVExporter
from splitserve.transfer.handoff import make_transport
from splitserve.transfer.importer import KVImporter
from splitserve.transfer.torch_link import TorchFabric
from tests.engine.engine_helpers import one_thread  # noqa: F401  (pytest fixture, module-wide)
from tests.transfer.cluster import _free_port

BS = 4
ENGINE = dict(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TIMEOUT = 10.0
WAIT_S = 60.0
_prompts = itertools.count(1)


def fabrics(backend: str, ids: tuple[str, ...]):
    """Each worker's fabric; gloo meets through one store (returned too, to keep it served)."""
    if backend == "grpc":
        directory = {w: f"127.0.0.1:{_free_port()}" for w in ids}
        return None, {w: GrpcFabric(w, directory, TIMEOUT) for w in ids}
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    return server, {w: TorchFabric.join("127.0.0.1", server.port, w, torch.device("cpu"), TIMEOUT) for w in ids}


class Workers:
    def __init__(self, backend: str):
        self.server, self.fabrics = fabrics(backend, ("p", "reuse", "whole"))
        engines = {w: LLMEngine("demo", policy="prompt" if w == "p" else "token", **ENGINE) for w in self.fabrics}
        transports = {w: make_transport(engines[w], self.fabrics[w], TIMEOUT) for w in engines}
        self.exporter = KVExporter(engines["p"], transports["p"])
        self.importers = {w: KVImporter(engines[w], transports[w], w, reuse_prefix=w == "reuse")
                          for w in ("reuse", "whole")}
        self.colocated = LLMEngine("demo", **ENGINE)

    def transfer(self, worker: str, request_id: str, prompt: list[int]):
        """Import `prompt` into `worker` and decode it there: its ticket, tokens and the bytes pushed."""
        importer, sent = self.importers[worker], self.exporter.bytes_pushed
        ticket = importer.reserve(request_id, prompt, GREEDY, "p")
        self.exporter.add(ticket, prompt, GREEDY)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self.exporter.step()
            assert self.exporter.failures() == []
            landed, failures = importer.poll(0.01)
            assert failures == []
            for out in landed + importer.engine.step():
                if out.finished:
                    return ticket, out.token_ids, self.exporter.bytes_pushed - sent
        raise TimeoutError(f"{request_id} did not finish on {worker} in {WAIT_S} s")

    def run_colocated(self, request_id: str, prompt: list[int]) -> list[int]:
        self.colocated.add_request(request_id, prompt, GREEDY)
        while self.colocated.has_unfinished_requests():
            done = [out for out in self.colocated.step() if out.finished]
        return done[0].token_ids

    def engines(self) -> list[LLMEngine]:
        return [self.exporter.engine, *(i.engine for i in self.importers.values()), self.colocated]

    def close(self) -> None:
        for fabric in self.fabrics.values():
            if isinstance(fabric, GrpcFabric):
                fabric.close()


@pytest.fixture(scope="module", params=["gloo", "grpc"])
def workers(request):
    w = Workers(request.param)
    yield w
    w.close()


def conversation(turn_1: int, more: int) -> tuple[list[int], list[int]]:
    """A first prompt of `turn_1` tokens and `more` tokens the user adds after the answer (new
    content per call, so no test hits another's cache)."""
    seed = next(_prompts)
    tokens = [(i * (2 * seed + 1) + seed) % 256 for i in range(turn_1 + more)]
    return tokens[:turn_1], tokens[turn_1:]


@pytest.mark.parametrize("threshold, layerwise", [(8, (True, True)), (28, (True, False)), (1000, (False, False))],
                         ids=["layer-wise", "layer-wise-whole-one-shot-partial", "one-shot"])
def test_partial_import_equals_whole_transfer_and_colocated(workers, threshold, layerwise):
    for importer in workers.importers.values():
        importer.layerwise_threshold = threshold
    turn_1, more = conversation(21, 15)
    first = {w: workers.transfer(w, f"{w}-1-{threshold}", turn_1) for w in ("reuse", "whole")}
    answer = workers.run_colocated(f"c-1-{threshold}", turn_1)
    assert all(ticket.start_token == 0 for ticket, _, _ in first.values())  # nothing cached yet
    assert first["reuse"][1:] == first["whole"][1:] and first["reuse"][1] == answer

    turn_2 = turn_1 + answer + more  # 46 tokens
    reused = workers.importers["reuse"].kv_tokens_reused
    partial, partial_tokens, partial_bytes = workers.transfer("reuse", f"reuse-2-{threshold}", turn_2)
    whole, whole_tokens, whole_bytes = workers.transfer("whole", f"whole-2-{threshold}", turn_2)
    assert partial_tokens == whole_tokens == workers.run_colocated(f"c-2-{threshold}", turn_2)

    # turn 1 computed the KV of its prompt and all its answer but the last token: 30 tokens, 7 full blocks
    assert partial.start_token == 7 * BS and whole.start_token == 0
    assert (whole.layerwise, partial.layerwise) == layerwise
    assert partial_bytes * len(turn_2) == whole_bytes * (len(turn_2) - partial.start_token)
    assert workers.importers["reuse"].kv_tokens_reused - reused == partial.start_token
    assert workers.importers["whole"].kv_tokens_reused == 0
    for engine in workers.engines():
        engine.check_integrity()
        assert engine.num_requests == 0 and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_cancelled_partial_import_frees_its_own_blocks_and_leaves_the_prefix_cached(workers):
    turn_1, more = conversation(21, 15)
    _, answer, _ = workers.transfer("reuse", "cancel-1", turn_1)
    importer, turn_2 = workers.importers["reuse"], turn_1 + answer + more
    engine = importer.engine
    for request_id in ("cancel-2", "cancel-3"):
        ticket = importer.reserve(request_id, turn_2, GREEDY, "p")
        assert ticket.start_token == 7 * BS and engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
        importer.cancel(request_id)
        engine.check_integrity()
        assert engine.num_requests == 0 and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
