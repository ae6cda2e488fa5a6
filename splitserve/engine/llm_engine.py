"""The step-level engine the workers drive: add_request / step / abort, plus the KV handoff
between a prompt engine and a token engine (export on one side, import on the other)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from splitserve.engine.lora_loading import EngineAdapters
from splitserve.engine.bad_words import BadWords
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.engine_config import EngineConfig
from splitserve.engine.grammar import GrammarMasks
from splitserve.engine.host_kv_blocks import LeaderHostKV
from splitserve.engine.host_kv_tier import HostKVTier
from splitserve.engine.in_flight import InFlight, drain
from splitserve.engine.outputs import RequestOutput, StepStats
from splitserve.engine.policies import Plan, make_policy
from splitserve.engine.prefix_hash import sequence_root
from splitserve.engine.prompt_logprobs import prompt_logprobs
from splitserve.engine.sampler import Sampler
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sequence import Sequence, SequenceStatus
from splitserve.engine.shard_builder import build_shard
from splitserve.engine.speculation import NgramProposer, speculate
from splitserve.engine.tensor_parallel import TPGroup
from splitserve.engine.tokenizer import Detokenizer
from splitserve.engine.tp_step import TPLeader
from splitserve.engine.tracked_request import TrackedRequest

PromptInput = str | list[int] | dict


class StepFailed(RuntimeError):
    """An iteration raised (a CUDA OOM, a bug): the requests it ran were aborted, their blocks
    freed; the engine's other requests are untouched and it can step again. `request_ids` is
    None when scheduling itself failed, so no request can be blamed and the state is suspect."""

    def __init__(self, request_ids: list[str] | None, cause: BaseException):
        super().__init__(f"step failed: {type(cause).__name__}: {cause}")
        self.request_ids, self.cause = request_ids, cause


class _NotQueued(Exception):
    """A scheduled iteration raised before it was queued whole; its requests are not aborted yet."""

    def __init__(self, plan: Plan, cause: BaseException):
        super().__init__(str(cause))
        self.plan, self.cause = plan, cause


class LLMEngine:
    def __init__(self, model: str = "demo", config: EngineConfig | None = None, tp: TPGroup | None = None,
                 **overrides):
        """`tp`: this worker's tensor-parallel group, of which this engine is rank 0 (the others
        run `tp_step.TPFollower`); None: one rank."""
        self.config = config = replace(config or EngineConfig(), **overrides)
        if tp is not None and not tp.is_leader:
            raise ValueError(f"an LLMEngine is rank 0 of its group; rank {tp.rank} runs a TPFollower")
        self.tp_leader = TPLeader(tp) if tp is not None else None
        shard = build_shard(model, config, tp, self.tp_leader)
        loaded = shard.loaded
        self.model_name, self.model_config, self.tokenizer = model, loaded.config, loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.kv_cache, self.runner = shard.kv_cache, shard.runner
        self._long_rope_from = loaded.config.long_rope_from
        windows = self.kv_cache.groups.windows
        self._host_kv = shard.host_kv if self.tp_leader is None or shard.host_kv is None else \
            LeaderHostKV(shard.host_kv, self.tp_leader)
        self.host_tier = None if self._host_kv is None else \
            HostKVTier(shard.host_kv.host.shape[0], len(windows), self._host_kv,
                       config.kv_host_write_policy == "write_through")
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching,
                                          sequence_root(self._long_rope_from), windows, self.host_tier)
        limits = config.scheduler_limits(self.max_model_len)
        self.policy = make_policy(config.policy, self.block_manager, limits)
        self.adapters = EngineAdapters(self.runner.model, self.tp_leader, self._adapters_in_use, config.max_num_seqs)
        self.policy.adapters = self.adapters.residency
        self.sampler = Sampler(seed=config.seed, grammar=lambda: GrammarMasks(loaded.tokenizer, loaded.config.vocab_size))
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids) | frozenset(loaded.tokenizer.eos_token_ids)
        self.proposer = NgramProposer(config.speculative) if config.speculative.enabled else None
        self._requests: dict[str, TrackedRequest] = {}
        self.last_step = StepStats()  # what the last non-empty step computed, and how long it took
        device_is_cuda = self.runner.device.type == "cuda"
        self.async_scheduling = device_is_cuda if config.async_scheduling is None else config.async_scheduling
        self._in_flight: InFlight | None = None  # queued by the last step (async scheduling)
        self._failed: StepFailed | None = None   # the queuing of that next iteration failed: the next step raises

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
                    arrival_time: float | None = None, hand_off: bool | None = None,
                    export_from: tuple[int, ...] = ()) -> Sequence:
        """Queue a request. Invalid input raises ValueError naming the field, and changes nothing.
        `hand_off`: prefill only and hold the KV for export (default: what the policy's role does);
        `export_from`: per KV layer group, the first position the export sends (a windowed group
        releases the blocks before it as its window passes them; (): keep every block)."""
        req = self._new_request(request_id, prompt, params, arrival_time)
        if export_from and (len(export_from) != self.block_manager.num_groups
                            or not all(isinstance(s, int) and 0 <= s < req.seq.num_tokens for s in export_from)):
            raise ValueError(f"export_from must name a position in the prompt for each of the "
                             f"{self.block_manager.num_groups} KV layer groups, got {export_from!r}")
        if req.seq.params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * req.seq.num_prompt_tokens
        req.seq.export_from = tuple(export_from)
        self.policy.add(req.seq, hand_off)
        self._requests[request_id] = req
        return req.seq

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and not req.seq.is_finished:
            if self._in_flight is not None and self._in_flight.runs(req.seq):
                self._in_flight.wait()  # its blocks may be handed on only once nothing writes them
            self.policy.finish(req.seq, "abort")
        self.sampler.forget(request_id)
        if req is not None and self.proposer is not None:
            self.proposer.forget(req.seq)

    def set_policy(self, name: str) -> None:
        """Change scheduling role (prompt / token / mixed / prefill_first / orca / ...) on the live engine;
        every queued, running and held sequence carries over. On CUDA the KV cache left room for the
        iterations of `config.policy` and `config.switch_policies`: another may form larger ones."""
        policy = make_policy(name, self.block_manager, self.policy.limits)
        if self._in_flight is not None:
            self._in_flight.wait()  # adopting may preempt a prompt mid-prefill: nothing may write its blocks then
        policy.adopt(self.policy)
        self.policy = policy

    @property
    def host_tier_tokens(self) -> tuple[int, int]:
        """The host KV tier's tokens saved and restored so far (a token's block of every layer group)."""
        if self.host_tier is None:
            return 0, 0
        tokens_of = self.block_manager.tokens_of
        return tokens_of(self.host_tier.saved_blocks), tokens_of(self.host_tier.restored_blocks)

    def has_unfinished_requests(self) -> bool:
        return self.policy.has_work() or self._in_flight is not None or self._failed is not None

    def check_integrity(self) -> None:
        """Raise RuntimeError if scheduler queues, block ownership and tracked requests disagree,
        or if this engine's tensor-parallel ranks fell out of step."""
        if self.tp_leader is not None:
            self.tp_leader.check()
        self.policy.check_integrity()
        live = {seq.seq_id for seq in [*self.policy.running, *self.policy.waiting]} | set(self.policy.held)
        if live != set(self._requests):
            raise RuntimeError(f"engine tracks {sorted(self._requests)} but the scheduler holds {sorted(live)}")

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name (`SamplingParams.lora`), in load order."""
        return tuple(self.adapters.identities)

    @property
    def lora_identities(self) -> dict[str, str]:
        """Each adapter a request may name -> its identity (what its prefix-cache blocks chain from)."""
        return self.adapters.identities

    def load_lora(self, name: str, path: str) -> str:
        """Load the PEFT adapter at `path` as `name` into host memory, between steps (`max_loras` > 0);
        its identity (what its prefix-cache blocks chain from). See `EngineAdapters.load` for what it raises."""
        return self.adapters.load(name, path)

    def unload_lora(self, name: str) -> None:
        """No new request may name `name`; those under it finish (AdapterNotLoaded if none is loaded)."""
        self.adapters.unload(name)

    def _adapters_in_use(self) -> set[str]:
        return {r.seq.adapter_identity for r in self._requests.values() if r.seq.adapter_identity is not None}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def request_ids(self) -> frozenset[str]:
        return frozenset(self._requests)

    def step(self, after_layer: Callable[[Plan, int], None] | None = None,
             before_forward: Callable[[Plan], None] | None = None) -> list[RequestOutput]:
        """Run one iteration; return the requests that got a token (cumulative outputs).
        `before_forward(plan)` runs once the iteration is scheduled; `after_layer(plan, i)` once
        layer i's KV for this iteration is in the cache. With async scheduling, a call without
        hooks queues the next iteration on the device before it builds this one's outputs, and
        the next call returns that iteration's: a request added in between joins the one after."""
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        pipelined = self.async_scheduling and after_layer is None and before_forward is None
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            try:
                in_flight = self._launch(after_layer, before_forward)
            except _NotQueued as error:
                raise self._fail(error.plan, error.cause) from error.cause
        return [] if in_flight is None else self._complete(in_flight, pipelined)

    def _launch(self, after_layer: Callable[[Plan, int], None] | None = None,
                before_forward: Callable[[Plan], None] | None = None) -> InFlight | None:
        """Schedule an iteration and queue its forward and sampling on the device (None: no work).
        Raises StepFailed when scheduling fails, _NotQueued when the iteration does."""
        start = time.monotonic()
        try:
            plan = self.policy.schedule()
            if self.proposer is not None and plan:
                limits = self.policy.limits
                plan = speculate(plan, self.proposer, self.block_manager, self.policy.max_step_tokens(limits),
                                 limits.max_num_seqs, self.max_model_len, self._long_rope_from,
                                 lambda seq, drafts: self.sampler.grammar.valid_drafts(seq, drafts))
        except Exception as error:
            raise StepFailed(None, error) from error
        if not plan:
            return None
        try:
            if before_forward is not None:
                before_forward(plan)
            work = plan.work()
            for item in plan.scheduled:
                if item.seq.first_scheduled_time is None:
                    item.seq.first_scheduled_time = start
            tables = {item.seq.seq_id: self.block_manager.block_tables(item.seq.seq_id) for item in plan.scheduled}
            hook = None if after_layer is None else (lambda i: after_layer(plan, i))
            forward = self.runner.execute(plan, tables, hook)
            return InFlight.queued(plan, work, start, forward,
                                   self.sampler.draw(forward.logits, forward.seqs, forward.drafts))
        except Exception as error:
            raise _NotQueued(plan, error) from error

    def _complete(self, in_flight: InFlight, pipelined: bool) -> list[RequestOutput]:
        """Read an iteration's tokens and record them. Pipelined, the next iteration is queued as
        soon as the scheduler knows every way these tokens end sequences (ids, lengths, stop
        strings, LongRoPE's turn), before the other outputs are built."""
        plan = in_flight.plan
        try:
            forward = in_flight.forward
            for rows in forward.prompt_rows:
                req = self._requests.get(rows.seq.seq_id)  # None, or a new one of its id: aborted while its chunk ran
                found = req.prompt_logprobs if req is not None and req.seq is rows.seq else None
                if found is not None:  # None: an import reserved here, whose prompt worker computes them
                    found[rows.first_position:rows.first_position + len(rows.hidden)] = \
                        prompt_logprobs(self.runner.model.compute_logits, rows)
            for seq, vector in forward.pooled:
                req = self._requests.get(seq.seq_id)
                if req is not None and req.seq is seq:
                    req.embedding = vector.tolist()
            sampled = forward.by_sequence(in_flight.drawn.read())
            now = time.monotonic()
            self.policy.observe(plan, now - in_flight.start)
            ids = {k: [t.token_id for t in v] for k, v in sampled.items()}
            kept = 0 if self.proposer is None else self.proposer.settle(plan, ids)
            updated = self.policy.complete_step(plan, ids)
            if self.host_tier is not None:
                self.host_tier.flush()  # write-through: the blocks this step cached, behind its forward
            self.last_step = replace(in_flight.work, seconds=now - in_flight.start, accepted_tokens=kept)

            def record(req: TrackedRequest) -> RequestOutput:
                seq = req.seq  # the tokens it got are its rows' first ones (`speculation.accepted`)
                got = sampled[seq.seq_id][:seq.num_tokens - seq.num_prompt_tokens - len(req.output_ids)]
                return self._record(req, [(token.token_id, token.logprobs) for token in got], now)

            requests = [self._requests[seq.seq_id] for seq in updated]
            first, later = [], []  # recorded before the next iteration is queued, and after
            for req in requests:
                (later if pipelined and not req.stops_on_text else first).append(req)
            outputs = {req.seq.seq_id: record(req) for req in first}
            if self._long_rope_from is not None:
                for seq in updated:
                    self._turn_long_rope(seq)
        except Exception as error:
            raise self._fail(plan, error) from error
        not_queued = None
        if pipelined:
            try:
                self._in_flight = self._launch()
            except StepFailed as failed:  # this iteration's outputs still go out; the next call raises
                self._failed = failed
            except _NotQueued as error:
                not_queued = error
        try:
            outputs.update((req.seq.seq_id, record(req)) for req in later)
        except Exception as error:
            raise self._fail(plan, error) from error
        finally:
            if not_queued is not None:  # aborted once this iteration's tokens are recorded
                self._failed = self._fail(not_queued.plan, not_queued.cause)
        return [outputs[seq.seq_id] for seq in updated]

    def _fail(self, plan: Plan, error: BaseException) -> StepFailed:
        """Abort the iteration's requests (their blocks freed once nothing it queued can write them):
        the engine's others are untouched."""
        drain(self.kv_cache.data.device)
        ids = [item.seq.seq_id for item in plan.scheduled]
        for request_id in ids:
            self.abort(request_id)
        return StepFailed(ids, error)

    # ---- KV handoff --------------------------------------------------------------------
    def export_request(self, request_id: str) -> tuple[Sequence, list[list[int]]]:
        """A prefilled request (prompt role): its sequence and the blocks holding its KV (per layer group)."""
        seq = self._requests[request_id].seq
        if seq.status is not SequenceStatus.PREFILLED:
            raise ValueError(f"request {request_id!r} is {seq.status.value}, not prefilled; nothing to export")
        return seq, self.block_manager.export_blocks(request_id)

    def release_request(self, request_id: str) -> None:
        """The exported KV has been delivered: free it here."""
        self.abort(request_id)

    def reserve_import(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                       arrival_time: float | None = None,
                       reuse_prefix: bool = False) -> tuple[Sequence, list[list[int]]]:
        """Reserve blocks for a prompt whose KV another engine computes; returns its sequence and
        the block tables to fill (per layer group). With `reuse_prefix`, the KV of the first
        `seq.num_computed_tokens` prompt tokens comes from this engine's prefix cache: fill only the
        positions after them."""
        req = self._new_request(request_id, prompt_token_ids, params, arrival_time)
        tables = self.policy.reserve_import(req.seq, reuse_prefix)
        if self._host_kv is not None:
            self._host_kv.wait()  # blocks the reservation evicted are copied out before the import writes them
        self._requests[request_id] = req
        return req.seq, tables

    def complete_import(self, request_id: str, first_token_id: int,
                        first_logprobs: dict[int, float] | None = None) -> RequestOutput:
        """The KV has been written into the reserved blocks: decode from the first token on
        (sampled, with its logprobs if requested, by the prompt engine)."""
        req = self._requests[request_id]
        self.policy.complete_import(request_id, first_token_id)
        output = self._record(req, [(first_token_id, first_logprobs)], time.monotonic())
        self._turn_long_rope(req.seq)
        return output

    # ---- internals ---------------------------------------------------------------------
    def _new_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | None,
                     arrival_time: float | None) -> TrackedRequest:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        if params.resumed_tokens >= len(token_ids):
            raise ValueError(f"resumed_tokens must be shorter than the prompt ({len(token_ids)} tokens), "
                             f"got {params.resumed_tokens}")
        if params.priority and not self.policy.limits.by_priority:
            raise ValueError(f"priority: this engine schedules first come, first served (scheduling_policy fcfs); "
                             f"a request's priority must be 0, got {params.priority}")
        if params.constraint is not None:
            self.sampler.grammar.check(params.constraint)
        if any(t >= self.model_config.vocab_size for t in params.label_token_ids):
            raise ValueError(f"label_token_ids must be ids under the vocabulary's {self.model_config.vocab_size}, "
                             f"got {params.label_token_ids}")
        seq = Sequence(request_id, token_ids, params, time.monotonic() if arrival_time is None else arrival_time,
                       self.eos_token_ids, adapter_identity=self.adapters.identity_of(params),
                       bad_words=BadWords.of(params.bad_words, self.tokenizer))
        detokenizer = Detokenizer(self.tokenizer, params, token_ids) if params.detokenize else None
        return TrackedRequest(seq, text, detokenizer, logprobs=[] if params.logprobs is not None else None)

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a prompt dict must have 'prompt_token_ids'")
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, prompt
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                             "the prompt must leave room for at least one generated token")
        return text, list(ids)

    def _turn_long_rope(self, seq: Sequence) -> None:
        """LongRoPE: the token that takes a sequence still running past the trained context turns
        all of it long, so its KV so far (computed short) is recomputed, as transformers'
        generate() does: a preemption by recompute, whose new blocks chain from the long root."""
        if seq.num_tokens - 1 == self._long_rope_from and seq.status is SequenceStatus.RUNNING:
            self.policy.preempt(seq)

    def _record(self, req: TrackedRequest, tokens: list[tuple[int, dict[int, float] | None]],
                now: float) -> RequestOutput:
        """Record the tokens a step appended to the request's sequence; the output so far."""
        seq = req.seq
        if req.append(tokens, now):  # a stop string ended it
            if seq.is_finished:
                seq.finish_reason = "stop"
            else:
                self.policy.finish(seq, "stop")
        if seq.is_finished:
            self._requests.pop(seq.seq_id, None)
            self.sampler.forget(seq.seq_id)
            if self.proposer is not None:
                self.proposer.forget(seq)
        return req.output()
