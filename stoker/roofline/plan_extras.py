"""`stoker plan`'s optional sections: aggregated vs disaggregated, the host KV tier, expert-parallel
layouts. Each runs only when its flag asks (the default plan output is unchanged). [no torch]

    --compare-disaggregated [--kv-link ib-ndr]   roofline/disagg.py
    --multi-turn N --turn-tokens T [--conversations C] [--kv-offloading-size GiB] [--host-link pcie5]
                                                 roofline/host_tier.py
    --ep 8,16,32 [--ep-link ib-ndr]              roofline/ep_sizing.py (DP attention + expert parallelism)
"""

from __future__ import annotations

import argparse
from typing import Any

from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.planner import Plan, PlanTargets


def register_plan_extras(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("disaggregated prefill/decode")
    d.add_argument("--compare-disaggregated", action="store_true",
                   help="also size a prefill pool + a decode pool for the targets and say whether splitting pays")
    d.add_argument("--kv-link", default="ib-ndr",
                   help="link the KV crosses from the prefill to the decode pool: nvlink4, ib-ndr, roce-400g (RDMA), "
                        "tcp (default ib-ndr)")
    h = p.add_argument_group("host KV tier (multi-turn)")
    h.add_argument("--multi-turn", type=int, default=None, metavar="TURNS",
                   help="price prefix reuse for conversations of this many turns (with --turn-tokens)")
    h.add_argument("--turn-tokens", type=int, default=512, help="tokens each turn adds: message + reply (default 512)")
    h.add_argument("--conversations", type=int, default=None,
                   help="conversations live at once, thinking users included (default: the best plan's max batch)")
    h.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GiB",
                   help="host KV tier per replica in GiB (vLLM's flag; default 0: none)")
    h.add_argument("--host-link", default=None, help="GPU-host link for tier copies (default pcie5 on Hopper/Blackwell, else pcie4)")
    e = p.add_argument_group("expert parallelism (MoE)")
    e.add_argument("--ep", "--expert-parallel-size", dest="ep_sizes", default=None, metavar="8,16,32",
                   help="also size DP-attention + expert-parallel layouts over these GPU counts")
    e.add_argument("--ep-link", default="ib-ndr",
                   help="link the expert all-to-all crosses beyond one node (default ib-ndr; within 8 GPUs: NVLink)")


def compute(args: argparse.Namespace, targets: PlanTargets, result: Plan, eff: Efficiencies) -> dict[str, Any]:
    """The sections the flags ask for, computed once for the text and the JSON."""
    out: dict[str, Any] = {}
    weight_dtypes = tuple(d.strip() for d in (args.weight_dtypes or "").split(",") if d.strip()) or None
    if args.multi_turn is None and (args.kv_offloading_size or args.conversations is not None):
        raise ValueError("--kv-offloading-size and --conversations price the host tier of a multi-turn workload: "
                         "add --multi-turn TURNS (and --turn-tokens)")
    if args.compare_disaggregated:
        from stoker.roofline.disagg import compare_layouts

        out["disaggregation"] = compare_layouts(args.model, args.gpu, targets, kv_link=args.kv_link, link=args.link,
                                                weight_dtypes=weight_dtypes, eff=eff)
    if args.multi_turn is not None:
        out["host_tier"] = _host_tier(args, targets, result, eff)
    if args.ep_sizes:
        from stoker.roofline.ep_sizing import ep_layouts

        sizes = _ep_sizes(args.ep_sizes)
        out["expert_parallel"] = ep_layouts(args.model, args.gpu, targets, ep_sizes=sizes, inter_node_link=args.ep_link,
                                            weight_dtype=(weight_dtypes or (None,))[0], eff=eff)
    return out


def _ep_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--ep takes comma-separated GPU counts like 8,16,32, not {text!r}")
    return sizes


def _host_tier(args: argparse.Namespace, targets: PlanTargets, result: Plan, eff: Efficiencies) -> Any:
    from stoker.roofline.host_tier import price_host_tier

    if not result.feasible:
        raise ValueError("--multi-turn prices the host tier on the best plan's replica: no plan meets the targets")
    c = result.feasible[0]
    active = c.max_batch * (targets.prompt_len + targets.output_len)  # what the running batch holds
    return price_host_tier(args.model, args.gpu, turns=args.multi_turn, turn_tokens=args.turn_tokens,
                           conversations=args.conversations if args.conversations is not None else c.max_batch,
                           device_tokens=max(0, c.kv_capacity_tokens - active), offloading_gib=args.kv_offloading_size,
                           weight_dtype=c.weight_dtype, kv_dtype=c.kv_dtype, tp=c.tp, link=args.link,
                           host_link=args.host_link, max_num_batched_tokens=targets.max_num_batched_tokens, eff=eff)


def feasible(extras: dict[str, Any]) -> bool:
    """Whether an asked-for section found a layout that meets the targets (the exit code counts it)."""
    d = extras.get("disaggregation")
    if d is not None and d.disaggregated is not None and d.verdict != "refused":
        return True
    return any(x.max_batch and not x.reason for x in extras.get("expert_parallel", ()))


def as_dict(extras: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in extras.items():
        out[key] = [v.as_dict() for v in value] if isinstance(value, (list, tuple)) else value.as_dict()
    return out


def format_lines(extras: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines: list[str] = []
    if "disaggregation" in extras:
        lines += [""] + disagg_lines(extras["disaggregation"])
    if "host_tier" in extras:
        from stoker.roofline.host_tier import format_host_tier

        lines += [""] + format_host_tier(extras["host_tier"], args.kv_offloading_size)
    if "expert_parallel" in extras:
        from stoker.roofline.ep_sizing import format_ep

        lines += [""] + format_ep(extras["expert_parallel"])
    return lines


def disagg_lines(cmp: Any) -> list[str]:
    """Both layouts side by side, the KV transfer, and the verdict with its reason."""
    lines = ["aggregated vs disaggregated (prefill pool + decode pool):",
             f"  {'layout':<14} {'GPUs':>4} {'tokens/s/GPU':>12} {'TTFT ms':>8} {'ITL ms':>7}  pools"]
    for layout, why in ((cmp.aggregated, cmp.aggregated_reason), (cmp.disaggregated, cmp.disaggregated_reason)):
        if layout is None:
            continue
        lines.append(f"  {layout.name:<14} {layout.gpus:>4} {layout.tokens_per_s_per_gpu:>12,.0f} {layout.ttft_ms:>8.0f} "
                     f"{layout.itl_ms:>7.1f}  {layout.description}")
    for name, layout, why in (("aggregated", cmp.aggregated, cmp.aggregated_reason),
                              ("disaggregated", cmp.disaggregated, cmp.disaggregated_reason)):
        if layout is None:
            lines.append(f"  {name:<14} none: {why}")
    x = cmp.transfer
    if x is not None:
        lines.append(f"  KV transfer per prompt: {x.bytes_per_prompt / 1e6:,.1f} MB over {x.link} ({x.gb_per_s:g} GB/s per "
                     f"NIC x {x.streams} stream{'s' if x.streams > 1 else ''}, {'RDMA' if x.rdma else 'no RDMA'}): "
                     f"{x.time_s * 1e3:.1f} ms")
    lines.append(f"verdict: disaggregation {cmp.verdict}: {cmp.reason}")
    return lines
