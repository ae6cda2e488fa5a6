"""Same-node transfers with no wire ("ipc": shared memory between CPU workers, the code path CUDA
IPC takes between GPU workers): the prompt worker writes into the token worker's reserved blocks,
and a block another process may still write into is never freed."""
import signal
import time

import pytest

from splitserve import SamplingParams
from tests.transfer.cluster import Cluster
from tests.transfer.test_disaggregation import LONG, SHORT, assert_clean, colocated

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def cluster():
    c = Cluster("ipc", prompt_ids=("p0", "p1"), token_ids=("t0",), timeout=3)
    yield c
    c.close()


def wait_clean(cluster, worker_id, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        _, error, free, total, live = cluster.check(worker_id)
        if (error is None and free == total and live == 0) or time.monotonic() > deadline:
            return assert_clean(cluster, worker_id)
        time.sleep(0.2)


def test_tickets_name_the_token_workers_blocks_and_its_output_is_colocated(cluster):
    ticket = cluster.route("r", LONG, GREEDY)
    [part] = ticket.parts
    assert part.dest is not None and len(part.dest.blocks[0]) * 16 >= len(LONG) and part.dest.claim_by > 0
    done = cluster.collect("t0", ("done", "failed"), 1)["r"]
    assert done[0] == "done" and done[2] == colocated(cluster, [LONG], GREEDY)[0]
    wait_clean(cluster, "t0")


def test_a_frozen_writer_keeps_its_blocks_until_it_stops_writing(cluster):
    """p0 freezes after two of four layers: t0 gives the transfer up after its timeout, but p0 had
    claimed it, so its blocks stay held (another request gets other blocks, and its output is
    right) until p0 runs again and ends the transfer; then every block is free."""
    cluster.send("p0", "freeze_after_layers", 2)
    cluster.route("frozen", LONG, GREEDY)
    try:
        failed = cluster.collect("t0", ("failed", "done"), 1, timeout=30)["frozen"]
        assert failed[0] == "failed" and "'p0'" in failed[2], failed
        _, error, free, total, live = cluster.check("t0")
        assert error is None and free < total and live == 1  # held, not freed
        cluster.route("meanwhile", LONG[:600], GREEDY, prompt_worker="p1")
        done = cluster.collect("t0", ("failed", "done"), 1)["meanwhile"]
        assert done[0] == "done" and done[2] == colocated(cluster, [LONG[:600]], GREEDY)[0]
    finally:
        cluster.signal("p0", signal.SIGCONT)
    wait_clean(cluster, "t0")
    wait_clean(cluster, "p0")
    cluster.route("after", SHORT, GREEDY)  # the pair goes on
    assert cluster.collect("t0", ("failed", "done"), 1)["after"][0] == "done"


def test_a_killed_writer_frees_its_held_blocks(cluster):
    cluster.send("p0", "freeze_after_layers", 2)
    cluster.route("frozen", LONG, GREEDY)
    assert cluster.collect("t0", ("failed", "done"), 1, timeout=30)["frozen"][0] == "failed"
    cluster.kill("p0")  # a dead writer writes no more: the link's end frees the blocks
    wait_clean(cluster, "t0")


def test_a_transfer_given_up_before_its_claim_is_refused_and_freed_at_once(cluster):
    cluster.send("t0", "reserve", "late", LONG, GREEDY, "p0")
    ticket = cluster.expect("t0", "ticket")[1]
    cluster.send("t0", "cancel", "late")
    wait_clean(cluster, "t0", timeout=5)
    cluster.send("p0", "add", ticket, LONG, GREEDY)
    refused = cluster.collect("p0", ("failed", "first"), 1)["late"]
    assert refused[0] == "failed" and "gave the transfer up before this worker claimed it" in refused[2], refused
    wait_clean(cluster, "p0")
