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


def test_other_ranks_and_groups_whose_rank_0_is_gone_are_stopped_and_no_others(monkeypatch):
    from splitserve.cluster import worker_group

    named = ["app-prompt-0.2", "app-prompt-0.2-tp1", "app-prompt-0.1-tp1", "app-prompt-0.1-tp2",
             "other-prompt-0.1-tp1", "app-controller"]
    groups = {"a": {"name": "app-prompt-0.2-ranks", "state": "CREATED"},
              "b": {"name": "app-prompt-0.1-ranks", "state": "CREATED"},
              "c": {"name": "app-token-0.0-ranks", "state": "REMOVED"}}
    killed, removed = [], []
    monkeypatch.setattr(ray.util, "list_named_actors",
                        lambda all_namespaces: [{"name": n, "namespace": "splitserve"} for n in named])
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace: f"handle of {name}")
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append(actor))
    monkeypatch.setattr(worker_group, "placement_group_table", lambda: groups)
    monkeypatch.setattr(worker_group, "get_placement_group", lambda name: f"group {name}")
    monkeypatch.setattr(worker_group, "remove_placement_group", removed.append)
    stopped = worker_group.stop_strays("app")
    assert sorted(stopped) == ["app-prompt-0.1-ranks", "app-prompt-0.1-tp1", "app-prompt-0.1-tp2"]
    assert sorted(killed) == ["handle of app-prompt-0.1-tp1", "handle of app-prompt-0.1-tp2"]
    assert removed == ["group app-prompt-0.1-ranks"]
