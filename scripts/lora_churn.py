"""LoRA adapters loaded and unloaded while a soak runs (`soak.py --lora-churn-s`): two adapter
names, each unloaded and loaded again from another of a few directories (other weights) in turn,
while requests name them and the base model. A request under a name between its unload and its
load again is a 404; a load may find every slot still held by the requests of adapters unloaded
before (a 409). At the end, every worker must hold exactly the adapters the cluster serves."""
from __future__ import annotations

import asyncio
import random
import tempfile
from collections import Counter
from pathlib import Path

import httpx

from splitserve.engine.demo import demo_model_config
from splitserve.engine.dummy_adapter import projection_shapes, write_adapter

NAMES = ("soak-a", "soak-b")
ENGINE = {"max_loras": 3, "max_lora_rank": 8}  # two names, and a slot for one's next weights while its old ones drain


class LoraChurn:
    def __init__(self, versions: int = 4):
        config, root = demo_model_config(), Path(tempfile.mkdtemp(prefix="soak-lora-"))
        targets = list(projection_shapes(config))
        self.dirs = [write_adapter(root / f"v{i}", config, targets[:2 + i % 5], 4 + 4 * (i % 2), i, std=0.1)
                     for i in range(versions)]
        self.statuses: Counter = Counter()  # (load | unload, HTTP status)
        self._turn = 0

    def model(self, rng: random.Random) -> str:
        return rng.choice(("demo", *NAMES))

    async def start(self, http: httpx.AsyncClient, url: str) -> None:
        for name, path in zip(NAMES, self.dirs):
            await self._call(http, url, "load", {"lora_name": name, "lora_path": path})

    async def turn(self, http: httpx.AsyncClient, url: str) -> None:
        """One name unloaded, then loaded again from the next directory."""
        name, path = NAMES[self._turn % 2], self.dirs[(self._turn + 2) % len(self.dirs)]
        self._turn += 1
        await self._call(http, url, "unload", {"lora_name": name})
        await asyncio.sleep(0.5)  # requests naming it meanwhile: 404s
        await self._call(http, url, "load", {"lora_name": name, "lora_path": path})

    async def _call(self, http: httpx.AsyncClient, url: str, what: str, body: dict) -> None:
        try:
            response = await http.post(f"{url}/v1/{what}_lora_adapter", json=body, timeout=180)
            self.statuses[f"{what} {response.status_code}"] += 1
        except httpx.HTTPError as error:
            self.statuses[f"{what} {type(error).__name__}"] += 1


def workers_hold_what_is_served(url: str, app: str) -> dict:
    """Each worker's adapters against /v1/models' (the CLS's table, through the ingress)."""
    import ray

    from splitserve.cluster.controller import WORKER_NAMESPACE

    served = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"] if m.get("parent")}
    held = {}
    for worker_id in httpx.get(f"{url}/v1/cluster/status", timeout=30).json()["workers"]:
        actor = ray.get_actor(f"{app}-{worker_id}", namespace=WORKER_NAMESPACE)
        held[worker_id] = sorted(ray.get(actor.lora_adapters.remote(), timeout=30))
    return {"served": sorted(served), "held": held, "consistent": all(set(h) == served for h in held.values())}
