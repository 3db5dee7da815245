"""A tensor-parallel replica that spans nodes, as a LeaderWorkerSet (sigs.k8s.io/lws). [no torch]

One LeaderWorkerSet per multi-node group of a deployment: each replica is a group of
`size` pods, one per node. The leader (node rank 0) runs `stoker serve` with the server, the
scheduler and ranks 0..g-1; each worker pod runs `stoker serve --headless` with its node's
ranks. LWS gives every pod LWS_LEADER_ADDRESS (the leader's stable DNS name) and
LWS_WORKER_INDEX (0 for the leader, 1.. for workers), which become --master-addr and
--node-rank; the shell expands them (vLLM's LWS example does the same). RecreateGroupOnPodRestart
restarts the whole group when one pod fails: a tensor-parallel group cannot lose a rank.
Only the leader serves HTTP, so only it carries the readiness probe and the Service label.
"""

from __future__ import annotations

import shlex
from typing import Any

MASTER_PORT = 29500


def leaderworkerset(
    name: str, labels: dict[str, str], serve_args: list[str], num_nodes: int, container: dict[str, Any],
    pod_spec: dict[str, Any], replicas: int,
) -> dict[str, Any]:
    """`container` / `pod_spec`: the single-node Deployment's container and pod spec (image,
    resources per node, probes, volumes, affinity), which both templates start from."""
    dist = ["--nnodes", str(num_nodes), "--master-addr", "$LWS_LEADER_ADDRESS", "--master-port", str(MASTER_PORT),
            "--node-rank", "$LWS_WORKER_INDEX"]

    def command(extra: list[str]) -> list[str]:
        # shlex.quote everything but the two variables the shell must expand
        words = [w if w.startswith("$") else shlex.quote(w) for w in ["stoker", "serve", *serve_args, *dist, *extra]]
        return ["sh", "-c", "exec " + " ".join(words)]

    leader_container = {**container, "command": command([]), "args": []}
    leader_container["ports"] = [*container.get("ports", []), {"name": "rendezvous", "containerPort": MASTER_PORT}]
    worker_container = {k: v for k, v in container.items() if not k.endswith("Probe") and k != "ports"}
    worker_container["command"] = command(["--headless"])
    worker_container["args"] = []
    leader_labels = {**labels, "stoker.dev/role": "leader"}
    worker_labels = {k: v for k, v in labels.items() if k != "app.kubernetes.io/name"}
    worker_labels["stoker.dev/role"] = "worker"
    worker_labels["stoker.dev/deployment"] = labels["app.kubernetes.io/name"]
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "leaderWorkerTemplate": {
                "size": num_nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": {"labels": leader_labels},
                                   "spec": {**pod_spec, "containers": [leader_container]}},
                "workerTemplate": {"metadata": {"labels": worker_labels},
                                   "spec": {**pod_spec, "containers": [worker_container]}},
            },
        },
    }
