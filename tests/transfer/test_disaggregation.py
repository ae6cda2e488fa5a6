"""Disaggregated greedy output equals the colocated engine's, across processes, over each backend."""
import itertools

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.transfer import workers
from tests.transfer.cluster import Cluster

REQUEST_IDS = itertools.count()
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHORT = [256] + [ord(c) for c in "a short prompt, under the layer-wise threshold"]
LONG = [256] + [(i * 7 + 3) % 256 for i in range(700)]  # over the 512-token threshold: streamed per layer


def colocated(cluster, prompts, params=GREEDY, model="demo", **engine_args):
    """The same prompts on one engine, on the workers' device, prefilled whole as the prompt worker does."""
    llm = LLM(model, policy="prefill_first", device=workers.device_for(cluster.backend),
              **workers.engine_args_for(cluster.backend), **engine_args)
    return [out.token_ids for out in llm.generate(prompts, params)]


def assert_clean(cluster, worker_id):
    _, error, free, total, live = cluster.check(worker_id)
    assert error is None and free == total and live == 0, (worker_id, error, free, total, live)


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pairs two GPUs, never two ranks on one")
# ipc: written into the token worker's cache through shared memory (CPU) or CUDA IPC (two processes on one GPU)
BACKENDS = ["gloo", "grpc", "ipc", pytest.param("cuda-ipc", marks=pytest.mark.gpu),
            pytest.param("nccl", marks=[pytest.mark.gpu, TWO_GPUS])]


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request):
    c = Cluster(request.param, prompt_ids=("p0", "p1"), token_ids=("t0",))
    yield c
    c.close()


def run(cluster, prompts, prompt_workers=("p0",), tickets=None):
    """Each prompt's greedy output; `tickets` (a list) gets the transfers' tickets."""
    ids = [f"r{next(REQUEST_IDS)}" for _ in prompts]
    for i, (request_id, prompt) in enumerate(zip(ids, prompts)):
        ticket = cluster.route(request_id, prompt, GREEDY, prompt_worker=prompt_workers[i % len(prompt_workers)])
        if tickets is not None:
            tickets.append(ticket)
    done = cluster.collect("t0", ("done", "failed"), len(ids))
    assert all(done[i][0] == "done" for i in ids), done
    return [done[i][2] for i in ids]


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["one-shot", "layer-wise"])
def test_disaggregated_equals_colocated(cluster, prompt):
    assert run(cluster, [prompt]) == colocated(cluster, [prompt])
    for worker in ("p0", "t0"):
        assert_clean(cluster, worker)


def test_several_requests_in_flight_to_one_token_worker(cluster):
    prompts = [SHORT, LONG, SHORT[:20], LONG[:600], LONG[:90]]
    assert run(cluster, prompts) == colocated(cluster, prompts)
    assert_clean(cluster, "t0")


def test_two_prompt_workers_into_one_token_worker(cluster):
    prompts = [LONG, SHORT, LONG[:550], SHORT[:9]]
    assert run(cluster, prompts, prompt_workers=("p0", "p1")) == colocated(cluster, prompts)
    for worker in ("p0", "p1", "t0"):
        assert_clean(cluster, worker)


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_prompt_worker_prefills_a_long_prompt_in_chunks(backend):
    """Prompts longer than prompt_chunk_tokens take several prefill steps on the prompt worker; a
    layer-wise one (LONG) streams a piece of every layer once 192 positions are pending (every
    other step) and the rest at its last chunk, a one-shot one sends its KV after its last chunk,
    and the output is unchanged."""
    chunked = Cluster(backend, engine_args={"prompt_chunk_tokens": 96, "prompt_token_budget": 96})
    try:
        chunked.send("p0", "min_piece_tokens", 192)
        prompts = [LONG, SHORT, LONG[:300]]
        assert run(chunked, prompts) == colocated(chunked, prompts)
        chunked.send("p0", "peak")
        peak = chunked.expect("p0", "peak")[2]
        assert peak["prefill_tokens"] == 96  # never a whole 300- or 701-token prompt
        assert peak["layer_messages"] == 4 * 4  # 4 layers, in pieces to 192, 384, 576 and 701 (4 if whole)
        for worker in ("p0", "t0"):
            assert_clean(chunked, worker)
    finally:
        chunked.close()


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_an_fp8_cache_travels_as_its_codes(backend):
    """Both workers keep FP8 KV: the codes cross as bytes (a message, or written into the token
    worker's cache) and decode as the colocated FP8 engine does."""
    fp8 = Cluster(backend, engine_args={"kv_cache_dtype": "fp8"})
    try:
        prompts = [LONG, SHORT]
        assert run(fp8, prompts) == colocated(fp8, prompts, kv_cache_dtype="fp8")
        assert_clean(fp8, "t0")
    finally:
        fp8.close()


