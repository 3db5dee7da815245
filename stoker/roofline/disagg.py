"""Aggregated vs disaggregated serving: when a prefill pool + a decode pool beats one pool. [no torch]

    compare_layouts(model, gpu, targets, kv_link="ib-ndr")  -> LayoutComparison (both layouts, verdict)
    kv_transfer(model, prompt_len, kv_dtype, link, tp_prefill=2, tp_decode=4) -> KVTransfer

Aggregated: the planner's cheapest plan (planner.plan): every replica prefills and decodes, chunked
prefill under the step's token budget, so each decode step also carries the prompt chunks that
arrive meanwhile (its ITL = decode step + chunks; planner.serving_times).

Disaggregated (vLLM's NixlConnector, SGLang's PD mode, Dynamo): a prefill pool computes each prompt's
KV and the decode pool reads it over `kv_link`, then decodes with nothing else in its steps:
  decode pool   ITL = one decode step of b sequences at context prompt + output / 2; b capped by the
                replica's KV (prompt + output tokens each); replicas = ceil(target / (b / ITL)).
  prefill pool  prompts batched into steps of the token budget (max_num_batched_tokens); a replica
                prefills budget / step-time prompt tokens per second; replicas = ceil(request rate x
                prompt_len / that). TTFT = the prompt's own chunks + the KV transfer (no queueing:
                the planner's aggregated TTFT has none either).
  KV transfer   the prompt's whole KV (ModelSpec.kv_bytes_per_seq: 2 x layers x kv_heads x head_dim x
                bytes per token, or MLA's one latent) over the link, each prefill rank sending its KV
                heads on its own NIC (min(tp_prefill, tp_decode, kv_heads) streams); MLA's latent is
                the same on every rank, so each decode rank reads a whole copy (one stream's time).
                The link's per-direction rate x the comm efficiency; the pool's NICs must carry
                request rate x bytes (its busy share is printed).
Refused: a prompt longer than LONG_PROMPT_TOKENS over a link without RDMA (TCP). NVIDIA Dynamo's
"Disaggregated Inference Communication Guide" (docs.nvidia.com/dynamo, kubernetes-deployment/
deployment-guide/disagg-communication): "RDMA (InfiniBand/RoCE) is required for production
disaggregated deployments"; without it "expect 200-500x performance degradation in Time To First
Token (TTFT) -- observed ~98s TTFT with TCP vs ~200-500ms with RDMA". Shorter prompts are prefilled
on the decode side anyway by Dynamo's conditional disaggregation (its vLLM worker's
`--max-local-prefill-length`, default 1000 tokens), so they never cross the link.
Equal TP only: both pools are searched per (KV dtype, TP) and paired only where the TP sizes match,
because Stoker's servers refuse a decode leg whose tp_size differs from the prefill server's (as
vLLM's NixlConnector first did), so an unequal pair would be a plan nobody can serve.
Not modelled: the transfer's per-block descriptors and handshake, queueing, a prefill pool with
prefix caching.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from stoker.roofline.costmodel import step_cost
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GPUSpec, Interconnect, get_gpu, get_link
from stoker.roofline.modelspec import KV_DTYPES, ModelSpec, get_model_spec
from stoker.roofline.planner import (
    BATCHES,
    TP_DEGREES,
    Candidate,
    PlanTargets,
    _family_block,
    family_kv,
    plan,
    serving_times,
    servable_kv_dtypes,
    servable_weight_dtypes,
)
from stoker.roofline.profiles import ENGINE
from stoker.roofline.workloads import chunked_prefill_s

LONG_PROMPT_TOKENS = 1000  # Dynamo's vLLM worker --max-local-prefill-length default: longer prompts go remote
DYNAMO_RDMA = ("NVIDIA Dynamo, Disaggregated Inference Communication Guide: RDMA (InfiniBand/RoCE) required "
               "for production disaggregated deployments; TCP ~98 s TTFT vs ~200-500 ms with RDMA")


@dataclass(frozen=True)
class KVTransfer:
    link: str
    rdma: bool
    bytes_per_prompt: float  # the prompt's whole KV (all heads, all layers)
    streams: int  # NICs carrying one prompt's KV at once
    gb_per_s: float  # per stream, per direction (the link table's figure)
    time_s: float  # one prompt's transfer at the comm efficiency

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def kv_transfer(model: ModelSpec | str, prompt_len: int, kv_dtype: str, link: Interconnect | str, *,
                tp_prefill: int = 1, tp_decode: int = 1, eff: Efficiencies | None = None) -> KVTransfer:
    """One prompt's KV moved from the prefill replica to the decode replica (module docstring)."""
    m = get_model_spec(model) if isinstance(model, str) else model
    lnk = get_link(link) if isinstance(link, str) else link
    if prompt_len < 1:
        raise ValueError("prompt_len must be >= 1")
    if lnk.kind == "none" or lnk.gb_per_s <= 0:
        raise ValueError(f"link {lnk.name!r} moves no bytes; give --kv-link (nvlink4, ib-ndr, roce-400g, tcp, ...)")
    total = m.kv_bytes_per_seq(prompt_len, kv_dtype)
    # GQA/MHA: KV heads split over TP ranks, each rank's NIC carries its share; MLA: one latent on every rank.
    streams = 1 if m.is_mla else max(1, min(tp_prefill, tp_decode, m.num_kv_heads))
    share = (eff or ENGINE).comm
    time_s = total / streams / (lnk.gb_per_s * 1e9 * share)
    return KVTransfer(lnk.name, lnk.rdma or lnk.kind == "nvlink", total, streams, lnk.gb_per_s, time_s)


