"""The hashes the ingress names a prompt's blocks by (`prompt_block_hashes`) are the ones the block
manager caches and looks up, and every process computes the same ones."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.prefix_hash import PrefixNaming, prompt_block_hashes, sequence_root
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence
from tests.engine.block_helpers import BS, cached, compute_all, make_seq, seq_range

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("length", [1, BS, BS + 1, 3 * BS, 3 * BS + 2])
def test_hashes_are_the_blocks_the_cache_holds_and_a_lookup_takes(length):
    bm = BlockManager(16, block_size=BS)
    tokens = seq_range(7, length)
    cached(bm, "a", tokens)
    # a prompt that goes on: the lookup tries every full block but one holding its last token
    hashes = prompt_block_hashes(tokens + [1], BS, max_blocks=100)
    assert hashes == bm.take_prefix_snapshot()[:len(hashes)]
    assert len(hashes) == length // BS
    again = make_seq("b", tokens + [1])
    bm.allocate(again)
    assert again.num_cached_tokens == len(hashes) * BS


@pytest.mark.parametrize("length", [2 * BS, 3 * BS + 2])  # within the trained context (3 blocks) and past it
def test_a_longrope_prompt_is_named_as_a_longrope_block_manager_caches_it(length):
    """Past LongRoPE's trained context a prompt's KV differs, and so does its chain's root: the
    ingress names the blocks the workers hold, not a shorter prompt's."""
    trained = 3 * BS
    bm = BlockManager(16, block_size=BS, root_of=sequence_root(trained))
    tokens = seq_range(7, length)
    cached(bm, "a", tokens)
    naming = PrefixNaming(BS, trained)
    hashes = naming.hashes(tokens + [1], max_blocks=100)
    assert hashes == bm.take_prefix_snapshot()[:len(hashes)] and len(hashes) == length // BS
    assert (hashes == prompt_block_hashes(tokens + [1], BS, 100)) == (length + 1 <= trained)
    assert PrefixNaming().hashes(tokens, 100) == ()


def test_a_lora_adapters_blocks_are_named_apart_from_the_base_models():
    """Under an adapter the same tokens' KV differs: its chain starts from a root of its own, named
    alike by the ingress and the block manager, and no lookup crosses between them."""
    bm = BlockManager(16, block_size=BS, root_of=sequence_root(None))
    tokens = seq_range(7, 2 * BS)
    adapted = Sequence("a", tokens, SamplingParams(lora="sql"), adapter_identity="sql")
    bm.allocate(adapted)
    compute_all(bm, adapted)
    hashes = PrefixNaming(BS).hashes(tokens + [1], 100, lora="sql")
    assert hashes == bm.take_prefix_snapshot()[:len(hashes)] and len(hashes) == 2
    assert not set(hashes) & set(prompt_block_hashes(tokens + [1], BS, 100))
    assert not set(hashes) & set(PrefixNaming(BS).hashes(tokens + [1], 100, lora="chat"))
    base = make_seq("b", tokens + [1])
    bm.allocate(base)
    assert base.num_cached_tokens == 0  # the base model finds none of the adapter's blocks
    again = Sequence("c", tokens + [1], SamplingParams(lora="sql"), adapter_identity="sql")
    bm.allocate(again)
    assert again.num_cached_tokens == 2 * BS


def test_a_cache_salt_names_its_blocks_apart_and_only_the_same_salt_shares_them():
    """vLLM's cache_salt: the ingress and the block manager name a salted prompt's blocks alike,
    apart from the unsalted and other salts' (under an adapter too), so a lookup crosses no salt."""
    bm = BlockManager(16, block_size=BS, root_of=sequence_root(None))
    tokens = seq_range(7, 2 * BS)
    salted = Sequence("a", tokens, SamplingParams(cache_salt="tenant-1"))
    bm.allocate(salted)
    compute_all(bm, salted)
    naming = PrefixNaming(BS)
    hashes = naming.hashes(tokens + [1], 100, salt="tenant-1")
    assert hashes == bm.take_prefix_snapshot()[:len(hashes)] and len(hashes) == 2
    others = [naming.hashes(tokens + [1], 100), naming.hashes(tokens + [1], 100, salt="tenant-2"),
              naming.hashes(tokens + [1], 100, lora="tenant-1"), naming.hashes(tokens + [1], 100, "sql", "tenant-1")]
    assert all(not set(hashes) & set(other) for other in others)
    for seq_id, params, hit in [("b", SamplingParams(), 0), ("c", SamplingParams(cache_salt="tenant-2"), 0),
                                ("d", SamplingParams(lora="sql", cache_salt="tenant-1"), 0),
                                ("e", SamplingParams(cache_salt="tenant-1"), 2 * BS)]:
        again = Sequence(seq_id, tokens + [1], params, adapter_identity=params.lora)
        bm.allocate(again)
        assert again.num_cached_tokens == hit, seq_id


def test_the_last_token_is_never_covered_and_the_count_is_capped():
    two_blocks = seq_range(0, 2 * BS)
    assert prompt_block_hashes(two_blocks, BS, 100) == prompt_block_hashes(two_blocks[:-1], BS, 100)
    assert len(prompt_block_hashes(two_blocks, BS, 100)) == 1
    ten_blocks = seq_range(0, 10 * BS)
    assert prompt_block_hashes(ten_blocks, BS, 3) == prompt_block_hashes(ten_blocks, BS, 100)[:3]
    assert prompt_block_hashes([], BS, 100) == ()
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes([1, 2], 0, 100)


def test_a_block_hash_names_its_whole_prefix():
    one = prompt_block_hashes([1] * 8 + [2] * 4 + [0], BS, 100)
    other = prompt_block_hashes([3] * 8 + [2] * 4 + [0], BS, 100)
    assert one[2] != other[2]  # same tokens, different prefix


def test_every_process_computes_the_same_hashes():
    """Not salted by PYTHONHASHSEED, nor by where None lies in memory (hash(None) before 3.12)."""
    code = "import json; from splitserve.engine.prefix_hash import prompt_block_hashes as h; " \
           "print(json.dumps(h(list(range(100)), 16, 100) + h(list(range(100)), 16, 100, lora='sql', salt='t')))"
    seen = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        seen.add(tuple(json.loads(out.stdout)))
    assert seen == {prompt_block_hashes(list(range(100)), 16, 100) + prompt_block_hashes(list(range(100)), 16, 100,
                                                                                         lora="sql", salt="t")}
