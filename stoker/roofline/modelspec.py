"""Model architecture -> parameters by component, weight bytes, KV bytes per token, FLOPs per token.

Entry points (the fleet planner sizes memory with the first two):
    spec = get_model_spec("llama-3-70b")          # preset, HF repo id, checkpoint dir or config.json
    spec.weight_bytes("fp8")                       # bytes of all weights stored in that dtype
    spec.kv_bytes_per_token("bf16")                # 2 x layers x kv_heads x head_dim x bytes
    spec.flops_per_token(context_len)              # forward FLOPs per token, by operation
Throughput for a deployment is `costmodel.decode_tokens_per_s(...)`.

Dtypes: bf16/fp16 2 bytes; fp8/int8 1 byte; int4 0.5 byte + one 16-bit scale per group of 128
(GPTQ/AWQ's common group size; `weight_bytes("int4")` prices the spec's own int4 layout, a
4-bit checkpoint's groups and zero points, as the engine holds it); mxfp4 4.25 bits (4-bit E2M1 values + one 8-bit E8M0 scale per
block of 32, the OCP Microscaling format gpt-oss ships its experts in: (32 x 4 + 8) / 32 bits). Quantized checkpoints keep embeddings and lm_head in 16 bits
(vLLM's FP8 and GPTQ/AWQ checkpoints leave them unquantized), so `weight_bytes` does too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from stoker.roofline.presets import ALIASES, PRESETS
from stoker.roofline.text_config import is_multimodal, text_model_config

INT4_GROUP_SIZE = 128
# Stoker's int4 method (layers/int4_method.py; the cpu_q4 and triton_w4a16 backends alike) holds,
# per output row and group, a scale in float16 where every scale of the layer is exact in it
# (GPTQ's and AWQ's float16 scales, online int4's) else float32 (GGUF Q4_K's products of two
# scales), and, for asymmetric weights only (AWQ, GPTQ sym false, compressed-tensors with zero
# points, GGUF Q4_K / Q4_1), a float32 offset: 2 bytes symmetric with float16 scales, 6
# asymmetric, 4 and 8 with float32 scales.
# On CUDA with a bfloat16 model, layers held in torch's tinygemm layout (kernels/tinygemm_int4.py)
# hold a bfloat16 scale and a bfloat16 zero per group whether symmetric or not: "tinygemm", 4.
INT4_SCALE_BYTES = {"fp16": 2.0, "fp32": 4.0, "tinygemm": 4.0}
INT4_OFFSET_BYTES = 4.0
MX_BLOCK_SIZE = 32  # OCP MX: one shared E8M0 (8-bit) scale per 32 elements
NVFP4_BLOCK_SIZE = 16  # NVIDIA NVFP4: E2M1 values, one FP8 E4M3 scale per 16 (plus one FP32 per tensor)
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0,
    "int4": 0.5 + 2.0 / INT4_GROUP_SIZE,
    "mxfp4": 0.5 + 1.0 / MX_BLOCK_SIZE,  # 4.25 bits
    "nvfp4": 0.5 + 1.0 / NVFP4_BLOCK_SIZE,  # 4.5 bits
}
WEIGHT_DTYPES = ("bf16", "fp8", "int8", "int4")
KV_DTYPES = ("bf16", "fp8")


# Whole-name aliases, as torch and vLLM spell dtypes (a substring replace would turn
# "bfloat16" into "bfp16").
_DTYPE_ALIASES = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                  "float": "fp32", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8_e4m3fn": "fp8", "float8": "fp8"}


def normalize_dtype(dtype: str) -> str:
    """A dtype name as users write it ("bfloat16", "auto", "fp8_e4m3") -> the tables' key ("bf16")."""
    key = dtype.strip().lower()
    return _DTYPE_ALIASES.get(key, key)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str, kv_tensors: int = 2) -> float:
    """K and V of every layer for one token: 2 x layers x kv_heads x head_dim x element bytes.
    The one formula the planner and the engine's cache sizing both use. `kv_tensors` 1: one
    cache per layer (multi-head latent attention: 1 "head" of kv_lora_rank + qk_rope_head_dim)."""
    return kv_tensors * num_layers * num_kv_heads * head_dim * dtype_bytes(kv_dtype)


