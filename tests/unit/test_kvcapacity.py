"""KV capacity from usable memory, against vLLM's own logs; the budget terms add up."""

from __future__ import annotations

import pytest

from stoker.roofline.hardware import GiB, get_gpu
from stoker.roofline.kvcapacity import NCCL_BUFFER_BYTES, kv_capacity, usable_memory


def test_h100_usable_memory_is_the_runtime_figure() -> None:
    usable, source = usable_memory(get_gpu("H100"))
    assert usable / GiB == pytest.approx(79.22) and "10511" in source
    # No public runtime figure: the datasheet capacity, said so.
    usable, source = usable_memory(get_gpu("L40S"))
    assert usable == get_gpu("L40S").memory_bytes and "datasheet" in source
    # A MIG slice takes its share of the parent's runtime figure.
    usable, _ = usable_memory(get_gpu("H100:3g.40gb"))
    assert usable / GiB == pytest.approx(79.22 / 2)


def test_llama3_8b_on_h100_matches_vllm_log() -> None:
    # vllm-project/vllm PR #10511: total 79.22 GiB x 0.90 = 71.29; weights 14.96; non-torch 1.79;
    # activation peak 1.26; available KV 53.29 GiB. Our activation estimate is 0.48 GiB lower.
    cap = kv_capacity("llama-3-8b", "H100")
    assert cap.weights_bytes / GiB == pytest.approx(14.96, abs=0.01)
    assert cap.kv_bytes / GiB == pytest.approx(53.29, rel=0.02)
    assert cap.tokens == cap.num_blocks * 16 and cap.tokens % 16 == 0
    budget = cap.usable_bytes * 0.9
    assert cap.kv_bytes == pytest.approx(budget - cap.weights_bytes - sum(o.bytes for o in cap.overheads))


def test_llama2_7b_on_a100_blocks_match_vllm() -> None:
    # vllm-project/vllm PR #2031: Llama2-7B, TP1, A100-80GB, util 0.9: 7351 GPU blocks of 16.
    assert kv_capacity("llama-2-7b", "A100-80GB").num_blocks == pytest.approx(7351, rel=0.02)


def test_tp_adds_nccl_buffers_and_splits_kv() -> None:
    one = kv_capacity("llama-3-8b", "H100", tp=1)
    two = kv_capacity("llama-3-8b", "H100", tp=2)
    assert "NCCL + custom all-reduce buffers" not in [o.name for o in one.overheads]
    assert [o.bytes for o in two.overheads if o.name.startswith("NCCL")] == [NCCL_BUFFER_BYTES]
    assert two.kv_bytes_per_token == one.kv_bytes_per_token / 2
    assert two.tokens > one.tokens  # half the weights per GPU and half the KV per token


def test_fp8_kv_doubles_tokens_and_max_seqs() -> None:
    bf16 = kv_capacity("llama-3-8b", "H100")
    fp8 = kv_capacity("llama-3-8b", "H100", kv_dtype="fp8")
    assert fp8.tokens == pytest.approx(2 * bf16.tokens, abs=16)
    assert bf16.max_seqs(4096) == bf16.num_blocks // 256
    assert kv_capacity("llama-3-70b", "H100").tokens == 0  # bf16 weights alone exceed the budget
    with pytest.raises(ValueError):
        kv_capacity("llama-3-8b", "H100", gpu_memory_utilization=1.5)
