"""The load generator's request body: what a workload's request asks of the server (its length,
forced output, a priority where it has one, its LoRA adapter as its model), through a transport
that keeps what was sent."""
import asyncio
import json

import httpx

from splitserve.bench.client import send
from splitserve.bench.workload import RequestSpec


def sent_body(spec: RequestSpec) -> dict:
    """What `send` posted for `spec` (the server refuses it); its record keeps the spec's priority."""
    bodies = []

    def keep(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(429, json={"error": {"message": "busy", "type": "rate_limit_error"}})

    async def one():
        async with httpx.AsyncClient(transport=httpx.MockTransport(keep)) as http:
            return await send(http, "http://test", "demo", spec, seed=0, t0=0.0)

    record = asyncio.run(one())
    assert record.rejected and record.priority == spec.priority
    return bodies[0]


def test_a_request_sends_its_length_and_a_priority_only_where_it_has_one():
    plain = sent_body(RequestSpec(0, 0.0, 12, 5))
    assert len(plain["prompt"]) == 12 and plain["max_tokens"] == 5 and plain["ignore_eos"]
    assert "priority" not in plain
    assert sent_body(RequestSpec(1, 0.0, 12, 5, priority=1))["priority"] == 1


def test_a_request_under_an_adapter_names_it_as_its_model():
    assert sent_body(RequestSpec(0, 0.0, 12, 5))["model"] == "demo"
    assert sent_body(RequestSpec(0, 0.0, 12, 5, adapter="sql-lora"))["model"] == "sql-lora"