@dataclass(frozen=True)
class Layout:
    name: str  # "aggregated" | "disaggregated"
    gpus: int
    description: str
    tokens_per_s: float  # output tokens/s capacity of all its GPUs
    ttft_ms: float
    itl_ms: float
    prefill_gpus: int = 0
    decode_gpus: int = 0
    kv_transfer_ms: float = 0.0
    itl_prefill_share_ms: float = 0.0  # aggregated: what prefill chunks add to every decode step
    tp: int = 1  # per replica; disaggregated: both pools' (Stoker serves equal TP only)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.gpus

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu}


@dataclass(frozen=True)
class LayoutComparison:
    aggregated: Layout | None
    aggregated_reason: str
    disaggregated: Layout | None
    disaggregated_reason: str
    transfer: KVTransfer | None
    verdict: str  # "pays" | "does not pay" | "refused"
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {"aggregated": self.aggregated.as_dict() if self.aggregated else None,
                "aggregated_reason": self.aggregated_reason,
                "disaggregated": self.disaggregated.as_dict() if self.disaggregated else None,
                "disaggregated_reason": self.disaggregated_reason,
                "kv_transfer": self.transfer.as_dict() if self.transfer else None,
                "verdict": self.verdict, "reason": self.reason}


@dataclass(frozen=True)
class _Pool:
    replicas: int
    tp: int
    weight_dtype: str
    kv_dtype: str
    batch: int  # decode: max batch; prefill: tokens per step
    rate: float  # decode: output tokens/s of all replicas; prefill: prompt tokens/s of all replicas
    latency_s: float  # decode: ITL; prefill: the prompt alone

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp

    def describe(self, role: str) -> str:
        what = f"batch {self.batch}" if role == "decode" else f"{self.batch}-token steps"
        return f"{role} {self.replicas} x TP{self.tp} {self.weight_dtype}/{self.kv_dtype} KV, {what}"


def _families(m: ModelSpec, g: GPUSpec, lnk: Interconnect, t: PlanTargets, weight_dtypes: tuple[str, ...],
              kv_dtypes: tuple[str, ...]):
    for tp in TP_DEGREES:
        if _family_block(m, g, lnk, t, tp) is not None:
            continue
        for wd in weight_dtypes:
            for kvd in kv_dtypes:
                kv = family_kv(m, g, t, tp=tp, weight_dtype=wd, kv_dtype=kvd)
                if kv.kv_bytes > 0:
                    yield tp, wd, kvd, kv


