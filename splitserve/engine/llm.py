"""Offline batch generation in vLLM's shape: `LLM(model).generate(prompts, params)`, and
embeddings: `LLM(model).embed(prompts)`."""
from __future__ import annotations

from collections.abc import Sequence as Seq

from splitserve.engine.llm_engine import LLMEngine, PromptInput
from splitserve.engine.model_builder import resolve_device
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams

# an offline batch's mixed steps on a GPU: no token waits on its latency, so the prompts' chunks share steps
# as wide as a GPU's matmuls run near their peak (Sarathi-Serve's 512, `EngineConfig`'s default, bounds a
# served decode's time between tokens; vLLM's LLM class takes 16384 on large GPUs, 8192 on others)
OFFLINE_CHUNK_TOKENS = 8192


class LLM:
    """`model` is "demo" or a Hugging Face checkpoint directory; keyword arguments are
    `EngineConfig` fields (policy, block_size, dtype, device, load_format, ...), with
    `offline_defaults`' chunk budget on a GPU."""

    def __init__(self, model: str = "demo", **engine_args):
        if engine_args.get("policy") in ("prompt", "accelgen_prompt"):
            raise ValueError(f"policy {engine_args['policy']!r} only prefills and hands the KV on; LLM needs a policy "
                             "that finishes requests: mixed, prefill_first, orca, accelgen or token")
        device = resolve_device(str(engine_args.get("device", "auto"))).type
        self.engine = LLMEngine(model, **offline_defaults(engine_args, device))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Seq[PromptInput],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) or _is_token_list(prompts) else list(prompts)
        params = sampling_params if isinstance(sampling_params, Seq) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        ids = self._add_all(prompts, params)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            finished.update((out.request_id, out) for out in self.engine.step() if out.finished)
        return [finished[i] for i in ids]

    def embed(self, prompts: PromptInput | Seq[PromptInput], lora: str | None = None) -> list[list[float]]:
        """vLLM's `LLM.embed`: each prompt's embedding (`SamplingParams.embed`: its last token's
        final hidden state, L2-normalized), in the order of the prompts."""
        return [out.embedding for out in self.generate(prompts, SamplingParams.embedding(lora))]

    def _add_all(self, prompts: list[PromptInput], params: list[SamplingParams | None]) -> list[str]:
        """Add every request, or none: a bad one is rejected before any runs."""
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(str(self._counter))
                self._counter += 1
                self.engine.add_request(ids[-1], prompt, p)
        except ValueError:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return ids


def offline_defaults(engine_args: dict, device_type: str) -> dict:
    """`engine_args` with the mixed policy's chunk budget `OFFLINE_CHUNK_TOKENS` on a GPU, where
    they do not set it (an `EngineConfig` given as `config` sets every field)."""
    if device_type == "cuda" and not {"chunk_token_budget", "config"} & engine_args.keys():
        return {**engine_args, "chunk_token_budget": OFFLINE_CHUNK_TOKENS}
    return engine_args


def _is_token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)
