"""A batch API server on one in-process demo engine, for the restart test:
`python -m tests.batch.batch_server DIR PORT` (killed and started again on DIR). `make_app` serves
any service (the expiry tests give it a clock of their own)."""
from __future__ import annotations

import sys
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from splitserve.api.guard import guard
from splitserve.batch.blend.feeder import BlendOptions
from splitserve.batch.engine_executor import EngineExecutor
from splitserve.batch.routes import router
from splitserve.batch.service import BatchService
from splitserve.batch.store import BatchStore
from splitserve.engine.llm_engine import LLMEngine


def make_app(service: BatchService) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        await service.start()
        yield
        await service.stop()

    app = guard(FastAPI(lifespan=lifespan))
    app.include_router(router)
    app.state.batches, app.state.api_key = service, None
    return app


if __name__ == "__main__":
    demo = BatchService(BatchStore(sys.argv[1]), EngineExecutor(LLMEngine("demo"), "demo"),
                        BlendOptions(sample_fraction=0.1))
    uvicorn.run(make_app(demo), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
