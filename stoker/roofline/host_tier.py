"""The host KV tier (`--kv-offloading-size`) priced for a multi-turn workload. [no torch]

    price_host_tier(model, gpu, turns=8, turn_tokens=512, conversations=64, device_tokens=200_000,
                    offloading_gib=64) -> HostTierPrice (hit rates with and without the tier, TTFT saved)

Workload: conversations of `turns` turns, each turn adding `turn_tokens` tokens (the user's message
and the reply). Turn n's prompt is the whole history, n x T tokens, whose first (n - 1) x T are the
previous turn's prompt and output: a prefix the cache may still hold. `conversations` are live at
once, interleaved at evenly spread phases (users thinking between turns count: they hold history).

Cache (LRU, a fluid model): between two turns of one conversation every other live conversation
touches its whole history once, so a prefix's reuse distance is the working set
    W = conversations x mean history = conversations x T x (turns + 1) / 2
and with C tokens of cache the prefix is still there with p = min(1, C / W).
    device only    p_dev = min(1, C_device / W)
    with the tier  p_all = min(1, (C_device + C_host) / W); host hits = p_all - p_dev: prefixes the
                   device evicted (vLLM's offloading connector writes evicted blocks to the host pool,
                   keyed by the same prefix hash: the tier of issue 35).
Hit rate = prompt tokens found cached / prompt tokens = p x (turns - 1) / (turns + 1) (the sum of
(n - 1) T over the sum of n T). One turn: no reuse, so no hits and no gain; more tier: never fewer hits.
TTFT of turn n (the cost model's prefill, roofline/workloads.py, no queueing):
    miss        prefill n T tokens in chunks of the step budget
    device hit  prefill the T new tokens attending (n - 1) T + T / 2 positions on average
    host hit    that, plus copying the prefix's KV host -> device over `host_link` (each GPU its
                TP share of the KV on its own PCIe link, at the comm share of the link's rate)
Device capacity: the replica's KV tokens less what its running batch holds (vLLM keeps a finished
request's blocks cached in the free pool until they are reused or evicted). Host capacity:
offloading_gib / KV bytes per token: vLLM's CacheConfig.kv_offloading_size is "the total buffer size
summed across all TP ranks" (vllm/config/cache.py), so the replica's whole KV per token.
Not modelled: a skewed (Zipf) conversation popularity (LRU does better than this uniform case),
copies overlapped with other work, the store bandwidth of evictions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from stoker.roofline.costmodel import step_cost
from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.hardware import GiB, GPUSpec, Interconnect, get_gpu, get_link
from stoker.roofline.modelspec import ModelSpec, get_model_spec
from stoker.roofline.profiles import ENGINE

# The host link of each GPU's board (facts.md: PCIe Gen4 x16 ~32 GB/s/dir, Gen5 ~64): Hopper and
# Blackwell boards are PCIe Gen5 hosts, Ampere and Ada Gen4.
PCIE5_GPUS = ("H100", "H200", "B200")


def default_host_link(gpu: GPUSpec) -> Interconnect:
    """The GPU's link to host memory: pcie5 for Hopper/Blackwell parts, pcie4 otherwise."""
    name = (gpu.parent or gpu.name).upper()
    return get_link("pcie5" if name.startswith(PCIE5_GPUS) else "pcie4")


@dataclass(frozen=True)
class HostTierPrice:
    turns: int
    turn_tokens: int
    conversations: int
    device_tokens: int  # cacheable on the device (the replica's KV less its running batch)
    host_tokens: int  # the host tier's capacity in tokens
    working_set_tokens: float
    hit_rate_device_only: float  # prompt tokens found cached / prompt tokens
    hit_rate_with_tier: float
    host_hit_rate: float  # the part of hit_rate_with_tier served from the host tier
    ttft_device_only_ms: float  # mean over turns
    ttft_with_tier_ms: float
    recompute_ms: float  # mean over turns 2..N: what a miss on the prefix costs beyond a hit
    copy_ms: float  # mean over turns 2..N: copying the prefix host -> device
    host_link: str

    @property
    def ttft_saved_ms(self) -> float:
        return self.ttft_device_only_ms - self.ttft_with_tier_ms

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "ttft_saved_ms": self.ttft_saved_ms}


def reuse_share(turns: int) -> float:
    """Share of all prompt tokens of a conversation that repeat the previous turn's: (turns - 1) / (turns + 1)."""
    return (turns - 1) / (turns + 1)


