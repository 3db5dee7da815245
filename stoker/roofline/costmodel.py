"""Roofline cost of one forward step, per operation, on one GPU of a tensor-parallel group.

Each op's time is max(FLOPs / (peak FLOP/s x eff), bytes / (HBM B/s x eff)) (Williams et al.
2009, "Roofline"); collectives follow `collectives.py`; launch gaps are their own op. A decode
step (the JAX scaling book's inference chapter, via facts.md) obeys
    T >= (batch x KV_bytes_per_seq + weight_bytes) / HBM_BW  and  T >= 2 x batch x params / FLOPs.

    step_cost(model, gpu, phase="decode", batch=8, context_len=1024)    -> StepCost (ops, times)
    decode_tokens_per_s(model, gpu, batch=..., context_len=..., tp=...) -> float (predicted)
    ttft_s(model, gpu, prompt_len)                                      -> prefill seconds
    crossover_batch(model, gpu, context_len=...)                        -> batch where GEMMs turn compute-bound

Precision: fp8 weights run FP8 matmuls where the GPU has FP8 cores (else weight-only, bf16
math, as Marlin kernels do on A100); int8 is W8A8 on int8 cores; int4 is weight-only (W4A16).
KV dtype defaults to bf16 whatever the weights (vLLM's kv_cache_dtype="auto").
A float32 engine (Stoker on CPU) is `weight_dtype="fp32", act_dtype="fp32"`: activations, the LM
head and the router are then 4-byte, priced at the device's fp32 rate where it has one.
`last_token_logits=True` applies the LM head to one row per prompt in prefill, as engines do
(Stoker's runner gathers `logits_indices` first); the default keeps every row (the old model).
Fixed costs: `launch_gaps` (layers x layer_overhead_s + step_overhead_s) on every step, `moe_gaps`
(sparse layers x moe_layer_overhead_s) on every step of a MoE model, and
`prefill_gaps` (layers x prefill_layer_overhead_s) once more on a step holding prefill tokens
(a prefill step, a chunk, a mixed step): efficiency.py says what each stands for.
`lora=LoRASpec(rank, max_loras)`: every sequence on an adapter; their weight reads and FLOPs are
one more op, `lora` (roofline/lora.py).
`kv_per_query_head=True`: the decode attention kernel reads each KV head's cache once per query
head of its group instead of once per group (`kv_read_factor`: an older kernel's traffic, a
property of the workload; today's engines share the reads, the default). The floor keeps one read.
Mixture-of-Experts: a step of T tokens reads, per sparse layer, the E x (1 - (1 - k/E)^T) experts
its tokens pick in expectation (ModelSpec.mlp_params_read), each in the checkpoint's expert dtype
(gpt-oss: MXFP4, 4.25 bits, weight-only: bf16 math on GPUs without FP4 cores). Parallel layouts of
the experts (`ep`, `moe_scheme`; docs/roofline.md "Mixture of Experts"):
  ep=1 (the engine's layout, docs/moe.md): tensor parallelism cuts every expert's I over the TP
      ranks, so each rank reads 1/tp of every touched expert; the partial sums ride the two
      all-reduces per layer a dense model has.
  ep=tp, moe_scheme="tp" (TP-replicated expert parallelism): every rank holds E/ep whole experts
      and sees every token (replicated activations); it reads only its touched experts, the step
      waits for the rank that touched most (expected maximum of ep binomials, experts_per_rank),
      and the combine is the same all-reduce of tokens x hidden that TP already pays.
  tp=1, ep=N, moe_scheme="dp_attention": attention and dense weights replicated, each rank decoding
      its own `batch`; the experts split over N ranks see all N x batch tokens; dispatch and
      combine are two all-to-alls per sparse layer of batch x k x hidden x 2 bytes per rank
      (collectives.py, nccl-tests' (n-1)/n bus factor). Figures are one rank's (the group's
      tokens/s is N x).
Not modelled: pipeline parallelism, the logits gather, speculative decoding; under EP the FLOPs of
the busiest rank (its share of the tokens' expert work is taken as the mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stoker.roofline.collectives import all_reduce_time, collective_time
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GPUSpec, Interconnect, get_gpu, get_link
from stoker.roofline.lora import LoRACost, LoRASpec
from stoker.roofline.modelspec import (
    ModelSpec,
    dtype_bytes,
    get_model_spec,
    normalize_dtype,
)

ACT_BYTES = 2.0  # activations stay bf16


@dataclass(frozen=True)
class OpCost:
    name: str
    op_class: str  # "gemm" | "attention" | "comm" | "overhead"
    flops: float
    bytes: float  # HBM traffic (for comm: bytes on the wire per GPU)
    time_s: float
    bound: str  # "memory" | "compute" | "communication" | "overhead"
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "op_class": self.op_class, "flops": self.flops, "bytes": self.bytes,
                "arithmetic_intensity": self.arithmetic_intensity, "time_s": self.time_s, "bound": self.bound}


@dataclass(frozen=True)
class StepCost:
    phase: str
    batch: int
    context_len: int
    tp: int
    weight_dtype: str
    kv_dtype: str
    gpu: str
    ops: tuple[OpCost, ...]
    floor_ops: tuple[OpCost, ...]  # the same step at 100% of every peak, no gaps
    chunk_tokens: int | None = None  # prefill: a chunk of this many tokens instead of whole prompts
    ep: int = 1  # expert-parallel ranks (1: experts cut by TP)
    moe_scheme: str = "tp"

    @property
    def tokens_per_step(self) -> int:
        if self.phase == "decode":
            return self.batch
        return self.chunk_tokens if self.chunk_tokens else self.batch * self.context_len

    @property
    def step_time_s(self) -> float:
        return sum(op.time_s for op in self.ops)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def latency_floor_s(self) -> float:
        """The wall: this step's time at datasheet peaks (decode: per output token per sequence)."""
        return sum(op.time_s for op in self.floor_ops)

    @property
    def ceiling_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.latency_floor_s

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops if op.op_class in ("gemm", "attention"))

    @property
    def bytes(self) -> float:
        return sum(op.bytes for op in self.ops if op.op_class in ("gemm", "attention"))

    @property
    def weight_bytes(self) -> float:
        return sum(op.weight_bytes for op in self.ops)

    @property
    def kv_bytes(self) -> float:
        return sum(op.kv_bytes for op in self.ops)

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    def time_by_bound(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for op in self.ops:
            out[op.bound] = out.get(op.bound, 0.0) + op.time_s
        return out

    @property
    def bound(self) -> str:
        """The wall taking the largest share of step time."""
        shares = self.time_by_bound()
        return max(shares, key=shares.__getitem__)

    def as_dict(self) -> dict[str, object]:
        return {
            "batch": self.batch, "phase": self.phase, "context_len": self.context_len, "tp": self.tp,
            "gpu": self.gpu, "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s / self.tp, "ceiling_tokens_per_s": self.ceiling_tokens_per_s,
            "bound": self.bound, "latency_floor_s": self.latency_floor_s,
            "arithmetic_intensity": self.arithmetic_intensity, "flops_per_gpu": self.flops,
            "bytes_per_gpu": self.bytes, "ops": [op.as_dict() for op in self.ops],
        }


def compute_dtype(weight_dtype: str, gpu: GPUSpec) -> str:
    """Which tensor cores the matmuls use for a weight dtype on this GPU."""
    if weight_dtype == "fp32" and gpu.fp32_tflops:
        return "fp32"
    if weight_dtype == "fp8" and gpu.fp8_tflops:
        return "fp8"
    if weight_dtype == "int8" and gpu.int8_tops:
        return "int8"
    return "bf16"


def _resolve(model: ModelSpec | str, gpu: GPUSpec | str) -> tuple[ModelSpec, GPUSpec]:
    return (get_model_spec(model) if isinstance(model, str) else model,
            get_gpu(gpu) if isinstance(gpu, str) else gpu)


def kv_read_factor(m: ModelSpec, tp: int = 1, per_query_head: bool = False) -> float:
    """How many times a decode step reads each cached K/V byte of one GPU's KV heads from HBM.

    1 (the default) where the decode attention kernel reads a KV head once for all the query heads
    of its group: FlashAttention/FlashInfer-style kernels, TensorRT-LLM's XQA kernel ("reducing data
    loading", docs/source/blogs/XQA-kernel.md), vLLM's paged attention today. With
    `per_query_head=True`, once per query head: the query heads per GPU over the KV heads per GPU
    (8 for Llama-2-70B at any TP up to 8; 1 for an MHA model, whatever the kernel). That is how
    TensorRT-LLM's masked multi-head attention kernel runs the generation phase: "a single CUDA
    thread-block per head" (docs/source/gpt_attention.md "Generation Phase" @138f96d), "a threadblock
    for B x H pair" with H the query heads, each block loading its KV head's keys and values
    (cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/decoderMaskedMultiheadAttentionTemplate.h);
    and how gpt-fast's model.py runs GQA (k and v .repeat_interleave(n_head // n_local_heads) before
    scaled_dot_product_attention; read at commit 03e10bc). Priced as HBM traffic: an upper bound, since some repeats may be
    served from L2; the floor (the wall) keeps one read per group."""
    if not per_query_head:
        return 1.0
    return (m.num_heads / tp) / math.ceil(m.num_kv_heads / tp)


MOE_SCHEMES = ("tp", "dp_attention")


def experts_per_rank(m: ModelSpec, tokens: float, ep: int, redundant: int = 0) -> float:
    """Touched experts of one sparse layer on the busiest of `ep` ranks, each holding E/ep whole
    experts, for a step of `tokens` tokens: each expert is touched with p = 1 - (1 - k/E)^tokens
    (ModelSpec.experts_touched / E), taken independently, so a rank's count is Binomial(E/ep, p)
    and the step waits on the expected maximum over ranks, sum_j P(max >= j) = sum_j 1 - F(j-1)^ep.
    ep=1: experts_touched(tokens). `redundant`: extra copies of experts (SGLang's
    --ep-num-redundant-experts, EPLB), so each rank holds (E + redundant) / ep; a copy is taken to be
    touched as often as an expert (load balancing splits the work, not the touch)."""
    if ep == 1 or not m.is_moe:
        return m.experts_touched(tokens)
    n = (m.num_experts + redundant) // ep
    p = min(1.0, max(0.0, m.experts_touched(tokens) / m.num_experts))
    pmf = [math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(n + 1)]
    cdf, expected_max = 0.0, 0.0
    for j in range(1, n + 1):
        cdf += pmf[j - 1]  # P(count <= j - 1)
        expected_max += 1.0 - min(1.0, cdf) ** ep
    return expected_max


def _op(name: str, op_class: str, flops: float, nbytes: float, peak: float, bw: float,
        eff_c: float, eff_m: float, w: float = 0.0, kv: float = 0.0) -> OpCost:
    t_c, t_m = flops / (peak * eff_c), nbytes / (bw * eff_m)
    return OpCost(name, op_class, flops, nbytes, max(t_c, t_m), "compute" if t_c > t_m else "memory", w, kv)


def _ops(m: ModelSpec, g: GPUSpec, phase: str, batch: int, ctx: int, wd: str, kvd: str, tp: int,
         link: Interconnect, eff: Efficiencies, chunk: int | None = None, overlap: bool = False,
         act_dtype: str = "bf16", last_token_logits: bool = False, lora: LoRASpec | None = None,
         kv_per_query_head: bool = False, ep: int = 1, moe_scheme: str = "tp",
         redundant_experts: int = 0) -> tuple[OpCost, ...]:
    tokens = batch if phase == "decode" else (chunk or batch * ctx)
    # Mean context a query attends to: all `ctx` in decode, half on average in causal prefill.
    attn_ctx = ctx if phase == "decode" else ctx / 2
    # Decode reads every sequence's whole KV (once per query head with an older kernel: kv_read_factor);
    # prefill writes it (flash-attention keeps scores on chip).
    # A sliding-window layer holds and reads at most its window (ModelSpec.kv_context).
    kv_tokens = batch * m.kv_context(ctx) * kv_read_factor(m, tp, kv_per_query_head) if phase == "decode" else tokens
    # Sequences in the step (each on its own adapter): a chunk holds chunk / ctx prompts, at least one.
    seqs = max(batch, -(-chunk // ctx)) if chunk else batch
    lora_cost = LoRACost.of(m, lora, tp=tp, seqs=seqs, tokens=tokens, act_dtype=act_dtype) if lora else None
    return _token_ops(m, g, tokens, attn_ctx, kv_tokens, batch if last_token_logits else tokens, wd, kvd, tp, link,
                      eff, overlap, act_dtype, prefill=phase == "prefill", lora=lora_cost, ep=ep, moe_scheme=moe_scheme,
                      redundant_experts=redundant_experts)


def _token_ops(m: ModelSpec, g: GPUSpec, tokens: int, attn_ctx: float, kv_tokens: float, logit_rows: int, wd: str,
               kvd: str, tp: int, link: Interconnect, eff: Efficiencies, overlap: bool = False,
               act_dtype: str = "bf16", *, prefill: bool = False, lora: LoRACost | None = None,
               ep: int = 1, moe_scheme: str = "tp", redundant_experts: int = 0) -> tuple[OpCost, ...]:
    """The ops of a step computing `tokens` tokens that attend to `attn_ctx` positions on average,
    moving `kv_tokens` tokens' K/V, with `logit_rows` rows of logits. `prefill`: the step holds
    prompt (context) tokens, and pays the per-layer context setup (eff.prefill_layer_overhead_s).
    `lora`: the step's adapters (roofline/lora.py), one more op. `ep`, `moe_scheme`: the experts'
    layout (module docstring); under "dp_attention" `tokens` are one rank's."""
    act_bytes = dtype_bytes(act_dtype)  # activations, and the unquantized LM head and router
    fpt = m.flops_per_token(attn_ctx, absorbed=not prefill)  # MLA: absorbed decode, expanded prefill
    lp, L = m.layer_params, m.num_layers
    wb, peak, bw = dtype_bytes(wd), g.peak_flops(compute_dtype(wd, g)), g.hbm_bytes_per_s
    # MoE: per sparse layer only the experts some token in the step picked, in expectation
    # E x (1 - (1 - k/E)^tokens) (ModelSpec.mlp_params_read, the spec's decode_weight_bytes).
    dense_read = m.mlp_params_read(tokens, "dense")
    # The tokens the experts see: under DP attention every rank's (ep x tokens), else the step's.
    routed = tokens * ep if moe_scheme == "dp_attention" else tokens
    expert_read = m.mlp_params_read(routed, "experts")
    eb = m.expert_bytes_per_param(wd)
    if ep > 1:
        # Whole experts per rank: the busiest rank's touched experts, read by it alone (no 1/tp cut).
        busiest = experts_per_rank(m, routed, ep, redundant_experts) / m.experts_touched(routed) if m.is_moe else 0.0
        expert_w = {k: v * busiest * eb for k, v in expert_read.items()}
    else:
        expert_w = {k: v * eb / tp for k, v in expert_read.items()}  # TP cuts every expert's I

    act_peak = g.peak_flops(compute_dtype(normalize_dtype(act_dtype), g))

    def gemm(name: str, params: float, d_in: float, d_out: float, bytes_per_param: float, rows: float = tokens,
             extra_w: float = 0.0) -> OpCost:
        w = params * bytes_per_param / tp + extra_w  # extra_w: routed experts' bytes on this rank
        act = rows * (d_in + d_out) * act_bytes / tp
        weight_math = bytes_per_param != act_bytes
        # The share of peak is per tensor-core dtype (Efficiencies.gemm_share: 8-bit cores have their own).
        share = eff.gemm_share(compute_dtype(wd, g) if weight_math else compute_dtype(normalize_dtype(act_dtype), g))
        return _op(name, "gemm", rows * fpt[name] / tp, w + act, peak if weight_math else act_peak,
                   bw, share, eff.memory, w=w)

    h, i_active = m.hidden_size, m.active_intermediate_size()
    ops = [
        gemm("qkv_proj", L * lp["qkv_proj"], h, m.q_dim + 2 * m.kv_dim, wb),
        gemm("o_proj", L * lp["o_proj"], m.q_dim, h, wb),
    ]
    if m.is_moe:
        ops.append(gemm("router", m.num_sparse_layers * lp["router"], h, m.num_experts, act_bytes))
    ops += [
        gemm("mlp_gate_up", dense_read["mlp_gate_up"], h, 2 * i_active, wb, extra_w=expert_w["mlp_gate_up"]),
        gemm("mlp_down", dense_read["mlp_down"], i_active, h, wb, extra_w=expert_w["mlp_down"]),
        gemm("lm_head", m.vocab_size * h, h, m.vocab_size, act_bytes, rows=logit_rows),
    ]
    if lora is not None:
        # Every token's shrink and expand on its own adapter, each adapter's weights read once per
        # step, in the activation dtype on its tensor cores (lora.py).
        act_cd = compute_dtype(normalize_dtype(act_dtype), g)
        ops.append(_op("lora", "gemm", lora.flops, lora.bytes, act_peak, bw, eff.gemm_share(act_cd), eff.memory,
                       w=lora.weight_bytes))
    # Attention: KV heads split over TP ranks (replicated when tp > kv heads).
    kv = kv_tokens * m.kv_bytes_per_token(kvd, tp)
    q_io = 2 * tokens * m.q_dim * act_bytes * L / tp
    ops.append(_op("attention", "attention", tokens * fpt["attention"] / tp, kv + q_io, act_peak, bw,
                   eff.attention_compute, eff.memory, kv=kv))
    if tp > 1:
        # Megatron TP: two all-reduces per layer (after o_proj and after mlp_down), each
        # tokens x hidden x 2 bytes (Shoeybi et al. 2019, via facts.md). The fastest of NCCL ring,
        # tree and the custom one-/two-shot kernel engines run on NVLink (collectives.py).
        ar = all_reduce_time(tokens * h * act_bytes, tp, link, efficiency=eff.comm)
        comm_s = 2 * L * (ar.time_s + eff.comm_latency_s)
        if overlap:
            # Overlapped with compute (as TensorRT-LLM's and SGLang's GEMM + all-reduce fusions
            # try): only the part longer than the step's other work is exposed.
            comm_s = max(0.0, comm_s - sum(op.time_s for op in ops))
        ops.append(OpCost("all_reduce", "comm", 0.0, 2 * L * ar.size_bytes, comm_s, "communication"))
    if moe_scheme == "dp_attention" and ep > 1 and m.is_moe:
        # DP attention + EP: each rank sends its tokens' k copies of the hidden state to the experts'
        # ranks and gets them back: two all-to-alls per sparse layer of tokens x k x hidden x 2 bytes.
        a2a = collective_time("all_to_all", tokens * m.num_experts_per_tok * h * act_bytes, ep, link,
                              efficiency=eff.comm)
        comm_s = 2 * m.num_sparse_layers * (a2a.time_s + eff.comm_latency_s)
        if overlap:
            # Two-batch overlap (SGLang's TBO, DeepSeek's inference system): one micro-batch's dispatch and
            # combine run under the other's compute; only what outlasts the step's other work is exposed.
            comm_s = max(0.0, comm_s - sum(op.time_s for op in ops))
        ops.append(OpCost("all_to_all", "comm", 0.0, 2 * m.num_sparse_layers * a2a.size_bytes, comm_s,
                          "communication"))
    gaps = L * eff.layer_overhead_s + eff.step_overhead_s
    if gaps > 0:
        ops.append(OpCost("launch_gaps", "overhead", 0.0, 0.0, gaps, "overhead"))
    if m.is_moe and eff.moe_layer_overhead_s > 0:
        # The fused-MoE kernels' fixed cost per sparse layer beyond the experts' bytes (sort and
        # pad, grouped GEMMs of few rows): published kernel timings, moe_kernels.py.
        ops.append(OpCost("moe_gaps", "overhead", 0.0, 0.0, m.num_sparse_layers * eff.moe_layer_overhead_s, "overhead"))
    if prefill and eff.prefill_layer_overhead_s > 0:
        # A fixed cost per layer of a step holding context tokens, beside the launch gaps every
        # step pays: TensorRT-LLM's first-token latency at 128 tokens (performance.md, v0.5) sits
        # 1.6-1.8x above a forward pass the 2048-token rows fit, a gap that grows with layers
        # (efficiency.py, profiles.py: what it is thought to be, and the fit).
        ops.append(OpCost("prefill_gaps", "overhead", 0.0, 0.0, L * eff.prefill_layer_overhead_s, "overhead"))
    return tuple(ops)


def step_cost(
    model: ModelSpec | str,
    gpu: GPUSpec | str,
    *,
    phase: str = "decode",
    batch: int = 1,
    context_len: int = 1024,
    weight_dtype: str = "bf16",
    kv_dtype: str | None = None,
    tp: int = 1,
    link: Interconnect | str | None = None,
    eff: Efficiencies | None = None,
    chunk_tokens: int | None = None,
    overlap_comm: bool = False,
    act_dtype: str = "bf16",
    last_token_logits: bool = False,
    lora: LoRASpec | None = None,
    kv_per_query_head: bool = False,
    with_floor: bool = True,
    ep: int = 1,
    moe_scheme: str = "tp",
    redundant_experts: int = 0,
) -> StepCost:
    """One step: decode (`batch` sequences, one new token each, `context_len` cached) or prefill
    (`batch` prompts of `context_len` tokens; with `chunk_tokens`, one chunk of that many prompt
    tokens, attending on average to half a `context_len` prompt, as chunked prefill runs it).
    `overlap_comm` hides TP all-reduce time under the step's compute (prediction and floor).
    `act_dtype`, `last_token_logits`: see the module docstring (a float32 CPU engine).
    `lora`: every sequence on a LoRA adapter of that rank (at most max_loras distinct in a
    step): the adapters' weight reads and FLOPs are one more op (roofline/lora.py).
    `kv_per_query_head`: decode attention reads each KV head once per query head (kv_read_factor:
    an older kernel, e.g. TensorRT-LLM v0.6.1's masked MHA); the floor keeps one read per group.
    `with_floor=False`: floor_ops left empty (half the work; for callers that read only the time).
    `ep`, `moe_scheme`: expert parallelism (module docstring): "tp" needs ep 1 or ep == tp;
    "dp_attention" needs tp 1, and prices one rank of `ep`, each decoding `batch` sequences.
    `redundant_experts`: extra expert copies spread over the EP ranks (experts_per_rank).
    `overlap_comm` also hides the all-to-all under the step's compute (two-batch overlap)."""
    m, g = _resolve(model, gpu)
    _check_ep(m, tp, ep, moe_scheme, redundant_experts)
    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase must be decode or prefill, not {phase!r}")
    if batch < 1 or context_len < 1 or tp < 1:
        raise ValueError("batch, context_len and tp must be >= 1")
    if m.num_heads % tp:
        raise ValueError(f"--tp {tp} does not divide {m.name}'s {m.num_heads} attention heads")
    dtype_bytes(weight_dtype)
    kvd = kv_dtype or "bf16"
    dtype_bytes(kvd)
    lnk = get_link(link) if isinstance(link, str) else (link or g.link)
    if max(tp, ep) > 1 and lnk.kind == "none":
        raise ValueError(f"{g.name} has no GPU-GPU link for --tp {tp}; pass --link (e.g. pcie4) or use tp 1")
    if chunk_tokens is not None and (phase != "prefill" or chunk_tokens < 1):
        raise ValueError("chunk_tokens applies to prefill and must be >= 1")
    dtype_bytes(act_dtype)
    args = (m, g, phase, batch, context_len, normalize_dtype(weight_dtype), kvd, tp, lnk)
    extra = (chunk_tokens, overlap_comm, act_dtype, last_token_logits, lora)
    moe = dict(ep=ep, moe_scheme=moe_scheme, redundant_experts=redundant_experts)
    # The floor reads each KV byte once (repeats a kernel makes may come from L2): it stays a wall.
    return StepCost(phase, batch, context_len, tp, weight_dtype, kvd, g.name,
                    _ops(*args, eff or Efficiencies(), *extra, kv_per_query_head, **moe),
                    _ops(*args, Efficiencies.ideal(), *extra, **moe) if with_floor else (), chunk_tokens,
                    ep, moe_scheme)


def _check_ep(m: ModelSpec, tp: int, ep: int, scheme: str, redundant: int = 0) -> None:
    if scheme not in MOE_SCHEMES:
        raise ValueError(f"moe_scheme must be one of {MOE_SCHEMES}, not {scheme!r}")
    if ep < 1:
        raise ValueError("ep must be >= 1")
    if ep == 1:
        return
    if not m.is_moe:
        raise ValueError(f"--ep {ep}: {m.name} has no experts")
    if redundant < 0:
        raise ValueError("redundant_experts must be >= 0")
    if (m.num_experts + redundant) % ep:
        extra = f" + {redundant} redundant" if redundant else ""
        raise ValueError(f"--ep {ep} does not divide {m.name}'s {m.num_experts}{extra} experts")
    if scheme == "tp" and ep != tp:
        raise ValueError(f"TP-replicated expert parallelism runs on the TP group: ep ({ep}) must equal tp ({tp})")
    if scheme == "dp_attention" and tp != 1:
        raise ValueError("DP attention replicates attention on every expert-parallel rank: tp must be 1")


def decode_tokens_per_s(model: ModelSpec | str, gpu: GPUSpec | str, *, batch: int, context_len: int,
                        weight_dtype: str = "bf16", kv_dtype: str | None = None, tp: int = 1,
                        link: Interconnect | str | None = None, eff: Efficiencies | None = None,
                        kv_per_query_head: bool = False) -> float:
    """Predicted output tokens/s of one TP group decoding `batch` sequences at `context_len`."""
    return step_cost(model, gpu, phase="decode", batch=batch, context_len=context_len, weight_dtype=weight_dtype,
                     kv_dtype=kv_dtype, tp=tp, link=link, eff=eff, kv_per_query_head=kv_per_query_head,
                     with_floor=False).tokens_per_s


def ttft_s(model: ModelSpec | str, gpu: GPUSpec | str, prompt_len: int, *, weight_dtype: str = "bf16",
           kv_dtype: str | None = None, tp: int = 1, link: Interconnect | str | None = None,
           eff: Efficiencies | None = None) -> float:
    """Prefill time of one prompt alone on the group: the floor of time to first token."""
    return step_cost(model, gpu, phase="prefill", batch=1, context_len=prompt_len, weight_dtype=weight_dtype,
                     kv_dtype=kv_dtype, tp=tp, link=link, eff=eff, with_floor=False).step_time_s


def crossover_batch(model: ModelSpec | str, gpu: GPUSpec | str, *, context_len: int = 1024,
                    weight_dtype: str = "bf16", kv_dtype: str | None = None, tp: int = 1,
                    link: Interconnect | str | None = None, limit: int = 1 << 16,
                    act_dtype: str = "bf16", lm_head: bool = True) -> int | None:
    """Smallest decode batch at which the weight matmuls become compute-bound (cross the ridge),
    at datasheet peaks; None if not by `limit`. Attention never crosses: its FLOPs grow with KV.
    `lm_head=False`: a model that computes no logits (an encoder or embedding model: pooling
    reads the hidden states), whose crossover is its projections' alone; counted, a vocabulary
    of 30k rows x every token is compute-bound from a handful of tokens and moves the answer."""
    def crossed(b: int) -> bool:
        s = step_cost(model, gpu, batch=b, context_len=context_len, weight_dtype=weight_dtype,
                      kv_dtype=kv_dtype, tp=tp, link=link, eff=Efficiencies.ideal(), act_dtype=act_dtype)
        gemms = [op for op in s.ops if op.op_class == "gemm" and (lm_head or op.name != "lm_head")]
        return sum(op.time_s for op in gemms if op.bound == "compute") > sum(op.time_s for op in gemms) / 2
    if not crossed(limit):
        return None
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if crossed(mid) else (mid + 1, hi)
    return lo


def mixed_step_cost(
    model: ModelSpec | str,
    gpu: GPUSpec | str,
    *,
    prefill_tokens: int,
    prefill_attended: int,
    decode_seqs: int,
    decode_context: int,
    logits_rows: int,
    weight_dtype: str = "bf16",
    kv_dtype: str | None = None,
    tp: int = 1,
    link: Interconnect | str | None = None,
    eff: Efficiencies | None = None,
    act_dtype: str = "bf16",
    with_floor: bool = True,
    draft_tokens: int = 0,
    draft_attended: int = 0,
) -> StepCost:
    """One step of a continuous-batching engine as it ran: prefill chunks (`prefill_tokens`
    tokens attending `prefill_attended` positions in all) beside `decode_seqs` decodes reading
    `decode_context` cached tokens in all, weights read once. Speculative decoding: the decodes
    also verify `draft_tokens` drafted tokens attending `draft_attended` positions in all (the
    context their decode reads): more tokens through the same weight read, no context setup.
    The server prices every step with it (roofline/live.py), without the floor
    (`with_floor=False`: floor_ops empty, half the work on the engine thread)."""
    m, g = _resolve(model, gpu)
    tokens = prefill_tokens + decode_seqs + draft_tokens
    if tokens < 1 or logits_rows < 0:
        raise ValueError("a step computes at least one token")
    attn_ctx = (prefill_attended + decode_context + draft_attended) / tokens
    # Prefill and drafts write their tokens' K/V; decodes read theirs (a sliding-window layer at
    # most its window, the mean context per sequence taken for every sequence).
    kv_tokens = prefill_tokens + draft_tokens + (
        decode_seqs * m.kv_context(decode_context / decode_seqs) if decode_seqs else decode_context)
    kvd = kv_dtype or "bf16"
    lnk = get_link(link) if isinstance(link, str) else (link or g.link)
    wd = normalize_dtype(weight_dtype)
    args = (m, g, tokens, attn_ctx, kv_tokens, max(logits_rows, 1), wd, kvd, tp, lnk)
    phase = "decode" if prefill_tokens == 0 else "prefill"
    batch = decode_seqs if prefill_tokens == 0 else 1
    prefill = prefill_tokens > 0  # a mixed step holds context tokens: it pays the context setup once
    return StepCost(phase, batch, max(round(attn_ctx), 1), tp, weight_dtype, kvd, g.name,
                    _token_ops(*args, eff or Efficiencies(), False, act_dtype, prefill=prefill),
                    _token_ops(*args, Efficiencies.ideal(), False, act_dtype, prefill=prefill) if with_floor else (),
                    tokens if prefill_tokens else None)
