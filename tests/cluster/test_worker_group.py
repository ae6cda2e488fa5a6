"""Workers are found again by the names they were started under: an app's rank 0s only (not its
other ranks, its controller or store, or another app's workers), oldest incarnation first."""
from __future__ import annotations

import ray
import pytest

from splitserve.cluster.worker_group import NamedWorker, find_workers, group_name, parse_worker, shard_name


@pytest.mark.parametrize("name, found", [
    ("app-prompt-0.3", NamedWorker("app-prompt-0.3", "prompt-0.3", "prompt", 0, 3)),
    ("app-mixed-12.140", NamedWorker("app-mixed-12.140", "mixed-12.140", "mixed", 12, 140)),
    ("app-token-1.7-tp1", None),  # another rank
    ("app-controller", None), ("app-rendezvous", None), ("app-prompt-0.3-ranks", None),
    ("app2-prompt-0.3", None), ("ap-prompt-0.3", None), ("app-decode-0.3", None), ("app-prompt-0", None),
])
def test_parse_worker(name, found):
    assert parse_worker("app", name) == found


def test_names_of_the_other_ranks_and_the_group_follow_rank_0():
    assert shard_name("app-prompt-0.3", 2) == "app-prompt-0.3-tp2"
    assert group_name("app-prompt-0.3") == "app-prompt-0.3-ranks"
    assert parse_worker("app", shard_name("app-prompt-0.3", 2)) is None


def test_find_workers_lists_an_apps_workers_in_the_worker_namespace_oldest_first(monkeypatch):
    named = [{"name": "app-token-1.9", "namespace": "splitserve"}, {"name": "app-prompt-0.2", "namespace": "splitserve"},
             {"name": "app-prompt-0.4", "namespace": "other"}, {"name": "app-token-1.9-tp1", "namespace": "splitserve"},
             {"name": "SERVE_CONTROLLER_ACTOR", "namespace": "serve"}]
    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces: named if all_namespaces else [])
    assert [w.worker_id for w in find_workers("app")] == ["prompt-0.2", "token-1.9"]