def decode_pool(m: ModelSpec, g: GPUSpec, t: PlanTargets, *, link: Interconnect, eff: Efficiencies,
                weight_dtypes: tuple[str, ...], kv_dtypes: tuple[str, ...]) -> dict[tuple[str, int], _Pool]:
    """The fewest-GPU decode pool per (KV dtype, TP) meeting the ITL budget with pure decode steps."""
    best: dict[tuple[str, int], _Pool] = {}
    seq = t.prompt_len + t.output_len
    for tp, wd, kvd, kv in _families(m, g, link, t, weight_dtypes, kv_dtypes):
        for b in BATCHES:
            if b > kv.max_seqs(seq):
                break
            itl = step_cost(m, g, batch=b, context_len=t.prompt_len + t.output_len // 2, weight_dtype=wd,
                            kv_dtype=kvd, tp=tp, link=link, eff=eff, with_floor=False).step_time_s
            if t.tpot_ms is not None and itl * 1e3 > t.tpot_ms:
                break  # a bigger batch only lengthens the step
            rate = b / itl
            pool = _Pool(math.ceil(t.target_tokens_per_s / rate), tp, wd, kvd, b, 0.0, itl)
            pool = replace(pool, rate=pool.replicas * rate)
            cur = best.get((kvd, tp))
            if cur is None or (pool.gpus, -pool.rate) < (cur.gpus, -cur.rate):
                best[(kvd, tp)] = pool
    return best


def prefill_pool(m: ModelSpec, g: GPUSpec, t: PlanTargets, *, link: Interconnect, eff: Efficiencies,
                 weight_dtypes: tuple[str, ...], kv_dtypes: tuple[str, ...], kv_link: Interconnect,
                 decode_keys: set[tuple[str, int]]) -> dict[tuple[str, int], tuple[_Pool, KVTransfer]]:
    """The fewest-GPU prefill pool per (KV dtype, TP) in decode_keys -- a decode pool of the same KV dtype
    and the same TP exists -- whose TTFT (the prompt's chunks + the KV transfer to that decode replica)
    meets the budget and that keeps up with the request rate."""
    best: dict[tuple[str, int], tuple[_Pool, KVTransfer]] = {}
    prompt_rate = t.target_tokens_per_s / t.output_len * t.prompt_len  # prompt tokens/s to prefill
    step_tokens = max(t.max_num_batched_tokens, t.prompt_len)  # a whole prompt per step at least
    for tp, wd, kvd, kv in _families(m, g, link, t, weight_dtypes, kv_dtypes):
        if (kvd, tp) not in decode_keys or kv.tokens < step_tokens:  # a step's prompts must fit its KV blocks
            continue
        kw = dict(weight_dtype=wd, kv_dtype=kvd, tp=tp, link=link, eff=eff)
        alone = chunked_prefill_s(m, g, prompt_tokens=t.prompt_len, prompt_len=t.prompt_len,
                                  chunk_tokens=min(t.max_num_batched_tokens, t.prompt_len), **kw)  # type: ignore[arg-type]
        xfer = kv_transfer(m, t.prompt_len, kvd, kv_link, tp_prefill=tp, tp_decode=tp, eff=eff)
        if t.ttft_p50_ms is not None and (alone + xfer.time_s) * 1e3 > t.ttft_p50_ms:
            continue
        per_replica = step_tokens / chunked_prefill_s(m, g, prompt_tokens=step_tokens, prompt_len=t.prompt_len,
                                                      chunk_tokens=step_tokens, **kw)  # type: ignore[arg-type]
        replicas = math.ceil(prompt_rate / per_replica)
        pool = _Pool(replicas, tp, wd, kvd, step_tokens, replicas * per_replica, alone)
        cur = best.get((kvd, tp))
        if cur is None or (pool.gpus, pool.latency_s) < (cur[0].gpus, cur[0].latency_s):
            best[(kvd, tp)] = (pool, xfer)
    return best


