"""kernels/lora_bgmv.py (Triton; the interpreter on CPU) against its twin reference.lora_bgmv, with
the slot buffers laid out as layers/lora.py keeps them (B as (N, S, R))."""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import reference
from stoker.kernels.lora_bgmv import lora_bgmv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_bgmv_matches_its_twin(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, k, num_slots, r, n, offset = 7, 40, 3, 8, 70, 10

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    x = rand(num_tokens, k)
    a = rand(num_slots, r, k)
    b_layout = rand(n, num_slots, r)  # (N, S, R): the CPU path's layout
    b = b_layout.permute(1, 0, 2)  # (S, N, R) view, strides (R, S * R, 1)
    slots = torch.tensor([-1, 0, 2, 1, 0, -1, 2], dtype=torch.int32)
    base = rand(num_tokens, offset + n + 5)
    got = lora_bgmv(x, a, b, slots, base.clone(), offset)
    want = reference.lora_bgmv(x, a, b, slots, base.clone(), offset)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # tokens without a slot and columns outside the shard are untouched
    assert torch.equal(got[0], base[0]) and torch.equal(got[:, :offset], base[:, :offset])
    assert not torch.equal(got[1], base[1])


def test_lora_bgmv_refuses_shapes_that_do_not_chain() -> None:
    x, a, b = torch.zeros(2, 8), torch.zeros(1, 4, 8), torch.zeros(1, 6, 5)
    with pytest.raises(ValueError, match="do not chain"):
        lora_bgmv(x, a, b, torch.zeros(2, dtype=torch.int32), torch.zeros(2, 6))


def test_the_gpu_path_of_a_merged_projection_equals_the_cpu_segment_path() -> None:
    """LoRASlots on a q/k/v-like projection: the kernel over its slot buffers (as CUDA runs it,
    any token order) gives what the CPU path's per-segment product gives on the same tokens
    grouped by slot, and both equal the adapter's update computed directly."""
    from stoker.lora.adapter import LoRAAdapter
    from stoker.layers.lora import LoRAMapping, LoRASlots, segments_of

    gen = torch.Generator().manual_seed(1)
    shards = [("q_proj", 0, 32, slice(0, 32)), ("k_proj", 32, 16, slice(0, 16)), ("v_proj", 48, 16, slice(0, 16))]
    slots = LoRASlots(0, shards, 24, 64, max_loras=3, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    adapters = {}
    for slot, rank, targets in ((0, 8, ("q_proj", "v_proj")), (2, 4, ("q_proj", "k_proj", "v_proj"))):
        weights = {(0, m): (torch.randn(rank, 24, generator=gen), torch.randn(rows, rank, generator=gen))
                   for m, _, rows, _ in shards if m in targets}
        adapters[slot] = LoRAAdapter(f"a{slot}", "", rank, 0.5, None, weights)
        slots.load(slot, adapters[slot])
    x = torch.randn(6, 24, generator=gen)
    base = torch.randn(6, 64, generator=gen)
    slot_ids = torch.tensor([0, 2, -1, 2, 0, 0], dtype=torch.int32)
    gpu = slots._apply_bgmv(x, base.clone(), slot_ids)

    want = base.clone()
    for t, s in enumerate(slot_ids.tolist()):
        for (module, first, rows, _) in shards if s >= 0 else ():
            if (0, module) in adapters[s].weights:
                a, b = adapters[s].weights[(0, module)]
                want[t, first:first + rows] += 0.5 * (x[t] @ a.T) @ b.T
    torch.testing.assert_close(gpu, want, atol=1e-4, rtol=1e-4)

    order = sorted(range(6), key=lambda t: int(slot_ids[t]))  # what build_step's grouping does
    segments = segments_of([int(slot_ids[t]) for t in order], list(range(7)))
    assert segments == [(0, 1, 4), (2, 4, 6)]
    cpu = slots.apply(x[order], base[order].clone(), LoRAMapping(segments))
    torch.testing.assert_close(cpu, want[order], atol=1e-4, rtol=1e-4)
    assert torch.equal(gpu[2], base[2]) and not torch.equal(gpu[0], base[0])
