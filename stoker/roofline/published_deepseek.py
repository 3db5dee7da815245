"""Published DeepSeek-V3/R1 serving figures (issue 37), priced with their parallel layouts. [no torch]

Out of the engine-profile fit, like published.MOE_POINTS: they test the wall for multi-head latent
attention and expert parallelism out of sample. Figures are per GPU: a DP-attention rank is one
GPU, and per-node figures are divided by the node's 8 GPUs. `published.predict` prices each with
its layout (PublicPoint.ep, moe_scheme, redundant_experts, link, overlap_comm, expert_dtype); the
table and what each miss means: docs/benchmarks.md, "DeepSeek-V3/R1 points".
"""

from __future__ import annotations

from stoker.roofline.published import PublicPoint

SGLANG_LARGE_EP = ("github.com/lm-sys/lm-sys.github.io blog/2025-05-05-large-scale-ep.md (lmsys.org, \"Deploying "
                   "DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 H100 GPUs\"), Evaluation")
TRT_B200_MIN_LATENCY = ("nvidia.github.io/TensorRT-LLM blogs/tech_blog/blog1_Pushing_Latency_Boundaries_Optimizing_"
                        "DeepSeek-R1_Performance_on_NVIDIA_B200_GPUs (8 x B200, ISL 1k / OSL 2k, batch 1)")
SGLANG_PREFILL_NOTE = ("pessimistic: the all-to-all is priced as k = 8 bf16 copies of every token over its NIC "
                       "(1.9 GB per rank per layer at 16,384 tokens: 5.5 s a step, against 1.4 s of compute); DeepEP's "
                       "prefill (normal) kernels send each token once per destination node over RDMA (DeepSeek's "
                       "node-limited routing: at most 4 nodes) in FP8 and fan out over NVLink, which the link model "
                       "does not know")
SGLANG_DECODE_NOTE = ""
TRT_B200_NOTE = ("pessimistic: the figure is with 3 MTP draft layers (speculative decoding: several tokens accepted per "
                 "step), which the cost model does not price; and the engine profile's 50 us per layer of launch "
                 "gaps (fitted to 2023 engines) is what CUDA graphs and programmatic dependent launch remove in the "
                 "blog's engine. Not fitted")


def _sglang(label: str, kind: str, batch: int, isl: int, osl: int, per_node: float, ep: int, redundant: int,
            note: str = "") -> PublicPoint:
    # SGLang's runs: block-FP8 weights as shipped (DeepGEMM), bf16 latent cache, DP attention + DeepEP over
    # 400 Gb/s InfiniBand between nodes (the blog's Atlas Cloud H100 nodes), two-batch overlap on.
    return PublicPoint(label, "deepseek-v3", "H100", 1, "fp8", "bf16", kind, batch, isl, osl, per_node / 8,
                       SGLANG_LARGE_EP, note=note, ep=ep, moe_scheme="dp_attention", redundant_experts=redundant,
                       link="ib-ndr", overlap_comm=True)


DEEPSEEK_POINTS: tuple[PublicPoint, ...] = (
    # Decode: 9 nodes (EP72; 256 + 32 redundant experts = 4 per rank), 256 sequences per GPU, KV length 2,000:
    # 22,282 tokens/s per node (the profile table: batch 256, KV cache length 2,000, 9 nodes).
    _sglang("SGLang DeepSeek-V3 H100 decode EP72 b256 ctx 2000 (per GPU)", "decode", 256, 2000, 1, 22282, 72, 32,
            SGLANG_DECODE_NOTE),
    # Prefill: 4 nodes (EP32), 16,384 tokens per device, prompts of 4,096: 50,302 tokens/s per node.
    _sglang("SGLang DeepSeek-V3 H100 prefill EP32 16384 tokens of 4096 (per GPU)", "prefill", 4, 4096, 1, 50302, 32, 0,
            SGLANG_PREFILL_NOTE),
    # TensorRT-LLM min latency: 253 tokens/s per user before GTC 2025 (3 MTP layers), attention bf16, MoE
    # experts nvfp4, TP8 attention (experts TP4 x EP2, priced here as the TP cut: the same bytes per rank).
    PublicPoint("TRT-LLM DeepSeek-R1 8 x B200 min latency b1 1k/2k (MTP)", "deepseek-v3", "B200", 8, "bf16", "bf16",
                "decode", 1, 1024, 2048, 253.0, TRT_B200_MIN_LATENCY, note=TRT_B200_NOTE, expert_dtype="nvfp4"),
)