WINDOW = 16


def windowed_model(tmp_path, layers: str) -> tuple[str, list[str]]:
    """A demo-shaped Mistral checkpoint (dummy weights) whose every or every other layer slides."""
    from splitserve.engine.demo import DEMO_MODEL_CONFIG
    from splitserve.engine.dummy_weights import write_shape_checkpoint

    kinds = {"every": ["sliding_attention"] * 4, "alternate": ["full_attention", "sliding_attention"] * 2}[layers]
    return write_shape_checkpoint(tmp_path / "mistral", {**DEMO_MODEL_CONFIG, "architectures": ["MistralForCausalLM"],
                                                         "model_type": "mistral", "sliding_window": WINDOW,
                                                         "layer_types": kinds}), kinds


@pytest.mark.parametrize("layers", ["every", "alternate"])
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_sliding_window_prompt_worker_keeps_in_chunks_only_what_its_export_reads(backend, layers, tmp_path):
    """Long prompts prefilled in 64-token chunks: a windowed layer group holds a window and a
    chunk of each, and past the prefill only the blocks the token worker's window reaches (what
    the export sends), never the whole prompt's; the output is the colocated engine's."""
    model, kinds = windowed_model(tmp_path, layers)
    chunked = Cluster(backend, engine_args={"model": model, "load_format": "dummy", "block_size": 16,
                                            "prompt_chunk_tokens": 64, "prompt_token_budget": 64})
    try:
        prompts = [LONG, SHORT, LONG[:600]]
        assert run(chunked, prompts) == colocated(chunked, prompts, model=model, load_format="dummy")
        chunked.send("p0", "peak")
        blocks = -(-len(LONG) // 16)  # 44: LONG's, in a table that keeps every block (88 alternating, before)
        window_and_chunk = -(-(64 + WINDOW - 1) // 16) + 1  # 6: the blocks a 64-token chunk and its window span
        assert chunked.expect("p0", "peak")[2]["blocks"] == ("full_attention" in kinds) * blocks + window_and_chunk
        for worker in ("p0", "t0"):
            assert_clean(chunked, worker)
    finally:
        chunked.close()


@pytest.mark.parametrize("layers", ["every", "alternate"])
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_a_sliding_window_model_hands_off_whole_and_decodes_in_its_window(backend, layers, tmp_path):
    """Every layer slides (Mistral's layout), or every other one (Gemma 2's and GPT-OSS's: two layer
    groups, each layer travelling at its group's blocks): the prompt worker keeps all its blocks for
    the export (one-shot exports read them after the step), the token worker reserves in a windowed
    group only what its first decode reaches, and only that travels: a windowed layer sends from
    the first block its window reaches; the token worker releases more as it decodes, and what it
    caches of them serves a later prompt's window."""
    from splitserve.engine.demo import DEMO_MODEL_CONFIG

    window, block = WINDOW, 16
    model, kinds = windowed_model(tmp_path, layers)
    windowed = Cluster(backend, engine_args={"model": model, "load_format": "dummy", "block_size": block})
    try:
        one_shot, tickets = [256] + [(i * 5 + 1) % 256 for i in range(400)], []
        for prompts in ([LONG, SHORT, one_shot], [one_shot[:200] + SHORT[1:]]):  # the last hits one_shot's blocks
            assert run(windowed, prompts, tickets=tickets) == colocated(windowed, prompts, model=model,
                                                                        load_format="dummy")
        assert_clean(windowed, "t0")
        # a layer's KV travels from the block its window reaches (or after the prefix hit); full layers' whole
        sent = [t.num_tokens - (t.start_token if kind == "full_attention" else
                                max(t.start_token, (t.num_tokens - window + 1) // block * block))
                for t in tickets for kind in kinds]
        per_token = 2 * DEMO_MODEL_CONFIG["num_key_value_heads"] * (256 // 8) * 4  # K and V, heads, head_dim, fp32
        windowed.send("p0", "pushed")
        assert windowed.expect("p0", "pushed")[2] == sum(sent) * per_token
        whole = sum(t.num_sent_tokens for t in tickets) * len(kinds)
        assert sum(sent) < whole * (0.6 if layers == "alternate" else 0.2)
    finally:
        windowed.close()


def test_an_fp8_worker_and_a_float32_one_have_different_kv_layouts():
    """What the handshake compares (a mismatch is refused naming both: tests/cluster)."""
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.transfer.handoff import kv_layout

    fp8, plain = kv_layout(LLMEngine("demo", kv_cache_dtype="fp8")), kv_layout(LLMEngine("demo"))
    assert "dtype=fp8_e4m3" in fp8 and "dtype=float32" in plain
    assert fp8.replace("fp8_e4m3", "float32") == plain