def compare_layouts(model: ModelSpec | str, gpu: GPUSpec | str, targets: PlanTargets, *,
                    kv_link: Interconnect | str = "ib-ndr", link: Interconnect | str | None = None,
                    weight_dtypes: tuple[str, ...] | None = None, eff: Efficiencies | None = None) -> LayoutComparison:
    """Both layouts for the targets and whether disaggregation pays (module docstring)."""
    eff = eff or ENGINE
    m = get_model_spec(model) if isinstance(model, str) else model
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    lnk = get_link(link) if isinstance(link, str) else (link or g.link)
    klnk = get_link(kv_link) if isinstance(kv_link, str) else kv_link
    wds = weight_dtypes or servable_weight_dtypes(m)
    kvds = tuple(d for d in KV_DTYPES if d in servable_kv_dtypes(m))
    agg, agg_reason = _aggregated(m, g, targets, lnk, wds, eff)
    # The decode and prefill pools are sized as if GPUs were unlimited, then held to --max-gpus together.
    free = replace(targets, max_gpus=1 << 20)
    decode = decode_pool(m, g, free, link=lnk, eff=eff, weight_dtypes=wds, kv_dtypes=kvds)
    prefill = prefill_pool(m, g, free, link=lnk, eff=eff, weight_dtypes=wds, kv_dtypes=kvds, kv_link=klnk,
                           decode_keys=set(decode))
    dis, dis_reason, xfer = _disaggregated(targets, decode, prefill, m, klnk, eff)
    verdict, reason = _verdict(targets, klnk, agg, agg_reason, dis, dis_reason, xfer)
    return LayoutComparison(agg, agg_reason, dis, dis_reason, xfer, verdict, reason)


def _aggregated(m: ModelSpec, g: GPUSpec, t: PlanTargets, lnk: Interconnect, wds: tuple[str, ...],
                eff: Efficiencies) -> tuple[Layout | None, str]:
    result = plan(m, g, t, link=lnk, weight_dtypes=wds, eff=eff, kv_dtypes=servable_kv_dtypes(m))
    if not result.feasible:
        reasons = "; ".join(f"{r.family}: {r.reason}" for r in result.rejected[:3])
        return None, f"no aggregated plan meets the targets ({reasons})"
    c: Candidate = result.feasible[0]
    # What the prefill chunks add to each decode step: the same batch decoding alone.
    alone = step_cost(m, g, batch=c.max_batch, context_len=t.prompt_len + t.output_len // 2,
                      weight_dtype=c.weight_dtype, kv_dtype=c.kv_dtype, tp=c.tp, link=lnk, eff=eff,
                      with_floor=False).step_time_s
    _, ttft, _ = serving_times(m, g, t, tp=c.tp, weight_dtype=c.weight_dtype, kv_dtype=c.kv_dtype,
                               max_batch=c.max_batch, link=lnk, eff=eff)
    desc = f"{c.replicas} x TP{c.tp} {c.weight_dtype}/{c.kv_dtype} KV, batch {c.max_batch}"
    return Layout("aggregated", c.gpus, desc, c.tokens_per_s, ttft * 1e3, c.tpot_ms,
                  itl_prefill_share_ms=max(0.0, c.tpot_ms - alone * 1e3), tp=c.tp), ""


