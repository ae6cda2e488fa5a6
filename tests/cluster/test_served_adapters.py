"""An ingress replica's view of the adapters served: what the CLS's table says, asked again at most
every REFRESH_S, the base model's names kept, the prefix naming following each adapter's identity;
a CLS that does not answer leaves the view as it was; a cluster without run-time adapters never asks."""
import asyncio

from splitserve.api.errors import RequestError
from splitserve.cluster.served_adapters import ServedAdapters
from splitserve.config import ClusterConfig
from splitserve.engine.prefix_hash import PrefixNaming


def _view(max_loras: int = 2) -> ServedAdapters:
    config = ClusterConfig.model_validate({"engine": {"max_loras": max_loras, "lora_modules": {"a": "/adapters/a"}}})
    return ServedAdapters(config, PrefixNaming(16))


def _table(identities: dict, asked: list):
    async def table():
        asked.append(1)
        if isinstance(identities, Exception):
            raise identities
        return identities
    return table


def test_the_view_follows_the_table_and_the_prefix_naming_its_identities():
    view, asked = _view(), []
    assert view.served.adapters == ("a",) and view.prefix.lora_identities == (("a", "a"),)
    asyncio.run(view.refresh(_table({}, asked)))  # every adapter unloaded, the ones loaded at start too
    assert view.served.adapters == () and view.served.names == ("demo",) and view.prefix.lora_identities == ()
    asyncio.run(view.refresh(_table({"b": "b\0digest"}, asked)))  # within REFRESH_S: not asked
    assert view.served.adapters == () and len(asked) == 1
    asyncio.run(view.refresh(_table({"b": "b\0digest"}, asked), now=True))
    assert view.served.adapters == ("b",) and view.prefix.hashes(list(range(40)), 4, "b") != \
        PrefixNaming(16).hashes(list(range(40)), 4, "b")  # named from its identity, not its name
    asyncio.run(view.refresh(_table(RequestError("restarting", status=503), asked), now=True))
    assert view.served.adapters == ("b",)


def test_a_cluster_without_run_time_adapters_never_asks():
    view, asked = _view(max_loras=0), []
    asyncio.run(view.refresh(_table({}, asked), now=True))
    assert asked == [] and view.served.adapters == ("a",)
