"""A fresh Ray on this machine, for the benchmark scripts that size their own: `address="local"`,
because with no address `ray.init` joins a cluster that `ray start` left running (the README's
`ray job submit` set-up) and refuses `num_cpus` there. No dashboard, and the workers' logs stay in
Ray's files (a script's output is its report)."""
from __future__ import annotations

import ray
from ray import serve


def start_ray(num_cpus: int, **options) -> None:
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **options)


def start_serve(num_cpus: int, port: int, **options) -> None:
    """`start_ray`, then Serve's HTTP proxy on 127.0.0.1:`port`."""
    start_ray(num_cpus, **options)
    serve.start(http_options={"host": "127.0.0.1", "port": port})


def serve_cluster(config: dict, name: str, port: int, num_cpus: int = 4) -> str:
    """`start_serve`, then a splitserve app of `config` at /`name`: its base URL, once healthy."""
    from splitserve.cluster.app import build_app
    from splitserve.cluster.launcher import wait_until_healthy

    start_serve(num_cpus, port)
    serve.run(build_app(config), name=name, route_prefix=f"/{name}", blocking=False)
    url = f"http://127.0.0.1:{port}/{name}"
    wait_until_healthy(url, timeout=300)
    return url
