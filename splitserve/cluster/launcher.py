"""`splitserve serve`: start (or join) Ray, deploy the app, wait until it can serve, print the URL,
and on Ctrl-C / SIGTERM tear down what it started."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import ray
from ray import serve

from splitserve.cluster.app import build_app
from splitserve.config import ClusterConfig

APP_NAME = "splitserve"


def wait_until_healthy(url: str, timeout: float) -> dict:
    """Poll GET /health until it answers 200; returns its body. Raises TimeoutError."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            last = f"HTTP {error.code}"
        except OSError as error:
            last = str(error)
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout:.0f} s (last: {last})")


def deploy(config: ClusterConfig, host: str, port: int, address: str | None, timeout: float = 600,
           on_sigterm: Callable | None = None) -> str:
    """Start or join Ray, run the app; returns the base URL once /health is 200. `on_sigterm`
    handles SIGTERM from the moment Ray is up (ray.init installs a handler of its own that aborts)."""
    # "local": a fresh cluster even where `ray start` left one running (ray.init would join it)
    ray.init(address=address or "local", ignore_reinit_error=True, log_to_driver=False)
    if on_sigterm is not None:
        signal.signal(signal.SIGTERM, on_sigterm)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(config.model_dump()), name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    wait_until_healthy(url, timeout)
    return url


def teardown(joined: bool) -> None:
    """Remove the app; stop Serve and Ray only if this process started them."""
    serve.delete(APP_NAME)
    if not joined:
        serve.shutdown()
    ray.shutdown()


class _Stop:
    """The SIGINT and SIGTERM handler: the first signal stops the server (KeyboardInterrupt, even
    while it is still deploying); any later one only says so, so the teardown always runs to its end
    (a second Ctrl-C, or a supervisor that signals the whole process group, cannot cut it short)."""

    def __init__(self):
        self.stopping = False

    def __call__(self, *_) -> None:
        if self.stopping:
            os.write(1, b"splitserve: still shutting down\n")  # print is not safe in a handler (reentrancy)
            return
        self.stopping = True  # before raising: a signal from here on finds it set
        raise KeyboardInterrupt


def serve_until_interrupted(config: ClusterConfig, host: str, port: int, address: str | None) -> None:
    stop = _Stop()
    signal.signal(signal.SIGINT, stop)
    try:
        url = deploy(config, host, port, address, on_sigterm=stop)
        pools = ", ".join(f"{p.num_workers} {p.role} ({p.hardware})" for p in config.pools)
        print(f"splitserve: serving model {config.model_name!r} at {url}/v1  [{pools}]", flush=True)
        print("splitserve: press Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop.stopping = True  # set already unless deploying failed
        print("splitserve: shutting down", flush=True)
        teardown(joined=address is not None)