def survival(capacity_tokens: float, working_set_tokens: float) -> float:
    """Chance a conversation's prefix is still cached at its next turn: min(1, C / W)."""
    if working_set_tokens <= 0:
        return 1.0
    return min(1.0, max(0.0, capacity_tokens) / working_set_tokens)


def price_host_tier(model: ModelSpec | str, gpu: GPUSpec | str, *, turns: int, turn_tokens: int, conversations: int,
                    device_tokens: int, offloading_gib: float, weight_dtype: str = "bf16", kv_dtype: str = "bf16",
                    tp: int = 1, link: Interconnect | str | None = None, host_link: Interconnect | str | None = None,
                    max_num_batched_tokens: int = 8192, eff: Efficiencies | None = None) -> HostTierPrice:
    """Hit rates and mean TTFT over the turns, with and without a host tier of `offloading_gib` (docstring)."""
    if turns < 1 or turn_tokens < 1 or conversations < 1:
        raise ValueError("--multi-turn, --turn-tokens and --conversations must be >= 1")
    if offloading_gib < 0 or device_tokens < 0:
        raise ValueError("--kv-offloading-size and the device capacity must be >= 0")
    m = get_model_spec(model) if isinstance(model, str) else model
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    eff = eff or ENGINE
    hl = get_link(host_link) if isinstance(host_link, str) else (host_link or default_host_link(g))
    per_token = m.kv_bytes_per_token(kv_dtype, 1)  # the replica's whole KV of one token
    host_tokens = int(offloading_gib * GiB / per_token)
    working = conversations * turn_tokens * (turns + 1) / 2
    p_dev = survival(device_tokens, working)
    p_all = survival(device_tokens + host_tokens, working)
    share = reuse_share(turns)
    kw = dict(weight_dtype=weight_dtype, kv_dtype=kv_dtype, tp=tp, link=link, eff=eff, with_floor=False)

    def prefill(new: int, cached: int) -> float:
        # new tokens after `cached` ones, in chunks of the budget; context 2 x cached + new makes the
        # cost model's mean attended positions cached + new / 2.
        chunk = min(new, max_num_batched_tokens)
        one = step_cost(m, g, phase="prefill", context_len=2 * cached + new, chunk_tokens=chunk, **kw).step_time_s  # type: ignore[arg-type]
        return one * new / chunk

    dev_sum = tier_sum = recompute_sum = copy_sum = 0.0
    for n in range(1, turns + 1):
        miss = prefill(n * turn_tokens, 0)
        if n == 1:
            dev_sum, tier_sum = dev_sum + miss, tier_sum + miss
            continue
        prefix = (n - 1) * turn_tokens
        hit = prefill(turn_tokens, prefix)
        copy = prefix * m.kv_bytes_per_token(kv_dtype, tp) / (hl.gb_per_s * 1e9 * eff.comm)
        dev_sum += p_dev * hit + (1 - p_dev) * miss
        tier_sum += p_dev * hit + (p_all - p_dev) * (hit + copy) + (1 - p_all) * miss
        recompute_sum, copy_sum = recompute_sum + miss - hit, copy_sum + copy
    later = max(1, turns - 1)
    return HostTierPrice(turns, turn_tokens, conversations, device_tokens, host_tokens, working, p_dev * share,
                         p_all * share, (p_all - p_dev) * share, dev_sum / turns * 1e3, tier_sum / turns * 1e3,
                         recompute_sum / later * 1e3, copy_sum / later * 1e3, hl.name)


def format_host_tier(h: HostTierPrice, offloading_gib: float) -> list[str]:
    """The `stoker plan` lines for the host tier."""
    return [
        f"host KV tier (--kv-offloading-size {offloading_gib:g} GiB = {h.host_tokens:,} tokens; {h.conversations} "
        f"conversations of {h.turns} turns x {h.turn_tokens} tokens, working set {h.working_set_tokens:,.0f} tokens; "
        f"device cache {h.device_tokens:,} tokens):",
        f"  prefix hit rate: {h.hit_rate_device_only:.1%} device only -> {h.hit_rate_with_tier:.1%} with the tier "
        f"({h.host_hit_rate:.1%} from host memory)",
        f"  per hit on a turn's prefix: recompute {h.recompute_ms:.1f} ms vs copy {h.copy_ms:.1f} ms over {h.host_link}",
        f"  mean TTFT over the turns: {h.ttft_device_only_ms:.1f} ms device only -> {h.ttft_with_tier_ms:.1f} ms with "
        f"the tier ({h.ttft_saved_ms:.1f} ms saved)",
    ]