def _disaggregated(t: PlanTargets, decode: dict[tuple[str, int], _Pool],
                   prefill: dict[tuple[str, int], tuple[_Pool, KVTransfer]],
                   m: ModelSpec, klnk: Interconnect, eff: Efficiencies) -> tuple[Layout | None, str, KVTransfer | None]:
    if not decode:
        return None, "no decode pool meets the ITL budget (or the KV of one sequence does not fit)", None
    if not prefill:
        (kvd, _), d = min(decode.items(), key=lambda kv: kv[1].gpus)
        xfer = kv_transfer(m, t.prompt_len, kvd, klnk, tp_prefill=d.tp, tp_decode=d.tp, eff=eff)
        return None, (f"no prefill pool meets the TTFT budget once the KV transfer is added "
                      f"({xfer.time_s * 1e3:.1f} ms per prompt over {klnk.name}; both pools at the same TP, "
                      "as Stoker's servers refuse unequal TP)"), xfer
    # Same key, same TP on both pools: the only pairs a Stoker prefill and decode server will serve.
    options = [(decode[k], *prefill[k]) for k in prefill]
    d, p, xfer = min(options, key=lambda o: (o[0].gpus + o[1].gpus, o[1].latency_s + o[2].time_s))
    assert d.tp == p.tp, "pools are paired by (KV dtype, TP)"
    gpus = d.gpus + p.gpus
    if gpus > t.max_gpus:
        return None, (f"needs {gpus} GPUs ({p.describe('prefill')}; {d.describe('decode')}) > --max-gpus "
                      f"{t.max_gpus}"), xfer
    ttft = p.latency_s + xfer.time_s + d.latency_s  # prompt, transfer, then the first decode step
    if t.ttft_p50_ms is not None and ttft * 1e3 > t.ttft_p50_ms:
        return None, (f"TTFT {ttft * 1e3:.0f} ms > budget {t.ttft_p50_ms:g} ms: prefill {p.latency_s * 1e3:.0f} ms + KV "
                      f"transfer {xfer.time_s * 1e3:.1f} ms over {klnk.name} + the first decode step "
                      f"{d.latency_s * 1e3:.1f} ms"), xfer
    desc = f"{p.describe('prefill')}; {d.describe('decode')}"
    # The split serves what its tighter pool allows: decode's output tokens/s, or prefill's prompts x output.
    capacity = min(d.rate, p.rate / t.prompt_len * t.output_len)
    return Layout("disaggregated", gpus, desc, capacity, ttft * 1e3, d.latency_s * 1e3, p.gpus, d.gpus,
                  xfer.time_s * 1e3, tp=d.tp), "", xfer


def _verdict(t: PlanTargets, klnk: Interconnect, agg: Layout | None, agg_reason: str, dis: Layout | None,
             dis_reason: str, xfer: KVTransfer | None) -> tuple[str, str]:
    if not (klnk.rdma or klnk.kind == "nvlink") and t.prompt_len > LONG_PROMPT_TOKENS:
        took = f" (this plan's transfer: {xfer.time_s * 1e3:.0f} ms per prompt)" if xfer else ""
        return "refused", (f"{t.prompt_len}-token prompts over {klnk.name}, which has no RDMA{took}: {DYNAMO_RDMA}; "
                           f"prompts over {LONG_PROMPT_TOKENS} tokens (Dynamo's --max-local-prefill-length default) "
                           "go to the prefill pool. Serve aggregated, or give the pools an RDMA NIC (--kv-link ib-ndr)")
    if dis is None:
        return "does not pay", dis_reason
    if agg is None:
        return "pays", (f"aggregated fails ({agg_reason}); disaggregated meets the targets with {dis.gpus} GPUs: "
                        f"decode steps carry no prefill chunks (ITL {dis.itl_ms:.1f} ms), the prefill pool is sized "
                        f"for TTFT ({dis.ttft_ms:.0f} ms with {dis.kv_transfer_ms:.1f} ms of KV transfer)")
    chunks = (f"prefill chunks add {agg.itl_prefill_share_ms:.1f} ms to every aggregated decode step "
              f"(ITL {agg.itl_ms:.1f} -> {dis.itl_ms:.1f} ms split)")
    if dis.gpus < agg.gpus:
        return "pays", (f"{agg.gpus - dis.gpus} fewer GPUs ({dis.gpus} vs {agg.gpus}): {chunks}; the KV transfer "
                        f"costs {dis.kv_transfer_ms:.1f} ms of TTFT")
    if dis.gpus == agg.gpus and dis.itl_ms < 0.9 * agg.itl_ms:
        return "pays", f"same {dis.gpus} GPUs, lower ITL: {chunks}; the KV transfer costs {dis.kv_transfer_ms:.1f} ms of TTFT"
    return "does not pay", (f"{dis.gpus} GPUs split vs {agg.gpus} aggregated: {chunks}, but two pools rounded up "
                            f"separately cost more GPUs than the chunks save (and {dis.kv_transfer_ms:.1f} ms of "
                            "KV transfer per prompt)")
