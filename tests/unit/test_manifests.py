"""Emitted YAML: mig-parted schema, Kubernetes models, requests == limits, resource names."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes.client import ApiClient

from stoker.fleet import mig
from stoker.fleet.manifests import write_atomic, write_files
from stoker.fleet.render import render_files
from stoker.fleet.plan import plan_fleet
from stoker.fleet.report import render_report
from stoker.fleet.spec import load_deployments, load_fleet

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet"


@pytest.fixture(scope="module")
def plan():
    return plan_fleet(load_fleet(EXAMPLE / "fleet.yaml"), load_deployments(EXAMPLE / "deployments.yaml"))


def _k8s(data: dict, kind: str):
    # The client's own deserializer: unknown fields are dropped, wrong types raise.
    return ApiClient()._ApiClient__deserialize(data, kind)


def test_example_plan_is_complete_and_saves_gpus(plan):
    assert not plan.unplaced
    assert plan.num_gpus < plan.gpus_before
    for g in plan.gpus:
        if g.mig_enabled:
            from stoker.fleet.mig import Placement
            layout = [Placement(s.start, s.profile) for s in g.slices]
            assert mig.layout_errors(g.gpu_model, layout) == []
            mig.simulate_creation(g.gpu_model, g.creation_order)


def test_mig_parted_schema(plan):
    files = render_files(plan, render_report(plan))
    doc = yaml.safe_load(files["mig-parted.yaml"])
    assert doc["version"] == "v1" and set(doc) == {"version", "mig-configs"}
    assert set(doc["mig-configs"]) == {f"stoker-{n.name}" for n in plan.fleet.nodes}
    nodes = {f"stoker-{n.name}": n for n in plan.fleet.nodes}
    for name, entries in doc["mig-configs"].items():
        seen = []
        for e in entries:
            assert set(e) <= {"devices", "mig-enabled", "mig-devices", "device-filter"}
            assert isinstance(e["mig-enabled"], bool)
            seen += e["devices"]
            if e["mig-enabled"]:
                model = nodes[name].gpu_model
                names = [p for p, c in e["mig-devices"].items() for _ in range(c)]
                assert mig.layout_for(model, names) is not None
            else:
                assert "mig-devices" not in e
        assert sorted(seen) == list(range(nodes[name].num_gpus))


def test_k8s_manifests_validate(plan):
    files = render_files(plan, render_report(plan))
    k8s = {k: v for k, v in files.items() if k.startswith("k8s/")}
    assert len(k8s) == len(plan.deployments)
    resources_seen = set()
    for text in k8s.values():
        docs = list(yaml.safe_load_all(text))
        kinds = [d["kind"] for d in docs]
        assert kinds[-1] == "Service" and set(kinds[:-1]) == {"Deployment"}
        for d in docs:
            if d["kind"] == "Service":
                svc = _k8s(d, "V1Service")
                assert svc.spec.ports[0].port == 8000
                continue
            dep = _k8s(d, "V1Deployment")
            assert dep.spec.selector.match_labels == dep.spec.template.metadata.labels
            (c,) = dep.spec.template.spec.containers
            assert c.command == ["stoker", "serve"]
            assert c.resources.requests == c.resources.limits
            (res,) = c.resources.limits
            assert res == "nvidia.com/gpu" or res.startswith("nvidia.com/mig-")
            resources_seen.add(res)
            assert c.readiness_probe.http_get.path == "/v1/health/ready"
            assert c.liveness_probe.http_get.path == "/v1/health/live"
            assert c.ports[0].container_port == 8000
            terms = dep.spec.template.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
            assert terms.node_selector_terms[0].match_expressions[0].key == "kubernetes.io/hostname"
    assert {"nvidia.com/gpu", "nvidia.com/mig-3g.40gb", "nvidia.com/mig-1g.5gb"} <= resources_seen


def test_committed_example_output_is_current(plan):
    files = render_files(plan, render_report(plan))
    for rel, text in files.items():
        assert (EXAMPLE / "out" / rel).read_text() == text, f"re-run the example: {rel} is stale"


def test_write_is_atomic(tmp_path, monkeypatch):
    target = tmp_path / "a.yaml"
    target.write_text("old")

    class Boom(Exception):
        pass

    def bad_fsync(fd):
        raise Boom

    monkeypatch.setattr("os.fsync", bad_fsync)
    with pytest.raises(Boom):
        write_atomic(target, "new")
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]  # no temp file left behind


def test_stale_generated_manifests_removed(tmp_path, plan):
    files = render_files(plan, render_report(plan))
    write_files(tmp_path, {**files, "k8s/gone.yaml": files["k8s/llama-70b.yaml"]})
    (tmp_path / "k8s" / "mine.yaml").write_text("kind: ConfigMap\n")
    write_files(tmp_path, files)
    assert not (tmp_path / "k8s" / "gone.yaml").exists()
    assert (tmp_path / "k8s" / "mine.yaml").exists()


def test_a_replica_larger_than_a_node_spans_nodes_as_a_leaderworkerset():
    """Llama-3-70B at max_num_seqs 128 x 8192 tokens needs more than one 4-GPU H100 node: the
    plan spans two whole nodes (TP 8) and writes a LeaderWorkerSet whose leader serves and
    whose worker runs --headless; a single-node deployment stays a Deployment."""
    from stoker.fleet.spec import parse_deployments, parse_fleet

    fleet = parse_fleet({"nodes": [{"name": f"h{i}", "gpu": "H100-80GB", "count": 4} for i in range(2)]
                         + [{"name": "small", "gpu": "H100-80GB", "count": 1}]})
    deployments = parse_deployments({"deployments": [
        {"name": "big", "model": "meta-llama/Llama-3.1-70B-Instruct", "preset": "llama-3-70b", "max_model_len": 8192,
         "max_num_seqs": 128},
        {"name": "tiny", "model": "m", "preset": "llama-3.2-1b", "max_model_len": 4096, "max_num_seqs": 8},
    ]})
    plan = plan_fleet(fleet, deployments)
    assert not plan.unplaced
    (big,) = [r for r in plan.replicas if r.deployment == "big"]
    assert big.nodes == ("h0", "h1") and big.tensor_parallel_size == 8 and big.resource_count == 4
    files = render_files(plan, render_report(plan))
    (lws,) = list(yaml.safe_load_all(files["k8s/big.yaml"]))[:-1]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = (_k8s(group[t], "V1PodTemplateSpec") for t in ("leaderTemplate", "workerTemplate"))
    (lc,), (wc,) = leader.spec.containers, worker.spec.containers
    assert lc.command[:2] == ["sh", "-c"] and wc.command[:2] == ["sh", "-c"]
    for c in (lc, wc):
        assert "--tensor-parallel-size 8 --nnodes 2 --master-addr $LWS_LEADER_ADDRESS" in c.command[2]
        assert "--node-rank $LWS_WORKER_INDEX" in c.command[2]
        assert c.resources.limits == {"nvidia.com/gpu": "4"}
    assert "--headless" in wc.command[2] and "--headless" not in lc.command[2]
    assert lc.readiness_probe.http_get.path == "/v1/health/ready" and wc.readiness_probe is None
    svc = _k8s(list(yaml.safe_load_all(files["k8s/big.yaml"]))[-1], "V1Service")
    assert set(svc.spec.selector.items()) <= set(leader.metadata.labels.items())
    assert not set(svc.spec.selector.items()) <= set(worker.metadata.labels.items())  # only the leader serves
    assert [d["kind"] for d in yaml.safe_load_all(files["k8s/tiny.yaml"])] == ["Deployment", "Service"]
