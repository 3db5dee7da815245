"""`stoker fleet plan` for a disaggregated deployment: a LeaderWorkerSet per role with the NIXL
kv-transfer-config, and a router Deployment + Service whose arguments name every leader."""

from __future__ import annotations

import json

import pytest
import yaml
from kubernetes.client import ApiClient

from stoker.cli import build_parser
from stoker.fleet.render import render_files
from stoker.fleet.plan import plan_fleet
from stoker.fleet.report import render_report
from stoker.fleet.spec import parse_deployments, parse_fleet
from stoker.router.cli import config_from_args

FLEET = {"nodes": [{"name": "n1", "gpu": "H100", "count": 8}, {"name": "n2", "gpu": "H100", "count": 8}]}


def _docs(deployments: dict, fleet: dict = FLEET) -> list[dict]:
    plan = plan_fleet(parse_fleet(fleet), parse_deployments(deployments))
    assert not plan.unplaced
    files = render_files(plan, render_report(plan))
    return list(yaml.safe_load_all(files["k8s/chat.yaml"]))


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return _docs({"deployments": [{"name": "chat", "model": "meta-llama/Llama-3.1-8B-Instruct", "preset": "llama-3-8b",
                                   "replicas": 3, "prefill_replicas": 2, "max_model_len": 8192}]})


def _by_name(docs: list[dict]) -> dict[str, dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_one_leaderworkerset_per_role_and_the_router(docs):
    objs = _by_name(docs)
    assert set(objs) == {("LeaderWorkerSet", "chat-prefill"), ("LeaderWorkerSet", "chat-decode"),
                         ("Deployment", "chat-router"), ("Service", "chat")}
    assert objs["LeaderWorkerSet", "chat-prefill"]["spec"]["replicas"] == 2
    assert objs["LeaderWorkerSet", "chat-decode"]["spec"]["replicas"] == 3
    for role in ("prefill", "decode"):
        lws = objs["LeaderWorkerSet", f"chat-{role}"]
        assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "Shared"}
        tmpl = lws["spec"]["leaderWorkerTemplate"]
        assert tmpl["size"] == 1
        (c,) = tmpl["leaderTemplate"]["spec"]["containers"]
        assert c["command"] == ["stoker", "serve"]
        i = c["args"].index("--kv-transfer-config")
        assert json.loads(c["args"][i + 1]) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        (resource,) = c["resources"]["limits"]  # a whole GPU or a MIG slice, as the plan placed it
        assert resource.startswith("nvidia.com/") and c["resources"]["requests"] == c["resources"]["limits"]
        assert tmpl["leaderTemplate"]["metadata"]["labels"]["app.kubernetes.io/name"] == f"chat-{role}"
        _k8s_parse(tmpl["leaderTemplate"], "V1PodTemplateSpec")  # the pod template is a valid one
    # The client-facing Service selects only the router's pods.
    svc, router = objs["Service", "chat"], objs["Deployment", "chat-router"]
    assert svc["spec"]["selector"] == router["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    _k8s_parse(router, "V1Deployment")
    _k8s_parse(svc, "V1Service")


def _k8s_parse(data: dict, kind: str):
    return ApiClient()._ApiClient__deserialize(data, kind)


def test_router_args_name_every_leader_and_parse_as_the_router_cli(docs):
    (c,) = _by_name(docs)["Deployment", "chat-router"]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["stoker", "router"]
    args = build_parser().parse_args(["router", *c["args"]])
    cfg = config_from_args(args)
    assert cfg.disaggregated
    assert cfg.prefill == tuple(f"http://chat-prefill-{i}.chat-prefill:8000" for i in range(2))
    assert cfg.decode == tuple(f"http://chat-decode-{i}.chat-decode:8000" for i in range(3))
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_multi_node_replicas_keep_their_workers():
    docs = _docs({"deployments": [{"name": "chat", "model": "meta-llama/Llama-3.1-70B-Instruct",
                                   "preset": "llama-3-70b", "replicas": 1, "prefill_replicas": 1,
                                   "max_model_len": 8192, "compute_share": 12}]},
                 {"nodes": [{"name": f"n{i}", "gpu": "H100", "count": 8} for i in range(4)]})
    objs = _by_name(docs)
    for role in ("prefill", "decode"):
        tmpl = objs["LeaderWorkerSet", f"chat-{role}"]["spec"]["leaderWorkerTemplate"]
        assert tmpl["size"] == 2 and "workerTemplate" in tmpl
        leader_cmd = tmpl["leaderTemplate"]["spec"]["containers"][0]["command"][-1]
        assert "--kv-transfer-config" in leader_cmd and "--nnodes 2" in leader_cmd


def test_aggregated_deployments_are_unchanged_and_bad_counts_refused():
    docs = _docs({"deployments": [{"name": "chat", "model": "m", "preset": "llama-3-8b", "replicas": 2}]})
    assert {d["kind"] for d in docs} == {"Deployment", "Service"}
    assert "--kv-transfer-config" not in yaml.safe_dump(docs)
    with pytest.raises(ValueError, match="prefill_replicas"):
        parse_deployments({"deployments": [{"name": "chat", "model": "m", "prefill_replicas": -1}]})
