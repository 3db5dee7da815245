"""Engine flags shared by `stoker generate`, `stoker bench throughput` and `stoker serve`,
named as vLLM names them."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    g = parser.add_argument_group("engine")
    if model_required:
        g.add_argument("--model", required=True, help="Hugging Face checkpoint folder (config.json + *.safetensors + tokenizer)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"], help="auto: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step at most")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step at most (chunked prefill splits longer prompts)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV-cache budget in bytes (CPU default 1 GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory for weights + activations + KV")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", help="turn prefix caching off")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false", help="turn chunked prefill off")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: arrival order; priority: a request's priority (lower first), then arrival")
    g.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GiB of host memory for KV blocks evicted from the device cache, summed over the tensor-parallel "
                        "ranks; a later prefix hit there is copied back instead of recomputed (docs/kv_offloading.md)")
    g.add_argument("--kv-offloading-backend", default="native", help="host KV tier backend: native (the only one)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks per replica (GPUs, or CPU processes): the weights and KV cache are sharded across them")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV-cache element type: auto (the model dtype) or fp8 (E4M3, per-layer scales from the checkpoint, else 1.0)")
    g.add_argument("--quantization", "-q", default=None, choices=["fp8", "int8", "int4"],
                   help="quantize the weights at load: fp8/int8 one scale per output channel, int4 (Stoker's own) "
                        "symmetric 4-bit with one scale per group of 128 columns (a pre-quantized checkpoint needs no flag)")
    g.add_argument("--activation-dtype", default="auto", choices=["auto", "int8"],
                   help="what int4 projections multiply: auto (the model dtype, W4A16) or int8 (W4A8: activations "
                        "quantized per block of 32 as llama.cpp's Q8_0, integer dot products, a GGUF file's Q6_K "
                        "tensors W6A8 in their own 6-bit codes; CPU float32 only, logits move by more than W4A16's "
                        "rounding, docs/quantization.md)")
    g.add_argument("--speculative-config", type=_speculative_config, default=None,
                   help='speculative decoding as JSON, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\', \'{"method": "suffix", ...}\', or '
                        '\'{"method": "draft_model" (or "eagle3"), "model": PATH, "num_speculative_tokens": 3}\'; k chosen '
                        'per step by the cost model unless "dynamic": false (docs/spec_decode.md)')
    g.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None,
                   help='disaggregated prefill/decode as JSON, vLLM\'s keys: \'{"kv_connector": "NixlConnector", '
                        '"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}\', or vLLM\'s MultiConnector of a '
                        'NixlConnector and an OffloadingConnector (the host KV tier; docs/kv_offloading.md)')
    lo = parser.add_argument_group("LoRA (vLLM's flags)")
    lo.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on top of the model (docs/lora.md)")
    lo.add_argument("--max-loras", type=int, default=1, help="adapters in the compute slots at once (one step mixes at most these)")
    lo.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted (slot size)")


    d = parser.add_argument_group("distributed (tensor parallelism across processes and nodes; env:// rendezvous)")
    d.add_argument("--nnodes", type=int, default=1, help="nodes the tensor-parallel group spans (each runs tp / nnodes ranks)")
    d.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 runs the engine, the others --headless")
    d.add_argument("--master-addr", default="127.0.0.1", help="address of node 0, reachable from every node (MASTER_ADDR)")
    d.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0 (MASTER_PORT; default on one node: a free port)")
    d.add_argument("--distributed-timeout", type=float, default=600.0,
                   help="seconds a collective may wait for a rank before the engine is declared dead (default 600)")
    d.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                   help="MoE models: deal whole experts out over the --tensor-parallel-size ranks instead of cutting "
                        "each expert (attention stays tensor-parallel; docs/moe.md)")


def _speculative_config(text: str) -> dict[str, Any]:
    """--speculative-config's JSON object, checked now so a bad flag fails before the model loads."""
    from stoker.config import SpeculativeConfig

    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    try:
        SpeculativeConfig.from_dict(values)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return values


def _kv_transfer_config(text: str) -> dict[str, Any]:
    """--kv-transfer-config's JSON object, checked now (a bad flag fails before the model loads)."""
    from stoker.kv_transfer.multi import resolve

    try:
        values = json.loads(text)
        resolve(values)  # NixlConnector, OffloadingConnector, or vLLM's MultiConnector of both
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return values


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM(...) keyword arguments the flags above describe."""
    return dict(
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        distributed_timeout_s=args.distributed_timeout,
        enable_expert_parallel=args.enable_expert_parallel,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        quantization=args.quantization,
        activation_dtype=args.activation_dtype,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        speculative_config=args.speculative_config,
        kv_transfer_config=getattr(args, "kv_transfer_config", None),
    )
