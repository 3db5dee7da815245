"""Shared builders for the kernel tests (interpreter here, bf16 on CUDA in tests/gpu).

A paged batch is built the way the block manager lays one out: each sequence owns
cdiv(context_len, block_size) physical blocks in shuffled order, block 0 is never owned and
pads every block table row (as the runner pads), and one spare padding column is added.
The cache the kernels read holds NaN in every slot outside a sequence's context (partial last
blocks, block 0, spares); the twins read a copy with those slots zeroed, because the twins'
batched gather touches padding positions (masked afterwards, but NaN * 0 = NaN). A kernel
that reads a slot it should not turns its output NaN and fails the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NAN = float("nan")


@dataclass
class PagedBatch:
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D): NaN outside every context
    v_cache: torch.Tensor
    k_ref: torch.Tensor  # the same with NaN -> 0, float32, for the twins
    v_ref: torch.Tensor
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with block 0
    context_lens: list[int]

    def context_lens_tensor(self, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(self.context_lens, dtype=dtype, device=self.block_tables.device)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_paged_batch(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator,
) -> PagedBatch:
    blocks_per_seq = [cdiv(c, block_size) for c in context_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2  # block 0 (padding) + owned + 2 spares
    owned = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_flat = torch.full(shape, NAN)
    v_flat = torch.full(shape, NAN)
    for s, (ctx, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        blocks, owned = owned[:nb], owned[nb:]
        block_tables[s, :nb] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(ctx)
        slots = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k_flat[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        v_flat[slots] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
    k_cache = k_flat.view(num_blocks, block_size, num_kv_heads, head_dim).to(device=device, dtype=dtype)
    v_cache = v_flat.view(num_blocks, block_size, num_kv_heads, head_dim).to(device=device, dtype=dtype)
    return PagedBatch(
        k_cache=k_cache,
        v_cache=v_cache,
        k_ref=torch.nan_to_num(k_cache.float(), nan=0.0),
        v_ref=torch.nan_to_num(v_cache.float(), nan=0.0),
        block_tables=block_tables.to(device),
        context_lens=list(context_lens),
    )


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write stays NaN."""
    return torch.full_like(t, NAN, memory_format=torch.contiguous_format)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float, what: str = "") -> None:
    """Max abs error <= rel * max(1, max |ref|), and NaN nowhere (neither unwritten nor computed).

    float32 kernels vs float32 twins: rel = 1e-5 (a few hundred ulps on O(1) values; the sums
    differ only in order). bf16 kernels vs float32 twins on the same bf16 inputs: rel = 2e-2
    (bf16 keeps 8 mantissa bits: one rounding of the output is 2^-9 = 2e-3, plus P rounded
    to bf16 before P @ V).
    """
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out_f, ref_f = out.float(), ref.float()
    assert not torch.isnan(ref_f).any(), f"{what}: reference has NaN (test bug)"
    num_nan = int(torch.isnan(out_f).sum())
    assert num_nan == 0, f"{what}: {num_nan} NaN elements (unwritten or read from poisoned slots)"
    err = (out_f - ref_f).abs().max().item() if out.numel() else 0.0
    bound = rel * max(1.0, ref_f.abs().max().item() if ref.numel() else 0.0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def spy_cpu_kernels(monkeypatch, names: tuple[str, ...], calls: list[str]) -> None:
    """Record each call of the C kernel set's `names` (in `calls`) while still running them: the
    set ops dispatches CPU float32 tensors to is replaced by one whose entries log first."""
    import dataclasses

    from stoker.kernels import ops

    def logged(name: str):
        real = getattr(ops.CPU, name)
        return lambda *args: (calls.append(name), real(*args))[1]

    monkeypatch.setattr(ops, "CPU", dataclasses.replace(ops.CPU, **{n: logged(n) for n in names}))
