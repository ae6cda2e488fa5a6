"""A dead peer or a timeout mid-transfer fails the request with an error naming the peer, every
wait is bounded, and the surviving side holds no block afterwards; a pair of live workers whose
link broke, or that gave a transfer up, goes on transferring."""
import signal
import time

import pytest

from splitserve import SamplingParams
from tests.transfer.cluster import Cluster
from tests.transfer.test_disaggregation import LONG, SHORT, assert_clean, colocated

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


# NCCL has no dead-peer detection of gloo's kind (its timeout aborts the process): CPU backends only;
# "ipc" is the same-node path (shared memory on CPU, CUDA IPC on GPUs) with its metadata over gloo
FAILURE_BACKENDS = ["gloo", "grpc", "ipc"]


@pytest.fixture(params=FAILURE_BACKENDS)
def make_cluster(request):
    clusters = []

    def make(**kwargs):
        clusters.append(Cluster(request.param, **kwargs))
        return clusters[-1]

    yield make
    for c in clusters:
        c.close()


def test_prompt_worker_killed_mid_transfer(make_cluster):
    cluster = make_cluster(timeout=20)
    cluster.send("p0", "die_after_layers", 2)  # the demo model has 4 layers: half the KV lands
    cluster.route("dead", LONG, GREEDY)
    failed = cluster.collect("t0", ("failed", "done"), 1)["dead"]
    assert failed[0] == "failed" and "'p0'" in failed[2], failed
    assert_clean(cluster, "t0")


def test_token_worker_killed(make_cluster):
    cluster = make_cluster(timeout=20)
    cluster.route("ok", SHORT, GREEDY)  # the pair's link is up
    assert cluster.collect("t0", ("done",), 1)["ok"][0] == "done"
    cluster.send("t0", "reserve", "orphan", LONG, GREEDY, "p0")
    ticket = cluster.expect("t0", "ticket")[1]
    cluster.kill("t0")
    cluster.send("p0", "add", ticket, LONG, GREEDY)
    failed = cluster.collect("p0", ("failed",), 1)["orphan"]
    assert "'t0'" in failed[2], failed
    assert_clean(cluster, "p0")


def test_timeout_frees_the_reserved_blocks(make_cluster):
    cluster = make_cluster(timeout=3)
    cluster.route("ok", SHORT, GREEDY)
    assert cluster.collect("t0", ("done",), 1)["ok"][0] == "done"
    cluster.send("p0", "stall")
    cluster.route("hung", LONG, GREEDY)
    failed = cluster.collect("t0", ("failed", "done"), 1, timeout=30)["hung"]
    assert failed[0] == "failed" and "'p0'" in failed[2], failed
    assert_clean(cluster, "t0")
    assert_clean(cluster, "p0")


def test_a_transfer_given_up_mid_push_leaves_the_pair_working(make_cluster):
    """The token side stops waiting (client gone, lease) while the prompt side still pushes: those
    messages are drained, so the sender never waits on them and later transfers go through. (A
    same-node prompt worker that had not claimed the transfer yet refuses it instead.)"""
    cluster = make_cluster(timeout=3)
    cluster.route("given-up", LONG, GREEDY)
    cluster.send("t0", "cancel", "given-up")
    outcome = cluster.collect("p0", ("first", "failed"), 1)["given-up"]
    assert outcome[0] == "first" or (cluster.backend == "ipc" and "gave the transfer up" in outcome[2]), outcome
    time.sleep(4)  # past the timeout: a send nobody read would have failed the link by now
    cluster.route("after", LONG, GREEDY)
    done = cluster.collect("t0", ("failed", "done"), 1)
    assert done["after"][0] == "done", done
    assert_clean(cluster, "t0")
    assert_clean(cluster, "p0")


@pytest.mark.parametrize("chunk", [None, 96], ids=["whole", "chunks"])
@pytest.mark.parametrize("make_cluster", ["gloo"], indirect=True)  # gRPC buffers what a frozen reader has not taken
def test_a_link_that_broke_between_live_workers_heals_on_the_next_transfer(make_cluster, chunk):
    """The token worker freezes past the timeout: the prompt side gives the link up and fails the
    transfer, once (a prompt prefilled in chunks pushed in several steps); once the token worker
    runs again the pair meets on a fresh link (epoch 1). The handed-off transfer is the token
    side's to decide (the router hears of it from there): it fails, or lands with the colocated
    tokens when every message had reached the token worker before the sender's link was gone
    (gloo may still serve posted sends after the give-up)."""
    chunks = {} if chunk is None else {"prompt_chunk_tokens": chunk, "prompt_token_budget": chunk}
    cluster = make_cluster(timeout=3, engine_args=chunks)
    cluster.route("warm", SHORT, GREEDY)
    assert cluster.collect("t0", ("done",), 1)["warm"][0] == "done"
    cluster.send("t0", "reserve", "frozen", LONG, GREEDY, "p0")
    ticket = cluster.expect("t0", "ticket")[1]
    cluster.signal("t0", signal.SIGSTOP)
    try:
        cluster.send("p0", "add", ticket, LONG, GREEDY)
        failed = cluster.collect("p0", ("failed",), 1, timeout=30)["frozen"]
        assert "'t0'" in failed[2], failed
    finally:
        cluster.signal("t0", signal.SIGCONT)
    frozen = cluster.collect("t0", ("failed", "done"), 1, timeout=30)["frozen"]
    expected = colocated(cluster, [LONG], GREEDY)[0]
    assert frozen[0] == "failed" or frozen[2] == expected, frozen
    healed = cluster.route("healed", LONG, GREEDY)
    done = cluster.collect("t0", ("failed", "done"), 1)["healed"]
    assert done[0] == "done" and done[2] == expected, done
    assert (ticket.parts[0].link_epoch, healed.parts[0].link_epoch) == (0, 1)
    assert_clean(cluster, "t0")
    assert_clean(cluster, "p0")
    assert [m for m in cluster.backlog.get("p0", []) if m[0] == "failed"] == []  # no second failure
