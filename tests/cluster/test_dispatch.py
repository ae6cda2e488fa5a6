"""What the ingress asks the CLS for a request (no Ray: a stand-in CLS): the prompt's block hashes
for prefix-aware placement, which are the ones the engines' block managers cache."""
from __future__ import annotations

import asyncio

import pytest

from splitserve.cluster.dispatch import Overloaded, Run, WorkerDirectory
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.block_helpers import cached


class _CLS:
    """Refuses every placement, keeping the requests it was asked to place."""

    def __init__(self):
        self.requests = []
        self.place = self

    def remote(self, request, exclude):
        self.requests.append(request)

        async def answer():
            return None
        return answer()


def asked(prompt: list[int], prefix_block_size: int, params: SamplingParams = SamplingParams(max_tokens=4)):
    cls = _CLS()
    run = Run("r", prompt, params, WorkerDirectory(cls), max_attempts=1, prefix_block_size=prefix_block_size)
    with pytest.raises(Overloaded):
        asyncio.run(run.admit())
    return cls.requests[0]


def test_the_request_names_the_blocks_a_block_manager_caches_for_the_prompt():
    prompt = [(i * 7 + 3) % 256 for i in range(70)]
    blocks = BlockManager(16, block_size=8)
    cached(blocks, "earlier", prompt)  # an earlier turn: every full block of the prompt cached
    request = asked(prompt, 8)
    assert request.num_prompt_tokens == 70 and len(request.prefix_hashes) == 8  # (70 - 1) // 8
    assert request.prefix_hashes == blocks.take_prefix_snapshot()[:8]


def test_no_hashes_when_prefix_aware_placement_is_off_or_the_cache_would_not_be_used():
    prompt = list(range(40))
    assert asked(prompt, 0).prefix_hashes == ()
    assert asked(prompt, 8, SamplingParams(max_tokens=4, prompt_logprobs=1)).prefix_hashes == ()
