"""Offline batches on the real demo engine in the three orders: every request finishes once with
the output an ordinary run gives, the feeder's samples and estimates are used, and the prefix
cache sees the sharing each order allows."""
from __future__ import annotations

import random

import pytest

from splitserve import LLM, SamplingParams
from splitserve.batch.blend.feeder import BatchFeeder, BlendOptions
from splitserve.batch.engine_runner import offline_request, run_batch
from splitserve.engine.llm_engine import LLMEngine


def workload(seed=0, n=48):
    """Three families of shared prefixes (96 tokens), short and long outputs, shuffled."""
    rng = random.Random(seed)
    families = [[rng.randrange(3, 250) for _ in range(96)] for _ in range(3)]
    items = []
    for i in range(n):
        family = i % 3
        prompt = families[family] + [rng.randrange(3, 250) for _ in range(rng.randrange(4, 40))]
        items.append((prompt, SamplingParams(max_tokens=3 if family < 2 else 24, temperature=0, ignore_eos=True)))
    rng.shuffle(items)
    return items


@pytest.fixture(scope="module")
def expected():
    llm = LLM("demo", num_kv_blocks=256)
    items = workload()
    return [out.token_ids for out in llm.generate([p for p, _ in items], [s for _, s in items])]


@pytest.mark.parametrize("order", ["blend", "dfs", "fcfs"])
def test_every_request_finishes_once_with_the_ordinary_output(order, expected):
    engine, outputs = LLMEngine("demo", num_kv_blocks=256), {}

    def record(key, out):
        assert key not in outputs
        outputs[key] = out.token_ids

    stats = run_batch(engine, workload(), BlendOptions(order=order), record)
    assert outputs == dict(enumerate(expected))
    assert stats.requests == len(expected) and stats.output_tokens == sum(map(len, expected))
    assert stats.steps > 0 and stats.compute_s > 0 and stats.memory_s > 0
    assert stats.overlapped_s <= stats.compute_s + stats.memory_s
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def test_blend_keeps_the_prefix_sharing_of_dfs_and_fcfs_loses_some_under_a_small_cache():
    sharing = {}
    for order in ("dfs", "blend", "fcfs"):
        engine = LLMEngine("demo", num_kv_blocks=40, max_model_len=256)  # 640 tokens: a few prompts at once
        sharing[order] = run_batch(engine, workload(1, 60), BlendOptions(order=order), lambda k, o: None).sharing
    assert sharing["dfs"] > 0.5
    assert sharing["blend"] >= 0.9 * sharing["dfs"]
    assert sharing["fcfs"] < sharing["dfs"]


def test_finished_keys_are_skipped_and_used_as_samples():
    items, seen = workload(n=12), []
    engine = LLMEngine("demo", num_kv_blocks=256)
    run_batch(engine, items, BlendOptions(), lambda key, out: seen.append(key), finished={0: 3, 5: 3})
    assert sorted(seen) == [k for k in range(12) if k not in (0, 5)]


def test_stop_aborts_what_runs_and_returns():
    engine, seen = LLMEngine("demo", num_kv_blocks=256), []
    run_batch(engine, workload(n=12), BlendOptions(order="fcfs"), lambda key, out: seen.append(key),
              stop=lambda: len(seen) >= 2)
    assert 2 <= len(seen) < 12 and not engine.has_unfinished_requests()


def test_known_output_lengths_and_the_sampling_phase():
    items = workload(n=30)
    requests = [offline_request(k, p, s) for k, (p, s) in enumerate(items)]
    assert all(r.known_output == r.max_tokens for r in requests)  # ignore_eos: the length is fixed
    free = offline_request(0, [5, 6], SamplingParams(max_tokens=9))
    assert free.known_output is None
    feeder = BatchFeeder([free, offline_request(1, [5, 7], SamplingParams(max_tokens=9))], BlendOptions(),
                         _shape(), 1000, 16)
    first = feeder.admit()
    assert len(first) == 1 and feeder.order is None  # one sample runs before the tree is cut
    feeder.finished(first[0].key, 4)
    second = feeder.admit()
    assert feeder.order is not None and len(second) == 1 and feeder.tree.stats.output == 8  # estimate = sample
    feeder.finished(second[0].key, 2)
    assert feeder.done


def _shape():
    from splitserve.batch.blend.cost import ModelShape
    from splitserve.engine.demo import demo_model_config

    return ModelShape.of(demo_model_config())


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="order"):
        BlendOptions(order="random")
    with pytest.raises(ValueError, match="memory_fraction"):
        BlendOptions(memory_fraction=0)
