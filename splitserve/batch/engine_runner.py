"""An offline batch on one engine: the feeder decides what enters, the engine's own policy,
prefix cache and preemption run it. Reports throughput, prefix sharing and the cost model's view
of every step (compute-bound and memory-bound time, and their overlap)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.batch.blend.cost import ACCELERATORS, CostModel, ModelShape
from splitserve.batch.blend.feeder import BatchFeeder, BlendOptions
from splitserve.batch.blend.tree import OfflineRequest
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.outputs import RequestOutput, StepStats
from splitserve.engine.sampling_params import SamplingParams


@dataclass
class BatchStats:
    order: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0   # prompt tokens whose KV came from the prefix cache
    output_tokens: int = 0
    steps: int = 0
    engine_s: float = 0.0    # measured time in engine steps
    compute_s: float = 0.0   # cost model, summed over steps: GEMMs and prefill attention
    memory_s: float = 0.0    # cost model: decode attention's KV reads
    overlapped_s: float = 0.0  # cost model: sum over steps of max(compute, memory), an overlapping backend
    step_density: list[float] = field(default_factory=list)  # compute / memory time of each step with decodes

    @property
    def throughput(self) -> float:
        """(prompt + output tokens) per second of engine time, the paper's metric."""
        return (self.prompt_tokens + self.output_tokens) / self.engine_s if self.engine_s else 0.0

    @property
    def sharing(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add_step(self, step: StepStats, cost: CostModel) -> None:
        compute = cost.gemm_s(step.prefill_tokens + step.decode_tokens) + cost.attention_s(step.prefill_attention_pairs)
        memory = cost.kv_read_s(step.decode_context_tokens)
        self.steps += 1
        self.engine_s += step.seconds
        self.compute_s += compute
        self.memory_s += memory
        self.overlapped_s += max(compute, memory)
        if memory:
            self.step_density.append(compute / memory)

    def add_request(self, output: RequestOutput) -> None:
        self.requests += 1
        self.prompt_tokens += len(output.prompt_token_ids)
        self.cached_tokens += output.num_cached_tokens
        self.output_tokens += len(output.token_ids)


def offline_request(key: int, prompt_token_ids: list[int], params: SamplingParams, choices: int = 1
                    ) -> OfflineRequest:
    """Its output length is known when it cannot stop early (EOS ignored, no stop conditions; one
    token at most is one token: its prefill's, an embedding's included)."""
    unstoppable = params.ignore_eos and not params.stop and not params.stop_token_ids
    fixed = params.max_tokens == 1 or params.min_tokens == params.max_tokens or unstoppable
    return OfflineRequest(key, tuple(prompt_token_ids), params.max_tokens, params.max_tokens if fixed else None,
                          choices)


def run_batch(engine: LLMEngine, items: list[tuple[list[int], SamplingParams]], options: BlendOptions,
              on_output: Callable[[int, RequestOutput], None], finished: dict[int, int] | None = None,
              max_waiting: int = 8, stop: Callable[[], bool] = lambda: False) -> BatchStats:
    """Run `items` (prompt token ids, params; keyed by position) to completion in the options'
    order, calling `on_output(key, output)` as each finishes. `finished`: keys already done, with
    their output lengths (not run again). `stop()` true: abort what runs and return early. The
    engine should be otherwise idle."""
    finished = dict(finished or {})
    todo = [offline_request(key, prompt, params) for key, (prompt, params) in enumerate(items) if key not in finished]
    known = [offline_request(key, items[key][0], items[key][1]) for key in finished]
    model = ModelShape.of(engine.model_config)
    kv_tokens = engine.block_manager.tokens_of(engine.block_manager.num_blocks)
    feeder = BatchFeeder(todo + known, options, model, kv_tokens, engine.block_manager.block_size, finished)
    cost = CostModel(model, ACCELERATORS[options.accelerator])
    stats = BatchStats(options.order)
    while not feeder.done:
        if stop():
            for key in list(feeder.in_flight):
                engine.abort(str(key))
            break
        if len(engine.policy.waiting) < max_waiting:
            for request in feeder.admit():
                engine.add_request(str(request.key), list(request.prompt), items[request.key][1])
        if feeder.done:  # blend: the sample was every request left (a rerun, a batch of one)
            break
        if not engine.has_unfinished_requests():
            raise RuntimeError("the batch stalled: nothing is running and the feeder admits nothing")
        before = engine.last_step
        outputs = engine.step()
        if engine.last_step is not before:
            stats.add_step(engine.last_step, cost)
        for output in outputs:
            key = int(output.request_id)
            feeder.prefilled(key)
            if output.finished:
                feeder.finished(key, len(output.token_ids))
                stats.add_request(output)
                on_output(key, output)
    return stats
