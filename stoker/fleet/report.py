"""Human (Markdown) and machine (JSON-ready dict) summaries of a FleetPlan."""

from __future__ import annotations

from typing import Any

from stoker.fleet.plan import FleetPlan


def _money(x: float) -> str:
    return f"${x:,.0f}"


def plan_to_dict(plan: FleetPlan) -> dict[str, Any]:
    hours = plan.fleet.hours_per_month
    return {
        "method": plan.method,
        "gpus_in_fleet": plan.total_gpus,
        "gpus_before": plan.gpus_before,
        "gpus_after": plan.num_gpus,
        "monthly_cost_before": round(plan.hourly_cost_before * hours, 2),
        "monthly_cost_after": round(plan.hourly_cost * hours, 2),
        "gpus": [
            {"node": g.node, "index": g.index, "gpu_model": g.gpu_model, "mig_enabled": g.mig_enabled,
             "slices": [{"replica": s.replica, "profile": s.profile, "start": s.start} for s in g.slices],
             "whole_replica": g.whole_replica, "creation_order": list(g.creation_order),
             "idle_share": round(g.idle_share, 4), "fragmentation": round(g.fragmentation, 4)}
            for g in plan.gpus
        ],
        "replicas": [
            {"deployment": r.deployment, "index": r.index, "node": r.node, "gpu_model": r.gpu_model,
             "gpu_indices": list(r.gpu_indices), "profile": r.profile,
             "resource": {r.resource_name: r.resource_count}, **({"nodes": list(r.nodes)} if r.nodes else {})}
            for r in plan.replicas
        ],
        "unplaced": [{"deployment": u.deployment, "index": u.index, "reason": u.reason} for u in plan.unplaced],
    }


def render_report(plan: FleetPlan) -> str:
    hours = plan.fleet.hours_per_month
    idle = sum(g.idle_share for g in plan.gpus) / max(1, plan.num_gpus)
    lines = [
        "# Fleet plan",
        "",
        f"Solver: {plan.method}. Fleet: {plan.total_gpus} GPUs on {len(plan.fleet.nodes)} nodes.",
        "",
        "| | GPUs | monthly cost |",
        "|---|---|---|",
        f"| before (whole GPUs, no MIG) | {plan.gpus_before} | {_money(plan.hourly_cost_before * hours)} |",
        f"| after (this plan) | {plan.num_gpus} | {_money(plan.hourly_cost * hours)} |",
        "",
        f"Monthly cost counts {hours:g} hours per GPU in use, at the fleet file's prices. "
        f"Mean idle share of GPUs in use (SM slices not allocated / 7): {idle:.1%}. "
        f"GPUs left free: {plan.total_gpus - plan.num_gpus}.",
        "",
        "## GPUs",
        "",
        "| node | GPU | model | layout (profile@start: replica) | idle | fragmentation | `nvidia-smi mig -cgi` |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in plan.gpus:
        if g.mig_enabled:
            layout = "<br>".join(f"{s.profile}@{s.start}: {s.replica}" for s in g.slices)
            order = ",".join(map(str, g.creation_order))
        else:
            layout, order = f"whole GPU: {g.whole_replica}", "MIG off"
        lines.append(f"| {g.node} | {g.index} | {g.gpu_model} | {layout} | {g.idle_share:.0%} | "
                     f"{g.fragmentation:.0%} | {order} |")
    lines += ["", "## Replicas", "", "| deployment | replica | node | GPUs | resource |", "|---|---|---|---|---|"]
    for r in plan.replicas:
        gpus = ",".join(map(str, r.gpu_indices))
        node = " + ".join(r.nodes) if r.nodes else r.node
        lines.append(f"| {r.deployment} | {r.index} | {node} | {gpus} | `{r.resource_name}: {r.resource_count}` |")
    lines += ["", "## Not placed", ""]
    if plan.unplaced:
        lines += [f"- {u.deployment}/{u.index}: {u.reason}" for u in plan.unplaced]
    else:
        lines.append("Every replica is placed.")
    lines += [
        "",
        "## Applying it",
        "",
        "1. Give mig-manager each node's config: `kubectl label node <node> "
        "nvidia.com/mig.config=stoker-<node> --overwrite` (configs in `mig-parted.yaml`; "
        "without the GPU operator: `nvidia-mig-parted apply -f mig-parted.yaml -c stoker-<node>`).",
        "2. Run the device plugin with MIG strategy `mixed`, so slices appear as `nvidia.com/mig-<profile>`.",
        "3. `kubectl apply -f k8s/`.",
        "",
    ]
    return "\n".join(lines)
