"""One Ray head node for the whole test run, started as users start one (`ray start --head`),
sized for 2 cores, with up to four splitserve apps: `main` at / (1 prompt + 1 token worker, like
deploy/local-cpu.yaml, with two LoRA adapters of the demo model, `demo_adapters`, and slots for two
more loaded while serving), `pools` at /pools (the same shape with low thresholds, an API key and
two ingress replicas sharing one CLS, for pool moves, backpressure, auth and adapters loaded
through one replica) and `hardening` at /hardening (short leases and stuck bound, small request
bounds, for the failure tests) and `tp` at /tp (a prompt worker of 2 tensor-parallel ranks
handing to a token worker of 1 that drafts tokens by n-gram lookup, with the adapters too). Its
dashboard takes `ray job submit`. A pytest plugin (tests/conftest.py): only tests that ask for
these fixtures start it, and their modules run last; the session ends by stopping that cluster's
processes."""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

# Ray >= 2.59 heads require their token (~/.ray/auth_token) from drivers and the job CLI; Ray reads
# this when it is imported, so it is set before any test module imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")

ENGINE = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 2048}
RUN_TIME_LORA = {"max_loras": 4, "max_lora_rank": 8}  # tp: two adapters at start, two more slots; pools
SWAPPED_LORA = {"max_loras": 1, "max_cpu_loras": 4, "max_lora_rank": 8}  # main: its adapters take one slot in turns
MAIN = {"engine": ENGINE, "transfer": {"backend": "gloo", "timeout_s": 10}, "fault_injection": True,
        "scheduler": {"report_interval_s": 0.05}, "batch": {"dir": tempfile.mkdtemp(prefix="splitserve-batches-")}}
POOLS = {"engine": {**ENGINE, **RUN_TIME_LORA, "scheduling_policy": "priority"},
         "transfer": {"backend": "gloo", "timeout_s": 10},
         "served_model_name": ["demo", "pools-alias"],
         "reasoning_parser": "qwen3", "tool_call_parser": "hermes",
         "scheduler": {"report_interval_s": 0.05, "mixed_prompt_tokens": 600, "max_queue_tokens": 3000,
                       "max_decode_queue_tokens": 3000},
         "ingress": {"api_key": "sk-pools", "num_replicas": 2},
         "batch": {"dir": tempfile.mkdtemp(prefix="splitserve-batches-")}}
POOLS_KEY = {"Authorization": "Bearer sk-pools"}
HARDENING = {"engine": ENGINE, "transfer": {"backend": "gloo", "timeout_s": 30, "lease_s": 3},
             "scheduler": {"report_interval_s": 0.05, "stuck_step_s": 3, "drain_timeout_s": 20},
             "ingress": {"max_request_bytes": 65536, "max_prompt_chars": 20000, "max_stop_strings": 4,
                         "max_stop_string_chars": 32, "max_stop_token_ids": 8, "max_chat_messages": 8,
                         "max_prompts": 4, "max_upload_bytes": 65536, "max_batch_lines": 5},
             "fault_injection": True, "batch": {"dir": tempfile.mkdtemp(prefix="splitserve-batches-")}}

SPECULATION = {"num_speculative_tokens": 3}  # tp: its token worker drafts by n-gram lookup
TINY = {"num_cpus": 0.01}  # this app's ranks take the 7th CPU the head is told of (the others' workers take 6)
TP = {"engine": ENGINE, "transfer": {"backend": "gloo", "timeout_s": 10}, "scheduler": {"report_interval_s": 0.05},
      "score_label_tokens": ["n", "y"],  # /score and /rerank as a reranker answering in tokens (the demo's bytes)
      "pools": [{"role": "prompt", "tensor_parallel_size": 2, "resources": TINY},
                {"role": "token", "resources": TINY}], "batch": {"dir": tempfile.mkdtemp(prefix="splitserve-batches-")}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def head_node():
    """(GCS address, dashboard URL) of a local head node; this process joins it as a driver."""
    ray = pytest.importorskip("ray")
    gcs, dashboard = _free_port(), _free_port()
    # a token for the head to require, as `ray start` on a fresh machine does not make one itself
    subprocess.run(["ray", "get-auth-token", "--generate"], check=True, capture_output=True, timeout=60)
    temp_dir = tempfile.mkdtemp(prefix="ssray-")  # marks this cluster's processes (short: socket paths)
    # every port of its own, so another Ray on the machine (a developer's) cannot take one first
    ports = [f"--{name}={_free_port()}" for name in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                     "runtime-env-agent-port", "metrics-export-port",
                                                     "ray-client-server-port")]
    subprocess.run(["ray", "start", "--head", "--port", str(gcs), "--dashboard-port", str(dashboard),
                    "--dashboard-host", "127.0.0.1", "--num-cpus", "7", "--disable-usage-stats",
                    "--temp-dir", temp_dir, *ports], check=True, capture_output=True, timeout=180)
    ray.init(address=f"127.0.0.1:{gcs}", log_to_driver=False)
    yield f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}"
    ray.shutdown()
    _stop_processes_of(temp_dir, gcs)  # not `ray stop`: that stops every Ray cluster on the machine


