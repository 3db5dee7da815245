"""`stoker fleet plan`: place deployments on a MIG-aware fleet and write mig-parted + k8s files."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    fleet = subparsers.add_parser("fleet", help="plan a GPU fleet: MIG layouts, placement, k8s manifests")
    sub = fleet.add_subparsers(dest="fleet_command", metavar="FLEET_COMMAND")
    plan = sub.add_parser(
        "plan",
        help="place deployments onto whole GPUs or MIG slices; write mig-parted.yaml, k8s/*.yaml, report.md",
        description="Formats of both input files: docs/fleet.md.",
    )
    plan.add_argument("--fleet", required=True, help="fleet YAML: nodes, GPU model and count, prices")
    plan.add_argument("--deployments", required=True, help="deployments YAML: models, replicas, needs")
    plan.add_argument("--out", required=True, help="output directory")
    plan.add_argument("--method", default="auto", choices=("auto", "exact", "heuristic"),
                      help="solver: exact branch and bound, best-fit-decreasing heuristic, or auto (default)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
    plan.set_defaults(func=run_plan)
    fleet.set_defaults(func=lambda args: (fleet.print_help(), 2)[1])


def run_plan(args: argparse.Namespace) -> int:
    import json

    from stoker.fleet.manifests import write_files
    from stoker.fleet.render import render_files
    from stoker.fleet.plan import plan_fleet
    from stoker.fleet.report import plan_to_dict, render_report
    from stoker.fleet.spec import load_deployments, load_fleet

    fleet = load_fleet(args.fleet)
    deployments = load_deployments(args.deployments)
    plan = plan_fleet(fleet, deployments, method=args.method)
    files = render_files(plan, render_report(plan))
    written = write_files(args.out, files)
    if args.json:
        data = plan_to_dict(plan)
        data["files"] = [str(p) for p in written]
        print(json.dumps(data, indent=2))
    else:
        print(f"GPUs: {plan.gpus_before} before (whole GPUs) -> {plan.num_gpus} after ({plan.method} solver); "
              f"{len(plan.unplaced)} replica(s) not placed")
        for u in plan.unplaced:
            print(f"  not placed: {u.deployment}/{u.index}: {u.reason}")
        for p in written:
            print(f"wrote {p}")
    # Exit 1 when something could not be placed: the files are written, the plan is incomplete.
    return 1 if plan.unplaced else 0
