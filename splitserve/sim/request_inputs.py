"""What a trace's request (`RequestSpec`) is to the simulated engine: its prompt's tokens and its
sampling parameters. Every request has a forced output length (max_tokens with ignore_eos)."""
from __future__ import annotations

import itertools

from splitserve.bench.workload import RequestSpec
from splitserve.engine.sampling_params import SamplingParams


class RequestInputs:
    def __init__(self, caching: bool):
        """`caching`: the run caches prefixes, so prompts carry their blocks' identities."""
        self.caching = caching
        self._params: dict[tuple, SamplingParams] = {}  # shared by requests alike (SamplingParams is frozen)

    def prompt_of(self, spec: RequestSpec) -> list[int]:
        """Without prefix caching, zeros. With it, each prefix block's id repeated for its tokens
        (equal blocks are equal tokens), or, for a request with no blocks, tokens no other has."""
        if not self.caching:
            return [0] * spec.prompt_tokens
        if not spec.prefix_blocks:
            return [-1 - spec.index] * spec.prompt_tokens
        tokens: list[int] = []
        for block in spec.prefix_blocks:  # built to the prompt's length only (a block may be longer than it)
            tokens += itertools.repeat(block, min(spec.block_tokens, spec.prompt_tokens - len(tokens)))
        return tokens

    def params_of(self, spec: RequestSpec) -> SamplingParams:
        """The request's forced length and targets; one (validated) instance per distinct value."""
        key = (spec.output_tokens, spec.ttft_slo_s, spec.tbt_slo_s, spec.priority)
        params = self._params.get(key)
        if params is None:
            params = self._params[key] = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True,
                                                        ttft_slo_s=spec.ttft_slo_s, tbt_slo_s=spec.tbt_slo_s,
                                                        priority=spec.priority)
        return params
