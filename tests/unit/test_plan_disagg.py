"""`stoker plan --compare-disaggregated`: the KV transfer's price and the verdict (roofline/disagg.py)."""

from __future__ import annotations

import json
import re

import pytest

from stoker.cli import main
from stoker.roofline.disagg import LONG_PROMPT_TOKENS, compare_layouts, kv_transfer
from stoker.roofline.hardware import get_link
from stoker.roofline.modelspec import get_model_spec
from stoker.roofline.planner import PlanTargets
from stoker.roofline.profiles import ENGINE

# Llama-3-70B, 4k prompts, a 50 ms ITL budget: the aggregated plan's decode steps carry prefill chunks.
LONG = PlanTargets(target_tokens_per_s=4000, ttft_p50_ms=2000, tpot_ms=50, prompt_len=4096, output_len=256,
                   max_gpus=32)


def test_transfer_is_the_prompts_kv_over_the_link_split_over_kv_head_streams() -> None:
    x = kv_transfer("llama-3-70b", 4096, "bf16", "ib-ndr", tp_prefill=4, tp_decode=8)
    assert x.bytes_per_prompt == 4096 * 327680  # facts.md: Llama-3-70B bf16 327,680 B per token
    assert x.streams == 4 and x.rdma
    assert x.time_s == pytest.approx(4096 * 327680 / 4 / (47e9 * ENGINE.comm))
    fp8 = kv_transfer("llama-3-70b", 4096, "fp8", "ib-ndr", tp_prefill=4, tp_decode=8)
    assert fp8.time_s == pytest.approx(x.time_s / 2)
    tcp = kv_transfer("llama-3-70b", 4096, "bf16", "tcp", tp_prefill=4, tp_decode=8)
    assert not tcp.rdma and tcp.time_s == pytest.approx(x.time_s * 47 / 5.2)
    # One stream per KV head at most: 8 KV heads cap a TP16 pair at 8 NICs.
    assert kv_transfer("llama-3-70b", 4096, "bf16", "ib-ndr", tp_prefill=16, tp_decode=16).streams == 8


def test_mla_latent_is_one_stream_whatever_the_tp() -> None:
    m = get_model_spec("deepseek-v3")
    x = kv_transfer(m, 2000, "bf16", "ib-ndr", tp_prefill=8, tp_decode=8)
    assert x.streams == 1 and x.bytes_per_prompt == 2000 * 61 * (512 + 64) * 2


def test_transfer_refuses_a_link_that_moves_nothing() -> None:
    with pytest.raises(ValueError, match="moves no bytes"):
        kv_transfer("llama-3-8b", 1024, "bf16", "none")


def test_links_carry_their_rdma_flag_and_source() -> None:
    assert get_link("ib-ndr").rdma and get_link("roce-400g").rdma
    assert not get_link("tcp").rdma and "Mooncake" in get_link("tcp").source
    assert not get_link("loopback").rdma and "measured" in get_link("loopback").source  # one host: no NIC at all


def test_pays_when_prefill_chunks_break_the_aggregated_itl() -> None:
    c = compare_layouts("llama-3-70b", "H100", LONG, kv_link="ib-ndr")
    assert c.verdict == "pays" and c.aggregated and c.disaggregated
    assert c.disaggregated.gpus < c.aggregated.gpus
    assert c.aggregated.itl_prefill_share_ms > 0 and c.disaggregated.itl_ms <= LONG.tpot_ms
    assert c.disaggregated.ttft_ms <= LONG.ttft_p50_ms
    assert c.disaggregated.prefill_gpus + c.disaggregated.decode_gpus == c.disaggregated.gpus
    assert "fewer GPUs" in c.reason and "prefill chunks" in c.reason


def test_refused_without_rdma_for_long_prompts_only() -> None:
    c = compare_layouts("llama-3-70b", "H100", LONG, kv_link="tcp")
    assert c.verdict == "refused" and "RDMA" in c.reason and "Dynamo" in c.reason
    assert LONG.prompt_len > LONG_PROMPT_TOKENS
    short = PlanTargets(target_tokens_per_s=4000, tpot_ms=50, prompt_len=512, output_len=256, max_gpus=32)
    assert compare_layouts("llama-3-70b", "H100", short, kv_link="tcp").verdict != "refused"