# Quantized weights carry one float32 scale per output row (per-channel, what --quantization
# fp8/int8 writes): 4 bytes per row of every quantized projection.
SCALE_BYTES_PER_ROW = {"fp8": 4.0, "int8": 4.0}


def dtype_bytes(dtype: str) -> float:
    key = normalize_dtype(dtype)
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer shape (Llama/Qwen/Mixtral family: GQA attention, gated MLP).

    Mixture-of-Experts: `num_experts` routed experts of `moe_intermediate_size` (0: of
    `intermediate_size`, as Mixtral's config says it) on `num_layers - num_dense_layers`
    sparse layers, `num_experts_per_tok` of them per token, plus an always-taken shared expert
    of `shared_expert_intermediate_size` with a one-logit sigmoid gate (Qwen2-MoE) or without
    one (`shared_expert_gate` false: GLM-4.5, DeepSeek-V3); the dense layers (Qwen-MoE's
    `mlp_only_layers` / `decoder_sparse_step`, DeepSeek's `first_k_dense_replace`) have an MLP
    of `intermediate_size`. `router_bias`: one more float per expert in the router (GLM-4.5's
    `e_score_correction_bias`, gpt-oss's router bias). gpt-oss also has biases on o_proj
    (`o_proj_bias`) and on every expert (`expert_bias`: 2I + H each), and one sink logit per
    head and layer (`attention_sinks`).
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's; per expert for MoE when moe_intermediate_size is 0
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 1  # 1 = dense
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = True  # a one-logit sigmoid gate on the shared expert (Qwen2-MoE)
    router_bias: bool = False  # a float per expert beside the router's weight
    expert_bias: bool = False  # gpt-oss: biases on each expert's gate/up (2I) and down (H)
    o_proj_bias: bool = False
    attention_sinks: bool = False  # gpt-oss: one learned logit per head and layer
    num_dense_layers: int = 0  # layers of a MoE model whose MLP is dense
    attention_bias: bool = False  # on q, k and v
    qk_norm: bool = False
    qk_norm_per_head: bool = True  # False: over the whole q and k projections (OLMoE, OLMo 2)
    # RMSNorms of hidden_size per layer: 2 (before attention and before the MLP); Gemma 2 / 3 also
    # normalise after each (4).
    norms_per_layer: int = 2
    # Sliding-window attention on `num_sliding_layers` of the layers (gpt-oss: every other one,
    # config.json `layer_types`): those layers attend to, and hold K/V of, at most `sliding_window` tokens.
    sliding_window: int = 0
    num_sliding_layers: int = 0
    # Routed experts stored in their own dtype whatever the rest (gpt-oss: "mxfp4", from
    # quantization_config.quant_method; attention, router, embeddings and LM head stay 16-bit).
    expert_dtype: str = ""
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), when kv_lora_rank > 0: q through a
    # rank-`q_lora_rank` bottleneck (0: a plain q_proj), K/V from one latent of kv_lora_rank
    # plus a shared rope key of qk_rope_head_dim, which is all the KV cache holds per token and
    # layer (replicated over TP ranks); head_dim is then qk_nope_head_dim + qk_rope_head_dim.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # The dtype the checkpoint ships its projections in, where it ships them quantized ("fp8": DeepSeek-V3's
    # and Kimi-K2's block-FP8, quantization_config quant_method "fp8"); "" for a float checkpoint.
    checkpoint_dtype: str = ""
    # The int4 layout `weight_bytes("int4")` prices: groups of `int4_group_size` input columns
    # (None: per channel, one group of K) and, not symmetric, an offset per group. The default is
    # `--quantization int4` (round-to-nearest, symmetric, groups of 128); an AWQ / GPTQ /
    # compressed-tensors W4A16 checkpoint's quantization_config gives its own (checkpoint_int4).
    int4_group_size: int | None = INT4_GROUP_SIZE
    int4_symmetric: bool = True
    published_params: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads {self.num_heads} not a multiple of kv heads {self.num_kv_heads}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.name}: num_experts_per_tok must be in [1, num_experts]")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(f"{self.name}: num_dense_layers must be in [0, num_layers]")
        if not 0 <= self.num_sliding_layers <= self.num_layers or (self.num_sliding_layers and self.sliding_window < 1):
            raise ValueError(f"{self.name}: sliding layers must be in [0, num_layers], with a window >= 1")
        if self.expert_dtype:
            dtype_bytes(self.expert_dtype)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def mla_latent_dim(self) -> int:
        """Values one MLA layer caches per token: the latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def _mla_params(self) -> tuple[int, int, int]:
        """(q, k/v, o) parameters of one MLA layer: q_a + q_b (or q_proj), kv_a_proj_with_mqa +
        kv_b_proj, o_proj; biases (`attention_bias`) on q_a, kv_a and o. The two latent norms
        are in `norms`."""
        h, H, qr = self.hidden_size, self.num_heads, self.q_lora_rank
        q_cols = H * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        q = h * qr + qr * q_cols + (qr if self.attention_bias else 0) if qr else h * q_cols
        kv = (h * self.mla_latent_dim + self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim)
              + (self.mla_latent_dim if self.attention_bias else 0))
        o = H * self.v_head_dim * h + (h if self.attention_bias else 0)
        return q, kv, o

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qk_norm_params(self) -> int:
        return 2 * self.head_dim if self.qk_norm_per_head else self.q_dim + self.kv_dim

    # ---- Mixture-of-Experts shape ------------------------------------------------------------
    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def num_sparse_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def expert_params(self) -> int:
        """One routed expert of one layer: gate, up and down (and their biases, gpt-oss)."""
        i = self.expert_intermediate_size
        return 3 * self.hidden_size * i + (2 * i + self.hidden_size if self.expert_bias else 0)

    def experts_touched(self, tokens: float) -> float:
        """Experts of one sparse layer that at least one of `tokens` tokens picks, in expectation,
        each token choosing k of E uniformly: E x (1 - (1 - k/E)^tokens) (a real router is
        skewed, so this is an upper bound on the mean). 1 for a dense model."""
        if not self.is_moe:
            return 1.0
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** tokens)

    # ---- parameters, per layer and by component -------------------------------------------
    @property
    def layer_params(self) -> dict[str, int]:
        """Parameters of one decoder layer by matmul (+ norms); a MoE model's sparse layer, all
        experts counted, with its shared expert in the mlp entries."""
        h = self.hidden_size
        qkv = h * (self.q_dim + 2 * self.kv_dim) + (self.q_dim + 2 * self.kv_dim if self.attention_bias else 0)
        o_proj = self.q_dim * h + (h if self.o_proj_bias else 0)
        latent_norms = 0
        if self.is_mla:
            q, kv, o_proj = self._mla_params()
            qkv, latent_norms = q + kv, self.q_lora_rank + self.kv_lora_rank
        if self.is_moe:
            e, i, s = self.num_experts, self.expert_intermediate_size, self.shared_expert_intermediate_size
            gate_up, down = 2 * h * (i * e + s), h * (i * e + s)
            router = h * e + (e if self.router_bias else 0) + (h if s and self.shared_expert_gate else 0)
        else:
            gate_up, down, router = 2 * h * self.intermediate_size, h * self.intermediate_size, 0
        return {
            "qkv_proj": qkv,
            "o_proj": o_proj,
            "router": router,
            "mlp_gate_up": gate_up,
            "mlp_down": down,
            "norms": self.norms_per_layer * h + (self.qk_norm_params if self.qk_norm else 0) + (self.num_heads if self.attention_sinks else 0)
            + latent_norms,
        }

    def param_counts(self) -> dict[str, int]:
        """Whole-model parameters by component: embedding, attention, mlp (dense MLPs and shared
        experts), experts (routed), router, norms, lm_head."""
        lp, h = self.layer_params, self.hidden_size
        emb = self.vocab_size * h
        sparse, dense = self.num_sparse_layers, self.num_layers - self.num_sparse_layers
        experts = sparse * self.num_experts * self.expert_params if self.is_moe else 0
        return {
            "embedding": emb,
            "attention": self.num_layers * (lp["qkv_proj"] + lp["o_proj"]),
            "mlp": dense * 3 * h * self.intermediate_size + sparse * 3 * h * self.shared_expert_intermediate_size,
            "experts": experts,
            "router": sparse * lp["router"],
            "norms": self.num_layers * lp["norms"] + h,
            "lm_head": 0 if self.tie_word_embeddings else emb,
        }

    @property
    def num_params(self) -> int:
        return sum(self.param_counts().values())

    @property
    def num_active_params(self) -> int:
        """Parameters one token touches (MoE: only its top-k experts)."""
        # Counted as Mistral counts Mixtral's "12.9B active": everything but the idle experts.
        idle = self.num_sparse_layers * (self.num_experts - self.num_experts_per_tok) * self.expert_params
        return self.num_params - idle

    def mlp_params_read(self, tokens: float, part: str = "all") -> dict[str, float]:
        """MLP weights a step of `tokens` tokens reads, by matmul (mlp_gate_up, mlp_down): the
        dense layers' and shared experts' whole, and per sparse layer the experts it touches.
        `part`: "dense" (dense MLPs and shared experts only), "experts" (routed experts only) or "all"."""
        if part not in ("all", "dense", "experts"):
            raise ValueError(f"part must be all, dense or experts, not {part!r}")
        h, sparse = self.hidden_size, self.num_sparse_layers
        dense_cols = (self.num_layers - sparse) * self.intermediate_size + sparse * self.shared_expert_intermediate_size
        expert_cols = sparse * self.experts_touched(tokens) * self.expert_intermediate_size if self.is_moe else 0.0
        cols = {"all": dense_cols + expert_cols, "dense": dense_cols, "experts": expert_cols}[part]
        return {"mlp_gate_up": 2.0 * h * cols, "mlp_down": 1.0 * h * cols}

    def expert_bytes_per_param(self, dtype: str) -> float:
        """Bytes of one routed-expert weight when the rest is stored in `dtype`: the checkpoint's
        own expert dtype where it has one (gpt-oss: mxfp4, 4.25 bits), else `dtype`."""
        return dtype_bytes(self.expert_dtype or dtype)

    def active_intermediate_size(self) -> float:
        """MLP columns one token computes, averaged over layers (k experts plus the shared one)."""
        sparse = self.num_sparse_layers
        cols = ((self.num_layers - sparse) * self.intermediate_size
                + sparse * (self.num_experts_per_tok * self.expert_intermediate_size + self.shared_expert_intermediate_size))
        return cols / self.num_layers

    # ---- bytes ---------------------------------------------------------------------------
    @property
    def projection_rows(self) -> int:
        """Output rows of all transformer-block projections (each carries one scale when quantized)."""
        c, h = self.param_counts(), self.hidden_size
        mlp_rows = (c["mlp"] + c["experts"]) // h  # gate, up and down: one row per column of I, each
        if self.is_mla:  # q_a + q_b (or q_proj), kv_a, kv_b, o
            H = self.num_heads
            attn_rows = (self.q_lora_rank + H * (self.qk_nope_head_dim + self.qk_rope_head_dim) + self.mla_latent_dim
                         + H * (self.qk_nope_head_dim + self.v_head_dim) + h)
            return self.num_layers * attn_rows + mlp_rows
        return self.num_layers * ((self.q_dim + 2 * self.kv_dim) + h) + mlp_rows

    def weight_bytes(self, dtype: str = "bf16", rest_dtype: str = "bf16") -> float:
        """Bytes of all weights: transformer-block matmuls in `dtype` (plus one float32 scale per
        output row when quantized to fp8/int8; int4: half a byte a weight plus the scales and
        offsets of the spec's int4 layout, as the engine holds them: engine_int4_weight_bytes),
        embeddings, LM head, routers and norms in `rest_dtype`."""
        if normalize_dtype(dtype) == "int4" and not self.expert_dtype:
            return self.engine_int4_weight_bytes(self.int4_group_size, rest_dtype, self.int4_symmetric)
        c = self.param_counts()
        quantized = c["attention"] + c["mlp"] + (0 if self.expert_dtype else c["experts"])
        rest = c["embedding"] + c["lm_head"] + c["router"] + c["norms"]
        rows = self.projection_rows - (c["experts"] // self.hidden_size if self.expert_dtype else 0)
        scales = rows * SCALE_BYTES_PER_ROW.get(normalize_dtype(dtype), 0.0)
        # Experts in their own dtype (mxfp4's scales are in its 4.25 bits): gpt-oss. Their biases
        # are not quantized (the checkpoint and the engine hold them in the float dtype).
        experts = 0.0
        if self.expert_dtype:
            biases = self.num_sparse_layers * self.num_experts * (self.expert_params - 3 * self.hidden_size *
                                                                  self.expert_intermediate_size)
            experts = (c["experts"] - biases) * self.expert_bytes_per_param(dtype) + biases * dtype_bytes(rest_dtype)
        return quantized * dtype_bytes(dtype) + scales + experts + rest * dtype_bytes(rest_dtype)

    def engine_int4_weight_bytes(self, group_size: int | None, rest_dtype: str = "bf16", symmetric: bool = True,
                                 scale_dtype: str = "fp16") -> float:
        """Bytes of all weights as Stoker's int4 method holds them (layers/int4_method.py):
        transformer-block matmuls at half a byte per weight plus, per output row and group of
        `group_size` columns (None: per channel, one group of K), a `scale_dtype` scale (fp16
        where exact, else fp32) and, not symmetric, a float32 offset; embeddings, LM head,
        routers and norms in `rest_dtype`. The engine's start-up log prints this beside the
        bytes it holds (runner weights_summary). A dense model's projections only."""
        c = self.param_counts()
        quantized = c["attention"] + c["mlp"] + c["experts"]
        rest = c["embedding"] + c["lm_head"] + c["router"] + c["norms"]
        groups = self.projection_rows if group_size is None else quantized / group_size
        tinygemm = normalize_dtype(scale_dtype) == "tinygemm"  # its zero is in the 4 bytes, symmetric or not
        per_group = INT4_SCALE_BYTES[normalize_dtype(scale_dtype)] + (0.0 if symmetric or tinygemm else INT4_OFFSET_BYTES)
        return quantized * 0.5 + groups * per_group + rest * dtype_bytes(rest_dtype)

    def decode_weight_bytes(self, batch: int, dtype: str = "bf16", rest_dtype: str = "bf16") -> float:
        """Weight bytes one decode step of `batch` sequences reads (no scales): attention, the
        MLPs `mlp_params_read(batch)` says (a MoE layer only the experts its tokens touch), the
        routers and the LM head; the embedding is a gather of `batch` rows, not counted. A dense
        model's is the same at every batch. The cost model's decode step reads exactly this."""
        lp, L = self.layer_params, self.num_layers
        dense, experts = self.mlp_params_read(batch, "dense"), self.mlp_params_read(batch, "experts")
        projections = L * (lp["qkv_proj"] + lp["o_proj"]) + dense["mlp_gate_up"] + dense["mlp_down"]
        rest = self.num_sparse_layers * lp["router"] + self.vocab_size * self.hidden_size
        return (projections * dtype_bytes(dtype) + (experts["mlp_gate_up"] + experts["mlp_down"])
                * self.expert_bytes_per_param(dtype) + rest * dtype_bytes(rest_dtype))

    def kv_context(self, context_len: float) -> float:
        """Tokens of K/V a sequence of `context_len` tokens holds (and a decode step reads), averaged
        over layers: all of them on full-attention layers, at most `sliding_window` on sliding ones.
        x kv_bytes_per_token = the sequence's KV bytes. `context_len` for a model with no window."""
        if not self.num_sliding_layers:
            return float(context_len)
        full = self.num_layers - self.num_sliding_layers
        return (full * context_len + self.num_sliding_layers * min(context_len, self.sliding_window)) / self.num_layers

    def kv_bytes_per_seq(self, context_len: float, kv_dtype: str = "bf16", tp: int = 1) -> float:
        """KV bytes of one sequence of `context_len` tokens (per GPU when tp > 1), windows honoured."""
        return self.kv_context(context_len) * self.kv_bytes_per_token(kv_dtype, tp)

    def kv_bytes_per_token(self, kv_dtype: str = "bf16", tp: int = 1) -> float:
        """K and V of every layer for one token; per GPU when tp > 1 (KV heads split, or replicated
        when tp > kv heads, as vLLM does). facts.md: Llama-3-8B bf16 131072 B, 70B 327680 B."""
        if self.is_mla:  # one latent per layer, the same on every TP rank (V3: 61 x 576 x 2 = 70,272 B bf16)
            return kv_bytes_per_token(self.num_layers, 1, self.mla_latent_dim, kv_dtype, kv_tensors=1)
        kv_heads_per_gpu = math.ceil(self.num_kv_heads / tp)
        return kv_bytes_per_token(self.num_layers, kv_heads_per_gpu, self.head_dim, kv_dtype)

    # ---- FLOPs ---------------------------------------------------------------------------
    def flops_per_token(self, context_len: float, absorbed: bool = True) -> dict[str, float]:
        """Forward FLOPs for one token attending to `context_len` positions, by operation.

        2 FLOPs per multiply-accumulate on active weights (MoE: the token's k experts and the
        shared one), plus attention 4 x layers x heads x head_dim x context (QK^T and PV), the
        formula in facts.md (Kaplan et al. 2020, sec. 2.1). MLA is priced absorbed, as it decodes:
        every head scores the latent and rope key (r + R) and sums the latent (r) per position,
        2 x layers x heads x (2r + R) x context (the absorption's own matmuls are kv_b_proj's
        weight FLOPs, in qkv_proj). `absorbed=False`: MLA as it prefills (vLLM's and SGLang's MLA
        backends expand the latent through kv_b_proj and run multi-head attention over the prompt):
        per head a (qk_nope + qk_rope)-wide score and a v_head_dim-wide sum per position,
        2 x layers x heads x (qk_nope + qk_rope + v_head_dim) x context.
        """
        lp, L, h = self.layer_params, self.num_layers, self.hidden_size
        cols = L * self.active_intermediate_size()
        if self.is_mla:
            width = (self.kv_lora_rank + self.mla_latent_dim if absorbed
                     else self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
            per_position = 2.0 * self.num_heads * width
        else:
            per_position = 4.0 * self.q_dim
        return {
            "qkv_proj": 2.0 * L * lp["qkv_proj"],
            "attention": L * per_position * self.kv_context(context_len),  # a window caps its layers
            "o_proj": 2.0 * L * lp["o_proj"],
            "router": 2.0 * self.num_sparse_layers * lp["router"],
            "mlp_gate_up": 2.0 * 2 * h * cols,
            "mlp_down": 2.0 * h * cols,
            "lm_head": 2.0 * self.vocab_size * self.hidden_size,
        }


def spec_from_config(config: dict, name: str = "custom") -> ModelSpec:
    """Build a ModelSpec from HF config.json fields (Llama, Mistral, Mixtral, Qwen2/3 names)."""
    try:
        h, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        num_experts = int(config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 1)
        model_type = config.get("model_type")
        return ModelSpec(
            name=name,
            hidden_size=h,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=mla_head_dim(config) or int(config.get("head_dim") or h // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            num_experts=num_experts,
            num_experts_per_tok=int(config.get("num_experts_per_tok") or 1) if num_experts > 1 else 1,
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0) if num_experts > 1 else 0,
            shared_expert_intermediate_size=shared_expert_size(config) if num_experts > 1 else 0,
            shared_expert_gate="n_shared_experts" not in config,
            router_bias=model_type in ("glm4_moe", "deepseek_v3", "kimi_k2", "gpt_oss"),
            expert_bias=model_type == "gpt_oss",
            o_proj_bias=model_type == "gpt_oss" and bool(config.get("attention_bias", True)),
            attention_sinks=model_type == "gpt_oss",
            num_dense_layers=num_dense_layers(config) if num_experts > 1 else 0,
            attention_bias=qkv_bias(config),
            qk_norm=bool(config.get("qk_norm", config.get("use_qk_norm", model_type in ("qwen3", "qwen3_moe", "olmoe", "olmo2",
                                                                                       "gemma3_text")))),
            qk_norm_per_head=model_type not in ("olmoe", "olmo2"),
            norms_per_layer=4 if model_type in ("gemma2", "gemma3_text") else 2,
            sliding_window=int(config.get("sliding_window") or 0) if sliding_layers(config) else 0,
            num_sliding_layers=sliding_layers(config),
            expert_dtype=expert_dtype(config) if num_experts > 1 else "",
            kv_lora_rank=int(config.get("kv_lora_rank") or 0),
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            qk_nope_head_dim=int(config.get("qk_nope_head_dim") or 0),
            qk_rope_head_dim=int(config.get("qk_rope_head_dim") or 0),
            v_head_dim=int(config.get("v_head_dim") or 0),
            checkpoint_dtype=checkpoint_dtype(config),
            **checkpoint_int4(config),
            published_params=config.get("published_params"),
            source=str(config.get("source", name)),
        )
    except KeyError as exc:
        raise ValueError(f"{name}: config.json lacks {exc.args[0]!r}; is it a decoder-only LLM config?") from None


def mla_head_dim(config: dict) -> int:
    """An MLA config's query/key head width (qk_nope + qk_rope; its `head_dim`, where
    transformers writes one, is the rope part only); 0 for other configs."""
    if not config.get("kv_lora_rank"):
        return 0
    return int(config.get("qk_nope_head_dim") or 0) + int(config.get("qk_rope_head_dim") or 0)


def sliding_layers(config: dict) -> int:
    """Layers config.json's `layer_types` marks "sliding_attention" (gpt-oss: every other one).
    Gemma configs written before `layer_types` existed say it by rule (transformers' defaults):
    Gemma 2 every other layer from the first, Gemma 3 all but every `sliding_window_pattern`-th (6)."""
    if config.get("layer_types") or not config.get("sliding_window"):
        return sum(1 for t in config.get("layer_types") or [] if t == "sliding_attention")
    period = {"gemma2": 2, "gemma3_text": int(config.get("sliding_window_pattern") or 6)}.get(config.get("model_type", ""))
    layers = int(config["num_hidden_layers"])
    return layers - layers // period if period else 0


def expert_dtype(config: dict) -> str:
    """The routed experts' own storage dtype: "mxfp4" where quantization_config says so (gpt-oss's
    checkpoints: the experts in MXFP4, self_attn, router, embeddings and lm_head left in bf16 by
    `modules_to_not_convert`); "" (the weights' dtype) otherwise."""
    q = config.get("quantization_config") or {}
    return "mxfp4" if str(q.get("quant_method", "")).lower() == "mxfp4" else ""


def checkpoint_dtype(config: dict) -> str:
    """"fp8" where quantization_config ships the projections in FP8 (DeepSeek's block-FP8:
    quant_method "fp8", weight_block_size [128, 128]); "int4" where it ships them 4-bit (AWQ,
    GPTQ, compressed-tensors W4A16: checkpoint_int4); "" otherwise (mxfp4 experts: expert_dtype)."""
    q = config.get("quantization_config") or {}
    if str(q.get("quant_method", "")).lower() == "fp8":
        return "fp8"
    return "int4" if _int4_weights(q) is not None else ""


def _int4_weights(q: dict) -> dict | None:
    """A 4-bit quantization_config's weight scheme as compressed-tensors names it (group_size,
    strategy, symmetric), or None: AWQ (zero points unless zero_point false), GPTQ (`sym`,
    group_size -1 per channel), compressed-tensors' first 4-bit integer weight group."""
    method = str(q.get("quant_method", "")).lower()
    if method in ("awq", "gptq") and int(q.get("bits") or q.get("w_bit") or 0) == 4:
        group = int(q.get("group_size") or q.get("q_group_size") or 0)
        symmetric = not q.get("zero_point", True) if method == "awq" else bool(q.get("sym", True))
        return {"group_size": group if group > 0 else None, "strategy": "group" if group > 0 else "channel",
                "symmetric": symmetric}
    if method == "compressed-tensors":
        for g in (q.get("config_groups") or {}).values():
            w = (g or {}).get("weights") or {}
            if int(w.get("num_bits") or 0) == 4 and w.get("type", "int") == "int":
                return w
    return None


def checkpoint_int4(config: dict) -> dict:
    """ModelSpec's int4 layout fields from a 4-bit checkpoint's quantization_config (the engine
    holds exactly its groups, and an offset per group when it has zero points); {} otherwise."""
    w = _int4_weights(config.get("quantization_config") or {})
    if w is None:
        return {}
    per_channel = w.get("strategy") == "channel" or not w.get("group_size")
    return {"int4_group_size": None if per_channel else int(w["group_size"]), "int4_symmetric": bool(w.get("symmetric", True))}


def qkv_bias(config: dict) -> bool:
    """Biases on q, k and v: Qwen2 always (no field), Qwen2-MoE by `qkv_bias` (transformers 5;
    true when absent), the others by `attention_bias` (true when absent for gpt-oss, as transformers' default)."""
    model_type = config.get("model_type")
    if model_type == "qwen2_moe" and config.get("qkv_bias") is not None:
        return bool(config["qkv_bias"])
    return bool(config.get("attention_bias", model_type in ("qwen2", "qwen2_moe", "gpt_oss")))


def shared_expert_size(config: dict) -> int:
    """The shared expert's columns: Qwen2-MoE's `shared_expert_intermediate_size`; GLM-4.5's and
    DeepSeek's `n_shared_experts` experts of `moe_intermediate_size` (one MLP, ungated)."""
    if "n_shared_experts" in config:
        return int(config.get("n_shared_experts") or 0) * int(config.get("moe_intermediate_size") or 0)
    return int(config.get("shared_expert_intermediate_size") or 0)


def num_dense_layers(config: dict) -> int:
    """Layers of a MoE config whose MLP is dense: Qwen-MoE's `mlp_only_layers` and the layers
    `decoder_sparse_step` skips; DeepSeek's `first_k_dense_replace` first ones."""
    layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or [])
    first_dense = int(config.get("first_k_dense_replace") or 0)
    return sum(1 for i in range(layers) if i in dense_only or (i + 1) % step or i < first_dense)


def list_models() -> list[str]:
    return sorted(PRESETS)


def get_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name, an HF repo id of a preset ("meta-llama/Meta-Llama-3-70B-Instruct"), a
    checkpoint directory holding config.json, or a config.json path."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if is_multimodal(config):  # a multimodal checkpoint: its language model (what the engine serves)
            config = text_model_config(config)
        return spec_from_config(config, name=path.parent.name or path.stem)
    key = _preset_key(name_or_path)
    if key is None:
        raise ValueError(f"unknown model {name_or_path!r}; give a checkpoint dir/config.json or one of: "
                         f"{', '.join(list_models())}")
    return spec_from_config(PRESETS[key], name=key)


def _preset_key(name: str) -> str | None:
    key = name.strip().lower().rsplit("/", 1)[-1]
    for suffix in ("-instruct", "-chat-hf", "-chat", "-hf", "-base"):
        key = key.removesuffix(suffix)
    key = ALIASES.get(key, key)
    if key.startswith("meta-") and key[5:] in PRESETS:
        key = key[5:]
    return key if key in PRESETS else None
