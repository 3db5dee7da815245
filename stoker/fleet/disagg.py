"""A disaggregated deployment as Kubernetes objects: prefill and decode servers plus a router. [no torch]

A deployment with `prefill_replicas: P` (and `replicas: D`) becomes
- one LeaderWorkerSet per role, `<name>-prefill` (P replicas) and `<name>-decode` (D replicas),
  each replica a group of one pod per node it spans (size 1 on one node), running
  `stoker serve ... --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'`
  (vLLM's setup for NIXL: both roles load the same connector, the request decides who sends);
- a Deployment `<name>-router` running `stoker router --prefill URL... --decode URL...`, and the
  Service `<name>` in front of it, so clients use the same name as for an aggregated deployment.
Why LeaderWorkerSets even for one-node replicas: the router addresses every server by name, and
an LWS gives each replica's leader a stable one: the pod `<lws>-<i>` under the headless Service
`<lws>` that the LWS controller creates (subdomainPolicy Shared), i.e. `<lws>-<i>.<lws>`, known
when the plan is written. A Deployment's pods have random names behind one Service IP, which
would hide the replicas from the router's load- and prefix-aware choice.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from stoker.fleet.manifests import deployment_objects
from stoker.fleet.plan import ReplicaPlan
from stoker.fleet.spec import DeploymentSpec

KV_TRANSFER_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, separators=(",", ":"))
ROLES = ("prefill", "decode")


def role_of(dep: DeploymentSpec, index: int) -> str:
    """Replica indices 0..replicas-1 are decode servers, the next prefill_replicas prefill servers."""
    return "decode" if index < dep.replicas else "prefill"


def _as_leaderworkerset(deployment: dict[str, Any]) -> dict[str, Any]:
    """A one-node Deployment as a LeaderWorkerSet of groups of one pod (the leader)."""
    template = deployment["spec"]["template"]
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": deployment["metadata"],
        "spec": {
            "replicas": deployment["spec"]["replicas"],
            "leaderWorkerTemplate": {"size": 1, "restartPolicy": "RecreateGroupOnPodRestart",
                                     "leaderTemplate": template},
        },
    }


def leader_urls(lws: dict[str, Any], port: int) -> list[str]:
    name = lws["metadata"]["name"]
    return [f"http://{name}-{i}.{name}:{port}" for i in range(lws["spec"]["replicas"])]


def router_objects(dep: DeploymentSpec, urls: dict[str, list[str]]) -> list[dict[str, Any]]:
    """The router's Deployment and the deployment's client-facing Service."""
    labels = {"app.kubernetes.io/name": dep.name, "app.kubernetes.io/part-of": "stoker",
              "app.kubernetes.io/component": "router"}
    args = ["--host", "0.0.0.0", "--port", str(dep.port)]
    if urls["prefill"]:
        args += ["--prefill", *urls["prefill"]]
    args += ["--decode", *urls["decode"]]  # without prefill servers placed: a balancer over the decode pool
    probe = {"httpGet": {"path": "/health", "port": dep.port}, "periodSeconds": 5, "failureThreshold": 3}
    container = {
        "name": "router",
        "image": dep.image,
        "command": ["stoker", "router"],
        "args": args,
        "ports": [{"name": "http", "containerPort": dep.port}],
        # No GPU: the router relays bytes (one to two and a half milliseconds of CPU per request
        # on a loaded core, docs/benchmarks.md, Router).
        "resources": {"requests": {"cpu": "1", "memory": "512Mi"}},
        "readinessProbe": probe,
        "livenessProbe": {**probe, "periodSeconds": 10},
    }
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": f"{dep.name}-router", "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": dep.name, "labels": labels},
         "spec": {"selector": labels,
                  "ports": [{"name": "http", "port": dep.port, "targetPort": dep.port, "protocol": "TCP"}]}},
    ]


def disaggregated_objects(dep: DeploymentSpec, replicas: list[ReplicaPlan]) -> list[dict[str, Any]]:
    """LeaderWorkerSets for the placed prefill and decode replicas, then the router and its Service."""
    objects: list[dict[str, Any]] = []
    urls: dict[str, list[str]] = {role: [] for role in ROLES}
    for role in ROLES:
        members = [r for r in replicas if role_of(dep, r.index) == role]
        if not members:
            continue
        role_dep = replace(dep, name=f"{dep.name}-{role}", prefill_replicas=0,
                           extra_args=(*dep.extra_args, "--kv-transfer-config", KV_TRANSFER_CONFIG))
        for obj in deployment_objects(role_dep, members):
            if obj["kind"] == "Service":  # the router addresses each leader itself
                continue
            lws = _as_leaderworkerset(obj) if obj["kind"] == "Deployment" else obj
            lws["metadata"] = {**lws["metadata"],
                               "labels": {**lws["metadata"]["labels"], "app.kubernetes.io/component": role}}
            lws["spec"]["networkConfig"] = {"subdomainPolicy": "Shared"}
            urls[role] += leader_urls(lws, dep.port)
            objects.append(lws)
    if urls["decode"]:
        objects += router_objects(dep, urls)
    return objects