def test_does_not_pay_for_a_small_model_with_short_prompts() -> None:
    t = PlanTargets(target_tokens_per_s=2000, prompt_len=256, output_len=256)
    c = compare_layouts("llama-3-8b", "H100", t, kv_link="ib-ndr")
    assert c.verdict == "does not pay"
    assert c.aggregated.gpus == 1 and c.disaggregated.gpus >= 2  # one pool each, at least


def test_does_not_pay_when_the_transfer_eats_the_ttft_budget() -> None:
    t = PlanTargets(target_tokens_per_s=2000, ttft_p50_ms=100, prompt_len=900, output_len=256)
    c = compare_layouts("llama-3-70b", "H100", t, kv_link="tcp")  # 900 tokens: short enough for TCP
    assert c.aggregated is not None and c.aggregated.ttft_ms <= 100
    assert c.verdict == "does not pay" and c.disaggregated is None
    assert "TTFT" in c.reason and "KV transfer" in c.reason and c.transfer.time_s > 0


def test_plan_prints_both_layouts_and_the_verdict(capsys) -> None:
    assert main(["plan", "--model", "llama-3-70b", "--gpu", "H100", "--request-rate", "15.625", "--ttft-p50-ms", "2000",
                 "--itl-ms", "50", "--prompt-len", "4096", "--output-len", "256", "--max-gpus", "32",
                 "--compare-disaggregated", "--kv-link", "ib-ndr"]) == 0
    out = capsys.readouterr().out
    assert "4,000 output tokens/s" in out  # 15.625 requests/s x 256 output tokens
    assert "aggregated vs disaggregated" in out and "tokens/s/GPU" in out and "KV transfer per prompt" in out
    assert "verdict: disaggregation pays" in out


def test_plan_json_carries_the_comparison(capsys) -> None:
    assert main(["plan", "--model", "llama-3-70b", "--gpu", "H100", "--target-tokens-per-s", "4000", "--tpot-ms", "50",
                 "--prompt-len", "4096", "--output-len", "256", "--max-gpus", "32", "--compare-disaggregated",
                 "--kv-link", "tcp", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["disaggregation"]
    assert d["verdict"] == "refused" and d["kv_transfer"]["link"] == "tcp" and not d["kv_transfer"]["rdma"]
    assert d["aggregated"]["tokens_per_s_per_gpu"] > 0


def test_plan_needs_exactly_one_rate(capsys) -> None:
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "H100"]) == 2
    assert "--request-rate" in capsys.readouterr().err


def test_plan_sections_import_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, stoker.roofline.disagg, stoker.roofline.host_tier, stoker.roofline.ep_sizing, "
            "stoker.roofline.plan_extras; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--compare-disaggregated", "--kv-link", "carrier-pigeon"], "unknown interconnect"),
        (["--ep", "8,x"], "--ep takes comma-separated GPU counts"),
        (["--ep", "8"], "has no experts"),
        (["--kv-offloading-size", "64"], "add --multi-turn"),
        (["--multi-turn", "4", "--conversations", "0"], "must be >= 1"),
    ],
)
def test_bad_section_flags_are_one_clear_error(extra: list[str], message: str, capsys) -> None:
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "H100", "--target-tokens-per-s", "1000", *extra]) == 2
    assert message in capsys.readouterr().err


def test_bad_request_rate(capsys) -> None:
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "H100", "--request-rate", "0"]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("targets", [
    LONG,  # searched freely, the cheapest pair here is prefill TP2 + decode TP4
    PlanTargets(target_tokens_per_s=20000, ttft_p50_ms=1000, tpot_ms=30, prompt_len=8192, output_len=512, max_gpus=128),
])
def test_pools_pair_only_at_equal_tp_since_the_servers_refuse_unequal(targets: PlanTargets) -> None:
    c = compare_layouts("llama-3-70b", "H100", targets, kv_link="ib-ndr")
    dis = c.disaggregated
    assert dis is not None and c.transfer is not None
    pools = re.findall(r"(prefill|decode) (\d+) x TP(\d+)", dis.description)
    assert [role for role, _, _ in pools] == ["prefill", "decode"]
    (_, n_p, tp_p), (_, n_d, tp_d) = pools
    assert tp_p == tp_d == str(dis.tp)
    assert (int(n_p) * dis.tp, int(n_d) * dis.tp) == (dis.prefill_gpus, dis.decode_gpus)
    assert c.transfer.streams == min(dis.tp, 8)  # 8 KV heads
