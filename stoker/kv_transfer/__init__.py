"""The KV cache beyond one engine (DESIGN.md, seam 26): a KV connector shaped like vLLM's V1
connector, and disaggregated prefill/decode over NIXL (docs/disaggregation.md).

Torch-free: config, params, metadata, aggregate, base, compat, scheduler_side, side_channel, stats.
Torch (the runner's process): transport (NIXL), worker_side, faults.
"""
