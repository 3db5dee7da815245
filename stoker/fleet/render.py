"""Every file `stoker fleet plan` writes, rendered in memory before anything is written. [no torch]

Aggregated deployments come from manifests.py, disaggregated ones (prefill and decode roles plus
the router) from disagg.py, which builds on manifests.py: this module sits above both.
"""

from __future__ import annotations

from stoker.fleet.disagg import disaggregated_objects
from stoker.fleet.manifests import GENERATED, deployment_objects, dump_yaml, dump_yaml_all, mig_parted_config
from stoker.fleet.plan import FleetPlan


def render_files(plan: FleetPlan, report_md: str) -> dict[str, str]:
    """Every output file, relative path -> text, built in memory before anything is written."""
    files = {"mig-parted.yaml": GENERATED + dump_yaml(mig_parted_config(plan)),
             "report.md": report_md}
    for dep in plan.deployments:
        placed = [r for r in plan.replicas if r.deployment == dep.name]
        if placed:
            # a disaggregated deployment (prefill_replicas) is one LeaderWorkerSet per role plus the router
            docs = disaggregated_objects(dep, placed) if dep.prefill_replicas else deployment_objects(dep, placed)
            files[f"k8s/{dep.name}.yaml"] = GENERATED + dump_yaml_all(docs)
    return files
