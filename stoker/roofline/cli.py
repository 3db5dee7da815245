"""`stoker roofline` and `stoker plan`. Registration is light; the work imports lazily."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stoker.roofline.lora import LoRASpec


def register(subparsers: argparse._SubParsersAction) -> None:
    r = subparsers.add_parser(
        "roofline", help="which wall a model is against on a GPU (predicted, or a measured run placed)",
        description="Per-op roofline of a decode or prefill step: FLOPs, bytes, bound, time; tokens/s per batch; "
                    "a verdict; optionally a PNG and a measured run's MBU/MFU.")
    r.add_argument("--model", help="preset (e.g. llama-3-70b), HF repo id of one, or a checkpoint dir/config.json")
    r.add_argument("--gpu", "--device", dest="gpu", help="device, e.g. H100, h100-pcie, A100-80GB, L40S, H100:3g.40gb, "
                   "'this' (this machine, as `stoker doctor --write-device-file` measured it) or a device-file path")
    r.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=None, help="tensor-parallel degree (default 1)")
    r.add_argument("--dtype", default="bf16", help="weight dtype: bf16, fp8, int8, int4 (default bf16)")
    r.add_argument("--kv-dtype", default=None, help="KV cache dtype: bf16 or fp8 (default bf16)")
    r.add_argument("--batch", default="1,8,64,256", help="comma-separated batch sizes (default 1,8,64,256)")
    r.add_argument("--context", type=int, default=None, help="context length per sequence (default 1024, or the measured run's)")
    r.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    r.add_argument("--link", default=None, help="GPU-GPU link override: nvlink4, nvlink-bridge, pcie4, pcie5, ib-ndr, ...")
    r.add_argument("--plot", metavar="FILE.png", help="write a log-log roofline PNG")
    r.add_argument("--json", action="store_true", help="print one JSON object per batch size")
    r.add_argument("--measured", metavar="RESULT.json", help="a stoker bench result to place against the roofline")
    r.add_argument("--device-file", metavar="DEVICES.yaml", help="add devices from YAML (see docs/roofline.md)")
    r.add_argument("--lora-rank", "--max-lora-rank", dest="lora_rank", type=int, default=None, metavar="R",
                   help="every sequence on a rank-R LoRA adapter: the step prediction includes the adapters' weight "
                        "reads and FLOPs, and a table shows them beside the base's")
    r.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="distinct adapters a step may hold (vLLM's --max-loras; default 1); a step of b sequences "
                        "holds min(N, b)")
    r.add_argument("--lora-targets", default=None, metavar="q_proj,k_proj,...",
                   help="projections the adapters target (default all seven: q,k,v,o,gate,up,down_proj)")
    r.add_argument("--ep", "--expert-parallel-size", dest="ep", type=int, default=1,
                   help="MoE: experts split whole over this many ranks (1: TP cuts every expert, as the engine runs)")
    r.add_argument("--moe-scheme", choices=("tp", "dp_attention"), default="tp",
                   help="with --ep: 'tp' (ep = tp, tokens replicated, combine in the TP all-reduce) or 'dp_attention' "
                        "(tp 1, attention replicated, all-to-all dispatch and combine; figures per rank)")
    _profile_flags(r)
    r.set_defaults(func=run_roofline)
    sub = r.add_subparsers(dest="roofline_command", metavar="{kv,calibrate}")
    _register_kv(sub)
    _register_calibrate(sub)

    p = subparsers.add_parser(
        "plan", help="cheapest deployment (dtype x TP x replicas x batch) meeting a rate and latency budgets",
        description="Enumerate weight dtype x KV dtype x TP x replicas x max batch; keep what fits and meets the "
                    "targets by the cost model; rank by cost per million tokens; say why each rejected family fails.")
    p.add_argument("--model", required=True)
    p.add_argument("--gpu", required=True)
    p.add_argument("--target-tokens-per-s", type=float, default=None,
                   help="aggregate output tokens/s to serve (or --request-rate)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests/s to serve: the target is this x --output-len output tokens/s")
    p.add_argument("--ttft-p50-ms", type=float, default=None, help="median time-to-first-token budget")
    p.add_argument("--tpot-ms", "--itl-ms", dest="tpot_ms", type=float, default=None,
                   help="time-per-output-token (inter-token latency) budget")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-gpus", type=int, default=8)
    p.add_argument("--gpu-hour-price", type=float, default=1.0, help="USD per GPU-hour (default 1.0: cost reads as GPU-hours)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--link", default=None, help="GPU-GPU link override (e.g. pcie4 to price a PCIe box)")
    p.add_argument("--top", type=int, default=10, help="feasible plans to print (default 10)")
    p.add_argument("--weight-dtypes", default=None,
                   help="weight dtypes to search (default: the ones stoker serve runs for the model: bf16,fp8,int8, "
                        "bf16 for a MoE model, int4 for an AWQ / GPTQ / W4A16 checkpoint; add int4 to price "
                        "--quantization int4, printed with its measured quality cost)")
    p.add_argument("--json", action="store_true", help='print {"feasible": [...], "rejected": [...]}')
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="scheduler token budget per step: decode batch + prefill chunk (default 8192, vLLM's)")
    p.add_argument("--device-file", metavar="DEVICES.yaml")
    _profile_flags(p)
    from stoker.roofline.plan_extras import register_plan_extras

    register_plan_extras(p)
    p.set_defaults(func=run_plan)


def _profile_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="engine", metavar="{kernel,engine,PATH.yaml}",
                   help="efficiencies for the prediction: 'engine' (fitted to public engine measurements, default), "
                        "'kernel' (each op at its best kernel's peak) or a profile file from `roofline calibrate`; "
                        "the ceiling is always datasheet peaks")
    p.add_argument("--overlap-comm", action="store_true",
                   help="hide TP all-reduce time under the step's compute (engines that overlap them)")


def _register_kv(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("kv", help="KV-cache capacity of one replica: tokens, blocks, and every overhead charged",
                       description="vLLM's budget rule from the memory the runtime reports: usable x utilization - "
                                   "weights - activation peak - runtime buffers, per GPU; tokens and blocks per replica.")
    k.add_argument("--model", required=True)
    k.add_argument("--gpu", required=True)
    k.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    k.add_argument("--dtype", default="bf16", help="weight dtype: bf16, fp8, int8, int4 (default bf16)")
    k.add_argument("--kv-dtype", default="bf16", help="KV cache dtype: bf16 or fp8 (default bf16)")
    k.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    k.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget the activations are sized for (default 8192)")
    k.add_argument("--block-size", type=int, default=16)
    k.add_argument("--max-model-len", type=int, default=None, help="also print how many sequences of this length fit")
    k.add_argument("--json", action="store_true")
    k.add_argument("--device-file", metavar="DEVICES.yaml")
    k.set_defaults(func=run_kv)


def _register_calibrate(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("calibrate", help="fit an efficiency profile to stoker bench results; write it as YAML",
                       description="Fits the memory share, GEMM share and per-layer gap to measured decode tokens/s "
                                   "(see docs/roofline.md); writes a profile file for --profile.")
    c.add_argument("results", nargs="+", metavar="RESULT.json", help="stoker bench results (or {points: [...]})")
    c.add_argument("-o", "--output", required=True, metavar="PROFILE.yaml")
    c.add_argument("--model", default=None, help="override the model the results name")
    c.add_argument("--gpu", default=None, help="override the GPU the results name")
    c.add_argument("--tp", type=int, default=None)
    c.add_argument("--dtype", default=None, help="weight dtype of the measured runs (default bf16)")
    c.add_argument("--kv-dtype", default=None)
    c.add_argument("--start", default="engine", metavar="{kernel,engine,PATH.yaml}",
                   help="profile the fit starts from; knobs the data cannot see keep its values (default engine)")
    c.add_argument("--name", default=None, help="profile name recorded in the file (default: from the output name)")
    c.add_argument("--device-file", metavar="DEVICES.yaml")
    c.set_defaults(func=run_calibrate)


def _batches(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"--batch takes comma-separated positive integers like 1,8,64,256, not {text!r}")
    return sorted(set(values))


def _lora_spec(args: argparse.Namespace) -> LoRASpec | None:
    """--lora-rank / --max-loras / --lora-targets as a LoRASpec (None: no adapters)."""
    from stoker.roofline.lora import LORA_TARGETS, LoRASpec

    if args.lora_rank is None:
        if args.max_loras is not None or args.lora_targets is not None:
            raise ValueError("--max-loras and --lora-targets need --lora-rank R")
        return None
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()) if args.lora_targets else LORA_TARGETS
    return LoRASpec(rank=args.lora_rank, max_loras=args.max_loras or 1, targets=targets)


def _need(value: str | None, flag: str, choices: list[str]) -> str:
    if not value:
        raise ValueError(f"{flag} is required (or a --measured file that names it); choose one of: {', '.join(choices)}")
    return value


def run_roofline(args: argparse.Namespace) -> int:
    from stoker.roofline import costmodel, hardware, measured, modelspec, profiles, report

    if args.device_file:
        hardware.load_gpu_yaml(args.device_file)
    eff = profiles.get_profile(args.profile)
    # For a measured run, --batch (first value) and --context only fill in what the file lacks.
    run = measured.load_measured(args.measured, batch=_batches(args.batch)[0],
                                 context_len=args.context) if args.measured else None
    model = _need(args.model or (run.model if run else None), "--model", modelspec.list_models())
    gpu_name = _need(args.gpu or (run.gpu if run else None), "--gpu", hardware.list_gpus())
    gpu = hardware.load_gpu_yaml(gpu_name)[0] if Path(gpu_name).is_file() else hardware.get_gpu(gpu_name)
    spec = modelspec.get_model_spec(model)
    tp = args.tp or (run.tp if run and run.tp else 1)
    args.context = args.context or (round(run.context_len) if run else 1024)
    fp32 = modelspec.normalize_dtype(args.dtype) == "fp32"  # a float32 engine: Stoker on CPU
    kw = dict(phase=args.phase, context_len=args.context, weight_dtype=args.dtype,
              kv_dtype=args.kv_dtype or ("fp32" if fp32 else None), tp=tp, link=args.link, eff=eff,
              overlap_comm=args.overlap_comm, act_dtype="fp32" if fp32 else "bf16", last_token_logits=fp32,
              ep=args.ep, moe_scheme=args.moe_scheme)
    modelspec.dtype_bytes(args.dtype)
    lora = _lora_spec(args)
    steps = [costmodel.step_cost(spec, gpu, batch=b, lora=lora, **kw) for b in _batches(args.batch)]  # type: ignore[arg-type]
    lora_rows = [report.lora_summary(lora, spec, s, costmodel.step_cost(spec, gpu, batch=s.batch, **kw),  # type: ignore[arg-type]
                                     act_dtype=str(kw["act_dtype"])) for s in steps] if lora else []
    cdt = costmodel.compute_dtype(args.dtype, gpu)
    ridge_batch = costmodel.crossover_batch(spec, gpu, context_len=args.context, weight_dtype=args.dtype,
                                            kv_dtype=args.kv_dtype, tp=tp, link=args.link) if args.phase == "decode" else None
    util = None
    if run:
        util = measured.implied_utilization(spec.name if not args.model else model, gpu_name,
                                            output_tokens_per_s=run.output_tokens_per_s, batch=run.batch,
                                            context_len=run.context_len, tp=tp, weight_dtype=args.dtype,
                                            kv_dtype=args.kv_dtype, eff=eff)
    if args.plot:
        from stoker.roofline.plot import plot_roofline

        title = (f"{spec.name} on {'%d x ' % tp if tp > 1 else ''}{gpu.name}, {args.phase}, context {args.context}, "
                 f"{args.dtype} weights / {args.kv_dtype or 'bf16'} KV")
        plot_roofline(args.plot, gpu, steps, title=title, eff=eff, measured=util)  # the profile that predicted
    if args.json:
        out: list[dict[str, object]] = [{"kind": "prediction", "model": spec.name, "profile": args.profile, **s.as_dict()}
                                        for s in steps]
        for row, extra in zip(out, lora_rows):
            row["lora"] = extra
        if util:
            out.append({"kind": "measured", "model": spec.name, "gpu": gpu.name, "assumptions": list(run.assumptions), **util})  # type: ignore[union-attr]
        print(json.dumps(out, indent=2))
        return 0
    print(f"{spec.name} ({spec.num_params / 1e9:.1f}B params, {spec.kv_bytes_per_token(args.kv_dtype or 'bf16'):,.0f} B KV/token) "
          f"on {gpu.name}: {gpu.peak_flops(cdt) / 1e12:.0f} TFLOP/s {cdt}, {gpu.hbm_gb_per_s:.0f} GB/s, "
          f"ridge {gpu.ridge_point(cdt):.0f} FLOP/B; link {steps[0].tp > 1 and (args.link or gpu.link.name) or '-'}; "
          f"predicted with the {args.profile} profile{', comm overlapped' if args.overlap_comm else ''}")
    if spec.is_moe:
        c = spec.param_counts()
        print(f"MoE: {spec.num_experts} experts, {spec.num_experts_per_tok} per token on {spec.num_sparse_layers} layers; "
              f"{(spec.num_active_params - c['embedding']) / 1e9:.2f}B active (no embedding); experts in "
              f"{spec.expert_dtype or args.dtype}; "
              + (f"EP{args.ep} ({args.moe_scheme}); " if args.ep > 1 else "experts cut by TP; ")
              + "experts read per layer: "
              + ", ".join(f"B={s.batch} {costmodel.experts_per_rank(spec, s.batch * (args.ep if args.moe_scheme == 'dp_attention' else 1), args.ep):.1f}"
                          for s in steps) + (" (busiest rank)" if args.ep > 1 else ""))
    if spec.num_sliding_layers:
        print(f"sliding window: {spec.num_sliding_layers} of {spec.num_layers} layers hold at most {spec.sliding_window} "
              f"tokens: {spec.kv_bytes_per_seq(args.context, args.kv_dtype or 'bf16'):,.0f} B KV per sequence of {args.context}")
    for s in steps:
        print()
        print(report.step_header(s))
        print(report.ops_table(s))
    print()
    print(report.summary_table(steps))
    if lora:
        print()
        print(report.lora_table(lora, lora_rows, act_dtype=str(kw["act_dtype"])))
    print()
    for line in report.verdict(steps, ridge_batch, gpu.ridge_point(cdt)):
        print(line)
    if util and run:
        for line in report.measured_lines(util, run.assumptions):
            print(line)
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from stoker.roofline import hardware, memory, modelspec, planner, profiles

    if args.device_file:
        hardware.load_gpu_yaml(args.device_file)
    eff = profiles.get_profile(args.profile)
    if (args.target_tokens_per_s is None) == (args.request_rate is None):
        raise ValueError("give one of --target-tokens-per-s (output tokens/s) or --request-rate (requests/s)")
    if args.request_rate is not None:
        if args.request_rate <= 0:
            raise ValueError("--request-rate must be > 0 (requests/s)")
        args.target_tokens_per_s = args.request_rate * args.output_len
    targets = planner.PlanTargets(
        target_tokens_per_s=args.target_tokens_per_s, ttft_p50_ms=args.ttft_p50_ms, tpot_ms=args.tpot_ms,
        prompt_len=args.prompt_len, output_len=args.output_len, max_gpus=args.max_gpus,
        gpu_hour_price=args.gpu_hour_price, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens or memory.DEFAULT_MAX_NUM_BATCHED_TOKENS)
    weight_dtypes = tuple(d.strip() for d in (args.weight_dtypes or "").split(",") if d.strip()) or None
    result = planner.plan(args.model, args.gpu, targets, link=args.link, eff=eff, overlap_comm=args.overlap_comm,
                          weight_dtypes=weight_dtypes)
    from stoker.roofline import plan_extras

    extras = plan_extras.compute(args, targets, result, eff)
    ok = bool(result.feasible) or plan_extras.feasible(extras)
    if args.json:
        print(json.dumps({**result.as_dict(), **plan_extras.as_dict(extras)}, indent=2))
        return 0 if ok else 1
    gpu = hardware.get_gpu(args.gpu)
    budgets = ", ".join(b for b in (args.ttft_p50_ms and f"TTFT p50 <= {args.ttft_p50_ms:g} ms",
                                    args.tpot_ms and f"TPOT <= {args.tpot_ms:g} ms") if b) or "no latency budget"
    print(f"plan: {args.model} on {gpu.name}, {args.target_tokens_per_s:,.0f} output tokens/s, {budgets}, "
          f"prompt {args.prompt_len} + output {args.output_len} tokens, <= {args.max_gpus} GPUs; "
          f"{args.profile} profile, chunked prefill in a {targets.max_num_batched_tokens}-token step budget")
    if result.feasible:
        print(f"\n{'gpus':>4} {'TP':>3} {'repl':>4}  {'weights':<7} {'KV':<5} {'batch':>5} {'KV seqs':>7} "
              f"{'KV tokens':>10} {'tokens/s':>9} {'TTFT ms':>8} {'TPOT ms':>8} {'GiB/GPU':>8} {'$/Mtok':>8}  bound")
        for c in result.feasible[: args.top]:
            print(f"{c.gpus:>4} {c.tp:>3} {c.replicas:>4}  {c.weight_dtype:<7} {c.kv_dtype:<5} {c.max_batch:>5} "
                  f"{c.kv_max_seqs:>7,} {c.kv_capacity_tokens:>10,} "
                  f"{c.tokens_per_s:>9,.0f} {c.ttft_ms:>8.0f} {c.tpot_ms:>8.1f} {c.memory_per_gpu_gb:>8.1f} "
                  f"{c.cost_per_million_tokens:>8.3f}  {c.bound}")
        best = result.feasible[0]
        print(f"\nbest: {best.replicas} x TP{best.tp} {best.weight_dtype} weights / {best.kv_dtype} KV, max batch "
              f"{best.max_batch}: {best.gpus} GPUs, {best.tokens_per_s:,.0f} tokens/s capacity; KV per replica "
              f"{best.kv_capacity_tokens:,} tokens = {best.kv_max_seqs:,} sequences of {args.prompt_len + args.output_len}")
        print(f"run ({best.replicas} replica{'s' if best.replicas > 1 else ''}): {planner.serve_command(args.model, best)}")
    else:
        print("\nno feasible plan: nothing in the search space meets the targets (reasons below)")
    searched = {c.weight_dtype for c in result.feasible} | {r.weight_dtype for r in result.rejected}
    if "int4" in searched:
        print("\n" + planner.int4_note(modelspec.get_model_spec(args.model)))
    if result.rejected:
        print("\nrejected:")
        for r in result.rejected:
            print(f"  {r.family}: {r.reason}")
    for line in plan_extras.format_lines(extras, args):
        print(line)
    return 0 if ok else 1


def run_kv(args: argparse.Namespace) -> int:
    from stoker.roofline import hardware, kvcapacity, memory

    if args.device_file:
        hardware.load_gpu_yaml(args.device_file)
    cap = kvcapacity.kv_capacity(args.model, args.gpu, tp=args.tp, weight_dtype=args.dtype, kv_dtype=args.kv_dtype,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 max_num_batched_tokens=args.max_num_batched_tokens or memory.DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                 block_size=args.block_size)
    if args.json:
        out = cap.as_dict()
        if args.max_model_len:
            out["max_model_len"], out["max_seqs"] = args.max_model_len, cap.max_seqs(args.max_model_len)
        print(json.dumps(out, indent=2))
        return 0
    for line in kvcapacity.format_report(cap):
        print(line)
    if args.max_model_len:
        print(f"sequences of {args.max_model_len:,} tokens at once: {cap.max_seqs(args.max_model_len):,}")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stoker.roofline import calibrate, hardware, profiles

    if args.device_file:
        hardware.load_gpu_yaml(args.device_file)
    eff, fitted = calibrate.calibrate_files(args.results, model=args.model, gpu=args.gpu, tp=args.tp,
                                            weight_dtype=args.dtype, kv_dtype=args.kv_dtype,
                                            start=profiles.get_profile(args.start))
    name = args.name or Path(args.output).stem
    source = f"stoker roofline calibrate {' '.join(args.results)} (start: {args.start})"
    fitted_to = {k: fitted[k] for k in ("model", "gpu", "tp", "weight_dtype", "kv_dtype") if fitted.get(k) is not None}
    profiles.save_profile(eff, args.output, name=name, source=source,
                          extra={"fitted_to": {**fitted_to, "points": fitted["points"]}})
    print(f"fitted {len(fitted['points'])} point(s) of {fitted.get('model')} on {fitted.get('gpu')}: "
          f"memory {eff.memory:.2f}, gemm_compute {eff.gemm_compute:.2f}, layer_overhead {eff.layer_overhead_s * 1e6:.0f} us")
    print(f"wrote {args.output} (use it with --profile {args.output})")
    return 0
