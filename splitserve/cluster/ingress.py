"""The HTTP front: a Ray Serve deployment speaking OpenAI's API.

Per request: authenticate and bound the body (`ApiGuard`, in front of every route), parse and
validate (400s name the field, 413 past a size bound), tokenize off the event loop (chat template
for chat), admit through the controller (429 with Retry-After when the cluster cannot), then
stream or collect the tokens the workers send, turning them into text here (`TextStream`). Any
number of replicas can run: placement state lives in the one controller.
"""

import asyncio
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayTaskError

from splitserve.api import response_bodies as R
from splitserve.api.errors import RequestError, error_response
from splitserve.api.guard import guard
from splitserve.api.json_pieces import json_text
from splitserve.api.lazy_grammar import LazyGrammar
from splitserve.api.lora_requests import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from splitserve.api.pooled_requests import prepare_pooled
from splitserve.api.prepared_request import PreparedRequest, prepare_request, prepare_responses
from splitserve.api.request_models import ServedModels, check_model, parse_request
from splitserve.api.responses_bodies import input_items, new_id, response_object, response_of_choice
from splitserve.api.responses_events import ResponseEvents
from splitserve.api.responses_request import ResponsesRequest
from splitserve.api.tokenizer_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info
from splitserve.batch import routes as batch_routes
from splitserve.cluster import stored_conversations, stored_responses
from splitserve.cluster.batch_manager import RemoteBatches
from splitserve.cluster.choices_response import ChoicesResponse, choices_for
from splitserve.cluster.dispatch import ClusterUnavailable, Overloaded, RequestFailed, Run, WorkerDirectory
from splitserve.cluster.embedding_runs import embeddings_of
from splitserve.cluster.large_bodies import encoded, json_response, text_response
from splitserve.cluster.lora_updates import LoraUpdateError
from splitserve.cluster.metrics import RequestObservation, kind_of
from splitserve.cluster.observations import ObservationBuffer
from splitserve.cluster.owned_actor import OwnedActor
from splitserve.cluster.served_adapters import ServedAdapters
from splitserve.config import ClusterConfig
from splitserve.engine.model_builder import load_metadata
from splitserve.engine.prefix_hash import PrefixNaming
from splitserve.engine.sampling_params import SamplingParams

api = guard(FastAPI(title="splitserve", description="OpenAI-compatible API of a splitserve cluster"))
api.include_router(batch_routes.router)
api.include_router(stored_responses.router)
api.include_router(stored_conversations.router)


