"""Decode steps through `DecodeGraphs` against eager steps. Without CUDA a capture is an eager run
on the graphs' persistent buffers (the Triton kernels under the interpreter), which checks what a
replay depends on: the buffers, the padding rows, and launches that depend only on the batch size.
Where CUDA is (the `kernels` mark), the same tests capture and replay real graphs."""
from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.attention.triton_paged import TritonPagedBackend  # noqa: E402
from splitserve.engine.attention.torch_paged import TorchPagedBackend  # noqa: E402
from splitserve.engine.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from splitserve.engine.llm import LLM  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.kernels
# no graphs of the engine's own: a test captures those it compares (on CUDA an engine would capture at start)
ENGINE = {"num_kv_blocks": 48, "max_model_len": 256, "block_size": 16, "attention_backend": "triton",
          "policy": "mixed", "chunk_token_budget": 64, "cuda_graph_max_batch": 0}
PROMPTS = [[256] + list(range(40, 70)), [256, 72, 105], [256] + [7] * 50, [256] + list(range(90, 110))]
# different lengths, so the batch shrinks 4 -> 3 -> 2 -> 1 and the padding changes
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 6, 8, 4)]


def with_graphs(llm: LLM, max_batch: int, backend=None) -> list[int]:
    """Captures graphs for `llm`'s runner; returns the list that records each replayed batch's size."""
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner, backend or runner.backend, max_batch, llm.engine.max_model_len)
    graphs.capture()
    replayed, run = [], graphs.run
    graphs.run = lambda batch: (replayed.append(len(batch.token_ids)), run(batch))[1]
    runner.graphs = graphs
    return replayed


def test_the_ladder_of_captured_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256]


def test_replayed_decodes_equal_eager_ones_and_padding_writes_nothing():
    eager = LLM("demo", **ENGINE)
    captured = LLM("demo", **ENGINE)
    replayed = with_graphs(captured, max_batch=8)
    expected = eager.generate(PROMPTS, PARAMS)
    got = captured.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert replayed and set(replayed) == {4, 3, 2, 1}
    # a padding row that stored its K and V anywhere would leave a slot the eager run left empty, or
    # overwrite one (padded GEMMs round differently in the last bits, hence close, not equal)
    ours, theirs = captured.engine.kv_cache.data, eager.engine.kv_cache.data
    assert torch.equal(ours == 0, theirs == 0)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_an_fp8_cache_replays_the_eager_tokens_and_padding_stores_no_codes():
    """Over e4m3 codes (the store rounds them, the attention widens them) as over values."""
    eager, captured = LLM("demo", **ENGINE, kv_cache_dtype="fp8"), LLM("demo", **ENGINE, kv_cache_dtype="fp8")
    replayed = with_graphs(captured, max_batch=8)
    got, expected = captured.generate(PROMPTS, PARAMS), eager.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected] and set(replayed) == {4, 3, 2, 1}
    ours, theirs = captured.engine.kv_cache.data, eager.engine.kv_cache.data
    assert ours.dtype == torch.uint8 and torch.equal(ours == 0, theirs == 0)


def test_layer_groups_replay_the_eager_tokens(tmp_path):
    """Full and windowed layers (two layer groups: a slot row and block tables each), with a
    window short enough that the windowed tables release blocks while the graphs replay."""
    from splitserve.engine.demo import DEMO_MODEL_CONFIG
    from splitserve.engine.dummy_weights import write_shape_checkpoint

    model = write_shape_checkpoint(tmp_path / "m", {**DEMO_MODEL_CONFIG, "architectures": ["MistralForCausalLM"],
                                                    "model_type": "mistral", "sliding_window": 16,
                                                    "layer_types": ["full_attention", "sliding_attention"] * 2})
    eager, captured = (LLM(model, **ENGINE, load_format="dummy") for _ in range(2))
    assert captured.engine.block_manager.windows == (None, 16)
    replayed = with_graphs(captured, max_batch=8)
    got, expected = captured.generate(PROMPTS, PARAMS), eager.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected] and set(replayed) == {4, 3, 2, 1}