def _stop_processes_of(temp_dir: str, gcs_port: int, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, this cluster's processes: those whose command line names its temp dir
    or its GCS port (the client server), and their descendants (the agents, whose command lines
    Ray rewrites), found while their parents are still alive."""
    marks = (temp_dir.encode(), f":{gcs_port}".encode())

    def members() -> set[int]:
        parents, found = {}, set()
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                cmdline = (proc / "cmdline").read_bytes()
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if any(mark in cmdline for mark in marks):
                found.add(int(proc.name))
        grown = True
        while grown:
            children = {pid for pid, parent in parents.items() if parent in found} - found
            found |= children
            grown = bool(children)
        return found

    everyone = members()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in everyone | members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while _alive(everyone) and time.monotonic() < deadline:
            time.sleep(0.2)
    if os.environ.get("SPLITSERVE_KEEP_RAY_LOGS"):  # debugging a failed run: its logs stay in temp_dir
        print(f"Ray logs kept in {temp_dir}/session_latest/logs")
    else:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _alive(pids: set[int]) -> bool:
    return any(Path(f"/proc/{pid}").exists() for pid in pids)


@pytest.fixture(scope="session")
def ray_cluster(head_node):
    """Base URL of Serve's HTTP proxy on the head node."""
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def server(ray_cluster):
    """Base URL of the main app, ready to serve."""
    from ray import serve

    from splitserve.cluster.app import build_app
    from splitserve.cluster.launcher import wait_until_healthy

    serve.run(build_app({**MAIN, "engine": {**ENGINE, **SWAPPED_LORA, "lora_modules": demo_adapters()}}), name="main",
              route_prefix="/", blocking=False)
    wait_until_healthy(ray_cluster, timeout=180)
    return ray_cluster


def _deploy(base_url: str, name: str, config: dict) -> str:
    """Another app of the test cluster at /<name>, ready to serve; its base URL."""
    from ray import serve

    from splitserve.cluster.app import build_app
    from splitserve.cluster.launcher import wait_until_healthy

    serve.run(build_app(config), name=name, route_prefix=f"/{name}", blocking=False)
    wait_until_healthy(f"{base_url}/{name}", timeout=180)
    return f"{base_url}/{name}"


@pytest.fixture(scope="session")
def pools_server(ray_cluster, server):
    return _deploy(ray_cluster, "pools", POOLS)


@pytest.fixture(scope="session")
def hardening_server(ray_cluster, server):
    return _deploy(ray_cluster, "hardening", HARDENING)


@pytest.fixture(scope="session")
def tp_server(ray_cluster, server):
    return _deploy(ray_cluster, "tp", {**TP, "engine": {**ENGINE, **RUN_TIME_LORA, **SPECULATION,
                                                        "lora_modules": demo_adapters()}})


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def offline():
    """The offline engine the cluster's greedy output must equal (the main app's adapters too)."""
    from splitserve import LLM

    return LLM("demo", lora_modules=demo_adapters(), **ENGINE)


@functools.cache
def demo_adapters() -> dict[str, str]:
    """Two LoRA adapters of the demo model, name: directory: one of attention's projections, one of
    every dense projection."""
    from splitserve.engine.demo import demo_model_config
    from splitserve.engine.dummy_adapter import projection_shapes, write_adapter

    root, config = Path(tempfile.mkdtemp(prefix="splitserve-lora-")), demo_model_config()
    return {"demo-sql": write_adapter(root / "sql", config, ["q_proj", "v_proj", "o_proj"], 8, 1, std=0.1),
            "demo-chat": write_adapter(root / "chat", config, list(projection_shapes(config)), 4, 2, std=0.1)}


def worker_actor(app: str, worker_id: str):
    import ray

    from splitserve.cluster.controller import WORKER_NAMESPACE

    return ray.get_actor(f"{app}-{worker_id}", namespace=WORKER_NAMESPACE)


def count_reserves(actor) -> None:
    """Run in a token worker's actor: its loop counts the KV reservations it is asked for (`actor.reserves`)."""
    reserve, actor.reserves = actor.loop.reserve, 0

    def counted(*args, **kwargs):
        actor.reserves += 1
        return reserve(*args, **kwargs)
    actor.loop.reserve = counted