@serve.deployment(max_ongoing_requests=1024)
@serve.ingress(api)
class Ingress:
    def __init__(self, controller, config: dict):
        self.config = ClusterConfig.model_validate(config)
        model_config, self.tokenizer, self.max_model_len = load_metadata(self.config.model,
                                                                         self.config.engine.engine_config("token"))
        self.config.check_model(model_config)
        self.hidden_size = model_config.hidden_size  # an embedding's dimensions
        self.score_labels = self.config.score_labels(self.tokenizer)  # a token-answering reranker's, else ()
        self._grammar = LazyGrammar(self.tokenizer, model_config.vocab_size)
        self.api_key = self.config.ingress.api_key or os.environ.get("SPLITSERVE_API_KEY") or None
        self._directory: WorkerDirectory | None = None
        self._observations = ObservationBuffer()
        self.created = int(time.time())
        self.limits = self.config.request_limits()
        self._adapters = ServedAdapters(self.config, PrefixNaming(self.config.prefix_block_size(),
                                                                  model_config.long_rope_from))
        api.state.api_key, api.state.limits = self.api_key, self.limits
        self._cls = OwnedActor(controller.handle.remote, "cluster controller (CLS)")
        api.state.batches = RemoteBatches(OwnedActor(controller.batches_handle.remote, "batch API's actor"))
        self._stored = stored_responses.StoredResponses(OwnedActor(controller.responses_handle.remote,
                                                                   "response store"),
                                                        self.config.ingress.stored_responses > 0, self._run_again)
        api.state.stored_responses = self._stored

    @property
    def served(self) -> ServedModels:
        """What clients may send as `model`, as of this replica's last look (`ServedAdapters`)."""
        return self._adapters.served

    async def _refresh_adapters(self, now: bool = False) -> None:
        await self._adapters.refresh(lambda: self._cls.call("lora_table"), now)

    # ---- endpoints ---------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> JSONResponse:
        state = await self._cls.call("health")
        return JSONResponse(state, status_code=200 if state["ready"] else 503)

    @api.get("/v1/models")
    async def models(self) -> JSONResponse:
        await self._refresh_adapters()
        return JSONResponse(R.models_list(self.served, self.created, max_model_len=self.max_model_len))

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str) -> JSONResponse:
        """OpenAI's retrieve: one name this cluster answers to (names may hold slashes), else a 404."""
        await self._refresh_adapters()
        try:
            check_model(model, self.served)
        except RequestError as error:
            return error_response(error)
        return JSONResponse(R.model_card(model, self.created, max_model_len=self.max_model_len, served=self.served))

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        await self._refresh_adapters()
        return await self._tokenizer_call(request, TokenizeRequest, lambda body: tokenize(
            body, self.tokenizer, self.served.all, self.max_model_len))

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        await self._refresh_adapters()
        return await self._tokenizer_call(request, DetokenizeRequest, lambda body: detokenize(
            body, self.tokenizer, self.served.all))

    @api.get("/tokenizer_info")
    async def tokenizer_info(self) -> JSONResponse:
        return JSONResponse(tokenizer_info(self.tokenizer, self.max_model_len))

    @api.get("/metrics")
    async def metrics(self) -> Response:
        """The whole cluster's metrics (any replica gives the same view); no API key, like /health."""
        await self._observations.flush(self._cls)
        return Response(await self._cls.call("metrics_text"), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/cluster/status")
    async def status(self) -> JSONResponse:
        return JSONResponse(await self._cls.call("status"))

    @api.post("/v1/cluster/workers/{worker_id}/drain")
    async def drain_worker(self, worker_id: str, replace: bool = True) -> JSONResponse:
        """Take a worker out of service gracefully (before its node goes down, say): it takes no
        new requests, finishes what it runs, then stops; `replace` starts a new one in its place."""
        try:
            return JSONResponse(await self._cls.call("retire", worker_id, replace))
        except RayTaskError as error:
            if isinstance(error.cause, KeyError):
                return error_response(RequestError(f"no worker {worker_id!r} in the pools", status=404,
                                                   param="worker_id"))
            raise

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: load a PEFT adapter on every worker, served as a model of its own (engine.max_loras)."""
        return await self._lora_update(request, LoadLoraAdapterRequest, "load_lora", "added")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's: clients may no longer name the adapter; what runs under it finishes."""
        return await self._lora_update(request, UnloadLoraAdapterRequest, "unload_lora", "removed")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle(request, "chat")

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        """OpenAI's: each input's embedding (`embedding_request`), its prefill run whole on a prompt worker."""
        return await self._embedded(request, "embedding")

    @api.post("/score")
    @api.post("/v1/score")
    async def score(self, request: Request) -> Response:
        """vLLM's: pairs of texts scored by their embeddings' cosine similarity, or a reranker's
        verdict on each (`score_request`)."""
        return await self._embedded(request, "score")

    @api.post("/rerank")
    @api.post("/v1/rerank")
    @api.post("/v2/rerank")
    async def rerank(self, request: Request) -> Response:
        """Jina's and Cohere's (as vLLM serves them): documents ranked against the query as `score`
        scores them (`score_request`)."""
        return await self._embedded(request, "rerank")

    async def _embedded(self, request: Request, kind: str) -> Response:
        """A request answered from its texts' pooled outputs (`pooled_requests`), each text run
        whole on a prompt worker."""
        started = time.monotonic()
        await self._refresh_adapters()
        try:
            prepared = await asyncio.to_thread(prepare_pooled, kind, await request.body(), self.tokenizer,
                                               self.served, self.max_model_len, self.limits, self.hidden_size,
                                               self.score_labels)
        except RequestError as error:
            return error_response(error)
        runs = await self._started_runs("embedding", prepared.prompts, prepared.params)
        if isinstance(runs, Response):
            return runs
        try:
            vectors = await embeddings_of(runs, started, self._observations.add)
        except RequestFailed as error:
            return error_response(error.as_error())
        return await asyncio.to_thread(json_response, prepared.body(vectors))

    @api.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI's Responses API, answered as the chat completion it asks for (`responses_request`),
        after the stored conversation it continues (`previous_response_id`); kept unless `store` is
        false; a `background` one answered in progress at once, or streamed as it runs on whether
        its client stays or not (`stored_responses`)."""
        started = time.monotonic()
        await self._refresh_adapters()
        try:
            ask = await asyncio.to_thread(parse_request, ResponsesRequest, await request.body())
            context = await self._stored.context(ask)
            prepared = await asyncio.to_thread(self._prepare_responses, ask, context)
        except RequestError as error:
            return error_response(error)
        reply = await self._admit("chat", prepared, started)
        if isinstance(reply, Response):
            return reply
        ask, kept = prepared.responses, self._stored.keeps(ask)
        response_id, created = new_id("resp"), int(time.time())
        items = await asyncio.to_thread(input_items, ask) if kept or ask.conversation is not None else []
        turn = items[len(context):] if ask.conversation is not None else None  # its own input, for its conversation
        pending = response_object(ask, response_id, created, "in_progress", [], stored=True) if ask.background \
            else None
        if ask.stream:
            stream = ResponseEvents(ask, response_id, created, kept)
            events = reply.response_events(stream)
            if ask.background:
                events = await self._stored.stream_in_background(pending, items, turn, events, stream, reply.abort)
            elif kept or turn is not None:
                events = self._stored.ending(events, stream, items, turn, kept)
            return StreamingResponse(events, media_type="text/event-stream")
        if ask.background:  # any replica may run it again, from `ask` as JSON, should this one die
            request = await asyncio.to_thread(ask.model_dump, mode="json", by_alias=True, exclude_none=True)
            return JSONResponse(await self._stored.run_in_background(
                pending, items, turn, lambda: self._whole_response(ask, reply, response_id, created, kept),
                reply.abort, request))
        try:
            whole = await self._whole_response(ask, reply, response_id, created, kept)
        except RequestFailed as error:
            return error_response(error.as_error())
        text = await encoded(whole, json_text)  # once, for its client and the store
        await self._stored.end(whole, items, turn, kept, text)
        return text_response(text)

    # ---- one request -------------------------------------------------------------------------
    async def _handle(self, request: Request, kind: str):
        started = time.monotonic()
        await self._refresh_adapters()
        try:
            prepared = await asyncio.to_thread(self._prepare, kind, await request.body())
        except RequestError as error:
            return error_response(error)
        reply = await self._admit(kind, prepared, started)
        if isinstance(reply, Response):
            return reply
        body = prepared.request
        if body.stream:
            options = body.stream_options
            stream = reply.sse(bool(options and options.include_usage), bool(options and options.continuous_usage_stats))
            return StreamingResponse(stream, media_type="text/event-stream")
        return await reply.whole()

    def _prepare(self, kind: str, raw: bytes) -> PreparedRequest:
        return prepare_request(kind, raw, self.tokenizer, self.served, self.max_model_len, self.limits,
                               self._grammar.check, self.config.chat_parsers)

    @staticmethod
    async def _whole_response(ask: ResponsesRequest, reply: ChoicesResponse, response_id: str, created: int,
                              stored: bool) -> dict:
        """The Response of the one choice, once it ends; RequestFailed when it failed. (A method: a
        module function defined after the class was a NameError in the Serve replica.)"""
        [choice] = await reply.choices()
        return response_of_choice(ask, response_id, created, choice, reply.usage, stored)

    async def _run_again(self, pending: dict, rerun: dict) -> dict:
        """A background response whose replica died, run here from the start (`rerun["request"]`:
        its request, the conversation it continued included): the whole response, or RequestFailed,
        a refusal (the cluster full or unavailable) included."""
        ask = await asyncio.to_thread(ResponsesRequest.model_validate, rerun["request"])
        await self._refresh_adapters()
        prepared = await asyncio.to_thread(self._prepare_responses, ask, [])
        reply = await self._admit("chat", prepared, time.monotonic())
        if isinstance(reply, Response):
            raise RequestFailed(f"the replica that ran it died, and running it again was refused: "
                                f"{reply.body.decode(errors='replace')}")
        return await self._whole_response(ask, reply, pending["id"], pending["created_at"], True)

    def _prepare_responses(self, ask: ResponsesRequest, context: list[dict]) -> PreparedRequest:
        """`ask` after the stored conversation it continues, as its chat."""
        return prepare_responses(ask.continuing(context), self.tokenizer, self.served, self.max_model_len, self.limits,
                                 self._grammar.check, self.config.chat_parsers)

    async def _admit(self, kind: str, prepared: PreparedRequest, started: float) -> ChoicesResponse | Response:
        """Every prompt's first choice admitted (or none: the refusal), and the response they make."""
        leaders = await self._started_runs(kind, prepared.prompts, prepared.params)
        if isinstance(leaders, Response):
            return leaders
        return choices_for(kind, prepared.request, leaders, self.tokenizer, started, self._observations.add,
                           parsers=self.config.chat_parsers)

    async def _started_runs(self, kind: str, prompts: list[list[int]], params: list[SamplingParams],
                            again: bool = False) -> list[Run] | Response:
        """A run per prompt, every one admitted, or none: the refusal. Refused because the CLS this
        replica knew is dead: once more, through the one that replaced it."""
        workers = await self._workers()
        self._observations.start(self._cls)
        rid = R.new_request_id(kind)
        leaders = [Run(rid if k == 0 else f"{rid}-p{k}", prompt, p, workers, self.config.scheduler.max_attempts,
                       prefix=self._adapters.prefix)
                   for k, (prompt, p) in enumerate(zip(prompts, params))]
        admitted = 0
        try:
            for run in leaders:
                await run.admit()
                admitted += 1
        except (RequestFailed, Overloaded) as error:
            refused = error
        else:
            refused = None
        finally:
            if admitted < len(leaders):  # every prompt's first choice runs, or none
                for earlier in leaders[:admitted]:
                    await earlier.abort()
        if refused is not None:
            if workers.dead and not again:
                return await self._started_runs(kind, prompts, params, again=True)
            return self._refusal(refused, leaders[admitted])
        return leaders

    def _refusal(self, error: RequestFailed | Overloaded, run: Run) -> Response:
        """A 503 for a request no worker could run, a 429 with Retry-After when the cluster is full,
        a 503 with Retry-After when it has no worker ready or is shutting down."""
        if isinstance(error, RequestFailed):
            self._observations.add(RequestObservation("failed", len(run.prompt), restarts=run.failures,
                                                      refused_placements=run.refusals, lora=run.params.lora,
                                                      kind=kind_of(run.params)))
            return error_response(error.as_error())
        self._observations.add(RequestObservation("rejected", len(run.prompt), refused_placements=run.refusals,
                                                  lora=run.params.lora, kind=kind_of(run.params)))
        retry = self.config.ingress.retry_after_s
        if isinstance(error, ClusterUnavailable):
            refusal = RequestError(f"{error}; retry after {retry} s", status=503, type="service_unavailable")
        else:
            refusal = RequestError(f"the cluster is at capacity ({error}); retry after {retry} s", status=429,
                                   type="rate_limit_exceeded")
        return error_response(refusal, {"Retry-After": str(retry)})

    async def _lora_update(self, request: Request, model_cls, method: str, done: str) -> Response:
        try:
            body = parse_request(model_cls, await request.body())
            try:
                await self._cls.call(method, *body.model_dump().values())
            except RayTaskError as error:
                if isinstance(error.cause, LoraUpdateError):
                    raise error.cause.as_error() from None
                raise
        except RequestError as error:
            return error_response(error)
        await self._refresh_adapters(now=True)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' {done} successfully.")

    async def _tokenizer_call(self, request: Request, model_cls, answer) -> JSONResponse:
        raw = await request.body()
        try:
            return JSONResponse(await asyncio.to_thread(lambda: answer(parse_request(model_cls, raw))))
        except RequestError as error:
            return error_response(error)

    async def _workers(self) -> WorkerDirectory:
        """The CLS actor and its workers' handles; a new directory once a call found that CLS gone
        for good (Serve replaced the controller: a new CLS, which adopts the workers)."""
        if self._directory is not None and self._directory.dead:
            self._cls.forget(self._directory.cls)
        cls = await self._cls.get()
        if self._directory is None or self._directory.cls is not cls:
            self._directory = WorkerDirectory(cls)
        return self._directory
