"""ApiGuard, in front of a small FastAPI app (no Ray): the key on every route but /health and
/metrics, compared whole; body bounds declared or streamed; the app's mount prefix (Serve's
route_prefix arrives as root_path) does not change which routes are open; a route's own failure
is a 500 in OpenAI's shape (a RequestError it raises, that error), which the `openai` client raises with its message; FastAPI's own
refusals (a query value that does not parse, an unknown route, a wrong method) are OpenAI's too."""
import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from splitserve.api.errors import RequestError
from splitserve.api.guard import guard
from splitserve.api.limits import RequestLimits


def make_app(key: str | None, root_path: str = "") -> TestClient:
    app = guard(FastAPI())
    app.state.api_key, app.state.limits = key, RequestLimits(max_request_bytes=1024, max_upload_bytes=4096)

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return {"size": len(await request.body())}

    @app.post("/v1/files")
    async def files(request: Request):
        return {"size": len(await request.body())}

    @app.get("/v1/models")
    async def broken():
        raise OSError("No space left on device")

    @app.get("/v1/cluster/status")
    async def restarting():
        raise RequestError("the cluster controller (CLS) is restarting; retry shortly", status=503,
                           type="service_unavailable")

    @app.get("/v1/items")
    async def items(limit: int = 20, ascending: bool = False):
        return {"limit": limit, "ascending": ascending}

    @app.get("/v1/stream")
    async def stream():
        async def chunks():
            yield b"data: 1\n\n"
            raise OSError("gone mid-stream")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return TestClient(app, root_path=root_path, raise_server_exceptions=False)


@pytest.mark.parametrize("root_path", ["", "/pools"])
def test_the_key_is_required_everywhere_but_the_open_routes(root_path):
    """ASGI paths include the mount prefix (root_path), as Serve sends them."""
    client = make_app("sk-1", root_path)
    assert client.get(f"{root_path}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer sk-2"}, {"Authorization": "Bearer sk-1 "}, {"Authorization": "sk-1"}):
        denied = client.post(f"{root_path}/v1/completions", content=b"{}", headers=headers)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    allowed = client.post(f"{root_path}/v1/completions", content=b"{}", headers={"Authorization": "Bearer sk-1"})
    assert allowed.json() == {"size": 2}
    assert client.get(f"{root_path}/nowhere").status_code == 401  # unknown routes too: nothing is learnt without the key


def test_no_key_configured_lets_everything_through():
    assert make_app(None).post("/v1/completions", content=b"x").json() == {"size": 1}


def test_bodies_over_their_bound_are_413_declared_or_streamed():
    client = make_app(None)
    assert client.post("/v1/completions", content=b"x" * 1024).status_code == 200
    declared = client.post("/v1/completions", content=b"x" * 1025)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"
    streamed = client.post("/v1/completions", content=iter([b"x" * 600, b"x" * 600]))
    assert streamed.status_code == 413
    assert client.post("/v1/files", content=b"x" * 4096).status_code == 200  # uploads have their own bound
    assert client.post("/v1/files", content=b"x" * 4097).status_code == 413


def test_a_route_that_raises_is_a_500_in_openais_shape_and_a_started_stream_just_ends():
    client = make_app(None)
    failed = client.get("/v1/models")
    assert failed.status_code == 500 and failed.headers["content-type"] == "application/json"
    assert failed.json()["error"]["type"] == "server_error" and "OSError" in failed.json()["error"]["message"]
    transport = httpx.MockTransport(lambda request: httpx.Response(500, json=failed.json()))
    with pytest.raises(openai.InternalServerError, match="the server failed on this request"):
        openai.OpenAI(api_key="x", base_url="http://test/v1", max_retries=0,
                      http_client=httpx.Client(transport=transport)).models.list()
    cut = client.get("/v1/stream")  # started: the stream ends where it failed, no second response
    assert (cut.status_code, cut.text) == (200, "data: 1\n\n")


def test_a_request_error_a_route_raises_is_its_own_answer():
    answer = make_app(None).get("/v1/cluster/status")
    assert answer.status_code == 503
    assert answer.json()["error"] == {"message": "the cluster controller (CLS) is restarting; retry shortly",
                                      "type": "service_unavailable", "param": None, "code": None}


def test_fastapis_own_refusals_are_openais_errors_naming_the_field():
    client = make_app(None)
    assert client.get("/v1/items?limit=5&ascending=true").json() == {"limit": 5, "ascending": True}
    for query, param in (("limit=ten", "limit"), ("limit=5&ascending=maybe", "ascending")):
        refused = client.get(f"/v1/items?{query}")
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == param
        assert error["type"] == "invalid_request_error" and param in error["message"]
    api = openai.OpenAI(api_key="x", base_url="http://testserver/v1", max_retries=0, http_client=client)
    with pytest.raises(openai.BadRequestError) as bad:
        api.get("/items", options={"params": {"limit": "ten"}}, cast_to=object)
    assert bad.value.param == "limit"
    with pytest.raises(openai.NotFoundError, match="GET /v1/nowhere"):
        api.get("/nowhere", cast_to=object)
    wrong = client.delete("/v1/items")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET" and "DELETE" in wrong.json()["error"]["message"]
