"""A MoE model sized over expert-parallel groups: DP attention + EP, as SGLang and DeepSeek deploy
DeepSeek-V3. [no torch]

    ep_layouts("deepseek-v3", "H100", targets, ep_sizes=(16, 32)) -> tuple[EPLayout, ...]

One group of N GPUs: attention, dense MLPs, shared experts, embeddings and LM head replicated on
every GPU (each decodes its own sequences: DP attention), the routed experts split whole over the
N GPUs (E / N each). Per GPU:
  weights   all weights in the shipped dtype less (1 - 1/N) of the routed experts
            (ModelSpec.weight_bytes; DeepSeek-V3 in block-FP8: 671 GB in all, 653 of them experts)
  KV        kvcapacity's budget rule (usable x utilization - weights - activations - runtime and
            communication buffers), per token the model's KV spec: MLA's one latent of
            kv_lora_rank + qk_rope_head_dim per layer, 70,272 B in bf16 for V3, the bytes the
            engine's KVCacheSpec(kv_tensors=1) holds (docs/mla.md)
  decode    costmodel.step_cost(tp=1, ep=N, moe_scheme="dp_attention", overlap_comm=True): the busiest
            rank's experts, the all-to-all dispatch and combine of batch x k x hidden x 2 bytes per
            sparse layer each way, hidden under compute where it can be (two-batch overlap)
  link      NVLink within a node (N <= 8), the inter-node link beyond (`inter_node_link`, 400 Gb/s
            InfiniBand by default: one NIC per GPU)
The largest batch (of planner.BATCHES) that fits the KV and meets the ITL budget is kept; groups =
ceil(target / (N x batch / ITL)). TTFT: one prompt prefilled on one GPU of the group.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from stoker.roofline.costmodel import step_cost
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GiB, GPUSpec, get_gpu, get_link
from stoker.roofline.kvcapacity import overheads, usable_memory
from stoker.roofline.modelspec import ModelSpec, get_model_spec
from stoker.roofline.planner import BATCHES, PlanTargets, servable_kv_dtypes, servable_weight_dtypes
from stoker.roofline.profiles import ENGINE

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class EPLayout:
    ep: int  # GPUs in one expert-parallel group
    link: str
    weight_dtype: str
    kv_dtype: str
    weights_gib_per_gpu: float
    kv_bytes_per_token: float
    kv_tokens_per_gpu: int
    max_batch: int = 0  # sequences per GPU
    itl_ms: float = 0.0
    ttft_ms: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    all_to_all_mb_per_step: float = 0.0  # per GPU, dispatch + combine over all sparse layers
    groups: int = 0
    gpus: int = 0
    reason: str = ""  # why the layout does not work, when it does not

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def ep_weight_bytes(m: ModelSpec, weight_dtype: str, ep: int) -> float:
    """Weights on one GPU of an EP group: everything but the routed experts whole, 1/ep of those."""
    experts = m.param_counts()["experts"] * m.expert_bytes_per_param(weight_dtype)
    return m.weight_bytes(weight_dtype) - experts * (1 - 1 / ep)


def ep_layouts(model: ModelSpec | str, gpu: GPUSpec | str, targets: PlanTargets, *, ep_sizes: tuple[int, ...],
               inter_node_link: str = "ib-ndr", weight_dtype: str | None = None,
               eff: Efficiencies | None = None) -> tuple[EPLayout, ...]:
    """One layout per group size in `ep_sizes` (module docstring); a reason on those that do not fit."""
    m = get_model_spec(model) if isinstance(model, str) else model
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if not m.is_moe:
        raise ValueError(f"--ep: {m.name} has no experts to split")
    eff = eff or ENGINE
    wd = weight_dtype or servable_weight_dtypes(m)[0]
    kvd = servable_kv_dtypes(m)[0]
    return tuple(_layout(m, g, targets, n, inter_node_link, wd, kvd, eff) for n in ep_sizes)


def _layout(m: ModelSpec, g: GPUSpec, t: PlanTargets, n: int, inter: str, wd: str, kvd: str,
            eff: Efficiencies) -> EPLayout:
    lnk = g.link if n <= GPUS_PER_NODE else get_link(inter)
    weights = ep_weight_bytes(m, wd, n)
    per_token = m.kv_bytes_per_token(kvd, 1)  # every head on the rank: DP attention
    usable, _ = usable_memory(g)
    # Communication buffers as a TP group's (NCCL / DeepEP): overheads(tp=2) adds them.
    charges = sum(o.bytes for o in overheads(m, 2 if n > 1 else 1, t.max_num_batched_tokens))
    kv_bytes = usable * t.gpu_memory_utilization - weights - charges
    base = EPLayout(n, lnk.name, wd, kvd, weights / GiB, per_token, max(0, int(kv_bytes // per_token)))
    if m.num_experts % n:
        return _with(base, reason=f"EP{n} does not divide {m.num_experts} experts")
    if n > 1 and lnk.kind == "none":
        return _with(base, reason=f"{g.name} has no link for EP{n}")
    if kv_bytes <= 0:
        return _with(base, reason=(f"weights {weights / GiB:.0f} GiB per GPU leave no KV in {usable / GiB:.0f} GiB x "
                                   f"{t.gpu_memory_utilization:g}"))
    seq = t.prompt_len + t.output_len
    kw = dict(weight_dtype=wd, kv_dtype=kvd, tp=1, ep=n, moe_scheme="dp_attention" if n > 1 else "tp", link=lnk,
              eff=eff, overlap_comm=True, with_floor=False)
    best: tuple[int, float] | None = None
    for b in BATCHES:
        if b * seq > base.kv_tokens_per_gpu or b >= t.max_num_batched_tokens:
            break
        itl = step_cost(m, g, batch=b, context_len=t.prompt_len + t.output_len // 2, **kw).step_time_s  # type: ignore[arg-type]
        if t.tpot_ms is not None and itl * 1e3 > t.tpot_ms:
            break
        best = (b, itl)
    if best is None:
        return _with(base, reason=f"no batch fits: KV holds {base.kv_tokens_per_gpu // seq} sequences of {seq} per GPU, "
                                  f"or one decode step exceeds the ITL budget")
    b, itl = best
    ttft = step_cost(m, g, phase="prefill", batch=1, context_len=t.prompt_len, **kw).step_time_s  # type: ignore[arg-type]
    per_gpu = b / itl
    groups = math.ceil(t.target_tokens_per_s / (per_gpu * n))
    a2a = 2 * m.num_sparse_layers * b * m.num_experts_per_tok * m.hidden_size * 2.0 if n > 1 else 0.0
    reason = ""
    if t.ttft_p50_ms is not None and ttft * 1e3 > t.ttft_p50_ms:
        reason = f"TTFT {ttft * 1e3:.0f} ms > budget {t.ttft_p50_ms:g} ms"
    elif groups * n > t.max_gpus:
        reason = f"needs {groups * n} GPUs > --max-gpus {t.max_gpus}"
    return _with(base, max_batch=b, itl_ms=itl * 1e3, ttft_ms=ttft * 1e3, tokens_per_s_per_gpu=per_gpu,
                 all_to_all_mb_per_step=a2a / 1e6, groups=groups, gpus=groups * n, reason=reason)


def _with(base: EPLayout, **kw: object) -> EPLayout:
    from dataclasses import replace

    return replace(base, **kw)  # type: ignore[arg-type]


def format_ep(layouts: tuple[EPLayout, ...]) -> list[str]:
    """The `stoker plan --ep` table."""
    if not layouts:
        return []
    first = layouts[0]
    lines = [f"expert-parallel layouts (DP attention + EP, {first.weight_dtype} weights, {first.kv_dtype} KV "
             f"{first.kv_bytes_per_token:,.0f} B/token, two-batch overlap):",
             f"  {'EP':>4} {'link':<9} {'weights GiB/GPU':>15} {'KV tokens/GPU':>13} {'batch/GPU':>9} {'ITL ms':>7} "
             f"{'TTFT ms':>8} {'tok/s/GPU':>9} {'a2a MB/step':>11} {'GPUs':>5}"]
    for x in layouts:
        head = f"  {x.ep:>4} {x.link:<9} {x.weights_gib_per_gpu:>15.1f} {x.kv_tokens_per_gpu:>13,}"
        if not x.max_batch:
            lines.append(f"{head}  -- {x.reason}")
            continue
        lines.append(f"{head} {x.max_batch:>9} {x.itl_ms:>7.1f} {x.ttft_ms:>8.0f} {x.tokens_per_s_per_gpu:>9,.0f} "
                     f"{x.all_to_all_mb_per_step:>11,.0f} {x.gpus:>5}" + (f"  -- {x.reason}" if x.reason else ""))
    return lines