@pytest.mark.parametrize("kernels", [False, True])  # the torch path by row, and the Triton kernels (interpreted)
def test_steps_under_lora_adapters_replay_the_eager_tokens(tmp_path, monkeypatch, kernels):
    """Rows under two adapters and the base model in one replayed batch, each row's slot an input
    of the graph: the tokens the eager steps (rows grouped by adapter) give."""
    from types import SimpleNamespace

    from splitserve.engine.demo import demo_model_config
    from splitserve.engine.dummy_adapter import projection_shapes, write_adapter
    from splitserve.engine.model import lora as lora_module, triton_dispatch

    config = demo_model_config()
    adapters = {"q": write_adapter(tmp_path / "q", config, ["q_proj", "v_proj"], 4, 1, std=0.2),
                "all": write_adapter(tmp_path / "all", config, list(projection_shapes(config)), 8, 2, std=0.2)}
    args = {**ENGINE, "lora_modules": adapters, "max_loras": 3, "max_lora_rank": 8}
    eager, captured = LLM("demo", **args), LLM("demo", **args)
    params = [SamplingParams(max_tokens=p.max_tokens, temperature=0, ignore_eos=True, lora=lora)
              for p, lora in zip(PARAMS, ["all", None, "q", "all"])]
    expected = eager.generate(PROMPTS, params)
    if kernels:
        monkeypatch.setattr(lora_module, "triton_dispatch",
                            SimpleNamespace(runs_kernels=lambda x: True, lora_ops=triton_dispatch.lora_ops))
    replayed = with_graphs(captured, max_batch=8)
    got = captured.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected] and set(replayed) == {4, 3, 2, 1}
    base = eager.generate(PROMPTS, [SamplingParams(max_tokens=p.max_tokens, temperature=0, ignore_eos=True)
                                    for p in PARAMS])
    assert [o.token_ids for o in base] != [o.token_ids for o in expected]  # the adapters change the tokens


def test_batches_larger_than_the_largest_graph_run_eagerly():
    oracle = LLM("demo", **{**ENGINE, "attention_backend": "torch"})
    captured = LLM("demo", **ENGINE)
    replayed = with_graphs(captured, max_batch=2)
    got = captured.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in oracle.generate(PROMPTS, PARAMS)]
    assert set(replayed) == {2, 1}  # 4 and 3 sequences ran eagerly


def test_contexts_divided_over_splits_on_the_device():
    """Captured with every context at max_model_len, so many splits hold no keys of a short context."""
    oracle = LLM("demo", **{**ENGINE, "attention_backend": "torch"})
    captured = LLM("demo", **ENGINE)
    with_graphs(captured, max_batch=4, backend=TritonPagedBackend(block_m=16, block_n=16, num_splits=5))
    got = captured.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in oracle.generate(PROMPTS, PARAMS)]


def test_a_backend_that_reads_host_metadata_is_refused():
    llm = LLM("demo", **{**ENGINE, "attention_backend": "torch"})
    runner = llm.engine.runner
    with pytest.raises(ValueError, match="cannot be captured"):
        DecodeGraphs(runner, TorchPagedBackend(), 4, 256)


def test_garbage_is_collected_before_the_captures_and_never_during(monkeypatch):
    """Freeing an earlier engine's graph or event during a capture invalidates it (CUDA's global
    capture mode): such garbage, a reference cycle, goes before the first capture."""
    llm = LLM("demo", **ENGINE)
    graphs = DecodeGraphs(llm.engine.runner, llm.engine.runner.backend, 4, llm.engine.max_model_len)
    freed, seen, capture = [], [], graphs._capture

    class Garbage:
        def __del__(self):
            freed.append(True)

    cycle = Garbage()
    cycle.me = cycle
    del cycle
    monkeypatch.setattr(graphs, "_capture", lambda size, pool: (seen.append((gc.isenabled(), bool(freed))),
                                                                  capture(size, pool))[1])
    graphs.capture()
    assert seen == [(False, True)] * len(capture_sizes(4)) and gc.isenabled()


@pytest.mark.gpu
def test_cuda_graphs_replay_the_eager_tokens():
    engine = {**ENGINE, "device": "cuda", "dtype": "float32"}
    eager = LLM("demo", **engine)
    captured = LLM("demo", **{**engine, "cuda_graph_max_batch": 256})
    assert eager.engine.runner.graphs is None and captured.engine.runner.graphs.sizes[-1] == 256
    got = captured.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager.generate(PROMPTS, PARAMS)]
