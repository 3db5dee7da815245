"""Turn a deployment spec into a `DeploymentNeed` per GPU model, through the roofline code.

Memory: weights + KV cache for `max_num_seqs` sequences of `max_model_len` tokens (the
worst case the server admits), divided by `gpu_memory_utilization` so the slice keeps
the same headroom `stoker serve` keeps (vLLM's KV budget rule, facts.md). Weight and KV
sizes come from `stoker.roofline.modelspec`.

Compute: with `target_tokens_per_s`, the share of a whole GPU that reaches the target in
decode, from the decode-step floor (JAX scaling book, inference chapter; facts.md):
    T >= (batch x KV_bytes_per_seq + weight_bytes) / HBM_BW  and  T >= 2 x batch x params / FLOPs
at batch = max_num_seqs and the average context max_model_len / 2; tokens/s = batch / T.
A MIG slice with s SM slices and m memory slices gets s/7 of the FLOP/s and m/8 of the
bandwidth (`stoker.roofline.hardware` models slices the same way), so a replica fits a
slice when min(s/7, m/8) >= share. Tensor parallel over n whole GPUs is taken as n x one
GPU, an upper bound (it ignores all-reduce time).

Explicit `memory_gib` / `compute_share` in the deployment file skip the model arithmetic.
"""

from __future__ import annotations

from stoker.fleet.gpus import GiB, get_gpu_model
from stoker.fleet.placement import DeploymentNeed
from stoker.fleet.spec import DeploymentSpec

# stoker serve takes vLLM's dtype spellings; the roofline tables take short ones.
from stoker.roofline.modelspec import normalize_dtype as roofline_dtype


def memory_need_bytes(dep: DeploymentSpec) -> int:
    """Bytes of GPU memory one replica needs (all its GPUs together)."""
    if dep.memory_gib is not None:
        return int(dep.memory_gib * GiB)
    spec = _model_spec(dep)
    # a sliding-window layer holds at most its window of K/V (ModelSpec.kv_context), as roofline/memory.py counts
    kv = spec.kv_bytes_per_seq(dep.max_model_len, roofline_dtype(dep.kv_cache_dtype)) * dep.max_num_seqs
    return int((spec.weight_bytes(roofline_dtype(dep.dtype)) + kv) / dep.gpu_memory_utilization)


def decode_tokens_per_s(dep: DeploymentSpec, gpu_model: str) -> float:
    """Decode tokens/s ceiling of one whole GPU for this deployment (see module docstring)."""
    from stoker.roofline.hardware import get_gpu

    spec = _model_spec(dep)
    gpu = get_gpu(get_gpu_model(gpu_model).roofline_name)
    batch = dep.max_num_seqs
    context = dep.max_model_len / 2
    kv_bytes_per_seq = spec.kv_bytes_per_seq(context, roofline_dtype(dep.kv_cache_dtype))
    t_memory = (batch * kv_bytes_per_seq + spec.weight_bytes(roofline_dtype(dep.dtype))) / gpu.hbm_bytes_per_s
    compute_dtype = "fp8" if roofline_dtype(dep.dtype) == "fp8" else "bf16"
    t_compute = 2 * batch * spec.num_active_params / gpu.peak_flops(compute_dtype)
    return batch / max(t_memory, t_compute)


def need_for(dep: DeploymentSpec, gpu_model: str) -> DeploymentNeed:
    """What one replica of `dep` needs on `gpu_model`."""
    memory = memory_need_bytes(dep)
    if dep.compute_share is not None:
        share = dep.compute_share
    elif dep.target_tokens_per_s is not None:
        share = dep.target_tokens_per_s / decode_tokens_per_s(dep, gpu_model)
    else:
        share = 0.0
    return DeploymentNeed(memory_bytes=memory, compute_share=share)


def _model_spec(dep: DeploymentSpec):  # -> stoker.roofline.modelspec.ModelSpec
    try:
        from stoker.roofline.modelspec import get_model_spec
    except ImportError as exc:  # pragma: no cover - roofline ships in the same package
        raise ValueError(
            f"deployment {dep.name!r}: the roofline model specs are unavailable ({exc}); "
            "give memory_gib (and compute_share) explicitly"
        ) from None
    try:
        return get_model_spec(dep.preset)
    except ValueError as exc:
        raise ValueError(
            f"deployment {dep.name!r}: {exc}; set 'preset' to one of those, or give memory_gib"
        ) from None
