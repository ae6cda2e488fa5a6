"""The chart's pods: non-root containers (but the power cap), the network policy, the API key and
Ray auth secrets."""
from __future__ import annotations

from tests.deploy.helm_helpers import (
    containers,
    gpu_limit,
    ids,
    of_kind,
    pod_templates,
    rayservice,
    render,
    the,
    worker_groups,
)

SECURE = {"runAsNonRoot": True, "runAsUser": 1000, "allowPrivilegeEscalation": False,
          "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


@ids
def test_every_container_runs_non_root_but_the_power_cap(preset):
    for name, template in pod_templates(rayservice(preset)).items():
        assert template["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in containers(template):
            if container["name"] == "power-cap":
                continue
            context = container["securityContext"]
            assert {k: context.get(k) for k in SECURE} == SECURE, f"{name}/{container['name']}"
            assert not context.get("privileged")


@ids
def test_power_cap_only_where_the_preset_caps(preset):
    service = rayservice(preset)
    capped = {name: [c for c in template["spec"].get("initContainers", []) if c["name"] == "power-cap"]
              for name, template in pod_templates(service).items()}
    if preset != "values-splitwise-hhcap.yaml":
        assert not any(capped.values())
        return
    assert {name for name, found in capped.items() if found} == {"token"}
    cap = capped["token"][0]
    assert cap["command"] == ["nvidia-smi", "-pl", "350"]
    assert cap["securityContext"] == {"privileged": True, "runAsUser": 0, "runAsNonRoot": False}
    worker = worker_groups(service)["token"]["template"]["spec"]["containers"][0]
    assert gpu_limit(cap) == gpu_limit(worker) == 8  # the whole node, which the cap covers
    assert worker_groups(service)["token"]["template"]["spec"]["nodeSelector"]["splitserve.io/gpu-power"] == "capped"
    assert worker_groups(service)["prompt"]["template"]["spec"]["nodeSelector"]["splitserve.io/gpu-power"] == "full"


def test_network_policy_by_default():
    manifests = render()
    policy = the(manifests, "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for template in pod_templates(the(manifests, "RayService")).values():
        assert selector.items() <= template["metadata"]["labels"].items()
    rules = policy["spec"]["ingress"]
    by_port = {tuple(p["port"] for p in r.get("ports", [])): r.get("from") for r in rules}
    assert by_port[(8000,)] is None  # the OpenAI endpoint: from anywhere
    assert by_port[()] == [{"podSelector": {"matchLabels": selector}}]  # Ray inside the release
    dashboard = [peer for r in rules if [p["port"] for p in r.get("ports", [])] == [8265] for peer in r["from"]]
    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}
    assert dashboard == [{"podSelector": {}}, operator]  # this namespace, and the KubeRay operator
    restricted = the(render(None, "networkPolicy.serveFrom[0].podSelector.matchLabels.role=client"), "NetworkPolicy")
    serve_rule = next(r for r in restricted["spec"]["ingress"] if [p["port"] for p in r.get("ports", [])] == [8000])
    assert serve_rule["from"] == [{"podSelector": {"matchLabels": {"role": "client"}}}]
    assert not of_kind(render(None, "networkPolicy.enabled=false"), "NetworkPolicy")


def test_api_key_secret_reaches_every_ray_container():
    """The ingress, which checks the key, may run on any pod."""
    service = rayservice(None, "apiKeySecret.name=keys")
    env = {"name": "SPLITSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}}}
    for template in pod_templates(service).values():
        assert env in template["spec"]["containers"][0]["env"]
    assert "SPLITSERVE_API_KEY" not in str(rayservice())


def test_ray_auth_secret_is_the_one_kuberay_uses():
    manifests = render()
    auth = the(manifests, "RayService")["spec"]["rayClusterConfig"]["authOptions"]
    secret = the(manifests, "Secret")
    assert auth == {"mode": "token", "secretName": secret["metadata"]["name"]}
    assert len(secret["data"]["auth_token"]) >= 32
    mine = render(None, "rayAuth.existingSecret=mine")
    assert not of_kind(mine, "Secret")
    assert the(mine, "RayService")["spec"]["rayClusterConfig"]["authOptions"]["secretName"] == "mine"
