"""The batch API in a Ray cluster: one actor (owned by the controller deployment, so it lives and
restarts with it, and restarted by Ray after a crash of its own) holds the store and runs batches
through the cluster; every ingress replica reaches it through `RemoteBatches`. A restarted actor
resumes the active batches on disk once started."""
from __future__ import annotations

import inspect

from splitserve.api.errors import RequestError
from splitserve.api.lazy_grammar import LazyGrammar
from splitserve.batch.blend.cost import ModelShape
from splitserve.batch.lines import LineRules
from splitserve.batch.service import BatchService
from splitserve.batch.store import BatchStore, NotFound
from splitserve.cluster.batch_executor import ClusterExecutor
from splitserve.cluster.owned_actor import OwnedActor
from splitserve.cluster.served_adapters import ServedAdapters
from splitserve.config import ClusterConfig
from splitserve.engine.model_builder import load_metadata
from splitserve.engine.prefix_hash import PrefixNaming


class BatchManager:
    def __init__(self, config: dict, cls):
        config = ClusterConfig.model_validate(config)
        engine = config.engine.engine_config("token")
        model_config, tokenizer, max_model_len = load_metadata(config.model, engine)
        limits = config.request_limits()
        adapters = ServedAdapters(config, PrefixNaming(config.prefix_block_size(), model_config.long_rope_from))
        grammar = LazyGrammar(tokenizer, model_config.vocab_size)  # structured output's constraints compile up front
        rules = LineRules(tokenizer, adapters.served, max_model_len, model_config.hidden_size, limits, grammar.check,
                          config.chat_parsers, config.batch.priority, config.score_labels(tokenizer))
        executor = ClusterExecutor(cls, ModelShape.of(model_config), rules, engine.block_size,
                                   config.scheduler.max_attempts, prefix=adapters.prefix, adapters=adapters)
        self.service = BatchService(BatchStore(config.batch.dir), executor, config.batch.blend_options(),
                                    limits.max_batch_lines, config.batch.min_free_bytes, config.batch.file_expiry_s)
        self._started = False

    async def start(self) -> None:
        """Run the batch service; idempotent (the controller calls it at every health check, so an
        actor Ray restarted starts again and resumes its active batches)."""
        if not self._started:
            self._started = True
            await self.service.start()

    async def call(self, method: str, *args) -> tuple:
        """("ok", result) or ("error", status, message, param, code, type): errors cross Ray as data."""
        try:
            result = getattr(self.service, method)(*args)
            return "ok", await result if inspect.isawaitable(result) else result
        except RequestError as raised:
            error = raised
        except NotFound as missing:
            error = RequestError(missing.message, status=404, param="id")
        return "error", error.status, error.message, error.param, error.code, error.type


class RemoteBatches:
    """The service's interface for the routes, each call forwarded to the manager actor."""

    def __init__(self, manager: OwnedActor):
        self._manager = manager

    def __getattr__(self, method: str):
        async def call(*args):
            outcome = await self._manager.call("call", method, *args)
            if outcome[0] == "error":
                _, status, message, param, code, kind = outcome
                raise RequestError(message, status=status, param=param, type=kind, code=code)
            return outcome[1]

        return call
