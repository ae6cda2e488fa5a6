"""ApiGuard, in front of a small FastAPI app (no Ray): the key on every route but /health and
/metrics, compared whole; body bounds declared or streamed; the app's mount prefix (Serve's
route_prefix arrives as root_path) does not change which routes are open."""
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from splitserve.api.guard import ApiGuard
from splitserve.api.limits import RequestLimits


def make_app(key: str | None, root_path: str = "") -> TestClient:
    app = FastAPI()
    app.add_middleware(ApiGuard)
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

    return TestClient(app, root_path=root_path)


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
