"""The tinygemm layout (kernels/tinygemm_int4.py), interpreted here; torch's CUDA op is checked in
tests/gpu. On the CPU the op is played by a stand-in with a known tile permutation: the probes
must recover it, the check must refuse a stand-in whose permutation differs between tiles, and
the dequantize kernel must give the int4 method's weight (reference.dequant_w4) with scales
and offsets rounded to bfloat16."""

from __future__ import annotations

import pytest
import torch

from stoker.kernels import reference
from stoker.quantization import int4

triton = pytest.importorskip("triton")
from stoker.kernels import tinygemm_int4 as tg  # noqa: E402
from stoker.kernels.w4a16_linear import hold_scales  # noqa: E402

PERM = torch.randperm(tg.TILE_N * tg.TILE_K, generator=torch.Generator().manual_seed(7))


def _codes(op_input: torch.Tensor) -> torch.Tensor:
    """The op's input ((N, K / 2) uint8, even k high) back to (N, K) codes."""
    return torch.stack([op_input >> 4, op_input & 0x0F], dim=-1).reshape(op_input.shape[0], -1)


def stand_in(op_input: torch.Tensor, inner_k_tiles: int, per_tile_shift: bool = False) -> torch.Tensor:
    """A tile-periodic rearrangement of codes into int32 words: element s of every tile goes to
    position PERM[s] (per_tile_shift: tile t's positions rotated by t, so only tile 0 agrees)."""
    assert inner_k_tiles == tg.INNER_K_TILES
    codes = _codes(op_input)
    table = PERM.reshape(tg.TILE_N, tg.TILE_K)
    if not per_tile_shift:
        return tg.pack_by_table(codes, table)
    n, k = codes.shape
    tiles = codes.to(torch.int64).reshape(n // tg.TILE_N, tg.TILE_N, k // tg.TILE_K, tg.TILE_K).permute(0, 2, 1, 3).reshape(-1, tg.TILE_N * tg.TILE_K)
    tiles = torch.stack([torch.roll(t, i) for i, t in enumerate(tiles)])
    back = tiles.reshape(n // tg.TILE_N, k // tg.TILE_K, tg.TILE_N, tg.TILE_K).permute(0, 2, 1, 3).reshape(n, k)
    return tg.pack_by_table(back, table)


def test_the_probes_recover_the_permutation_and_the_check_passes() -> None:
    table = tg.nibble_table(stand_in, torch.device("cpu"))
    assert torch.equal(table.reshape(-1).long(), PERM)
    tg.check_table(stand_in, table, torch.device("cpu"))


def test_a_layout_that_differs_between_tiles_is_refused() -> None:
    def shifted(x: torch.Tensor, t: int) -> torch.Tensor:
        return stand_in(x, t, per_tile_shift=True)

    table = tg.nibble_table(shifted, torch.device("cpu"))  # one tile: rolled by 0, looks fine
    with pytest.raises(ValueError, match="differs between tiles"):
        tg.check_table(shifted, table, torch.device("cpu"))


def test_an_op_that_changes_codes_is_refused() -> None:
    with pytest.raises(ValueError, match="one-to-one"):
        tg.nibble_table(lambda x, t: stand_in(x, t) & 0x77777777, torch.device("cpu"))


def test_packed_words_hold_the_top_nibble_as_the_sign_bit() -> None:
    codes = torch.full((tg.TILE_N, tg.TILE_K), 15, dtype=torch.uint8)
    words = tg.pack_by_table(codes, PERM.reshape(tg.TILE_N, tg.TILE_K))
    assert words.dtype == torch.int32 and bool((words == -1).all())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_is_the_methods_weight_with_bf16_scales(symmetric: bool, group: int, dtype: torch.dtype) -> None:
    n, k = 40, 256  # five tiles of rows (the kernel's N block is 32: a partial block), two of columns
    gen = torch.Generator().manual_seed(1)
    q, s, o = int4.quantize(torch.randn(n, k, generator=gen), group, symmetric)
    scale, offset = hold_scales(s, o)
    table = PERM.reshape(tg.TILE_N, tg.TILE_K).to(torch.int32)
    w = tg.hold(int4.pack(q), scale, offset, group, convert=stand_in, table=table)
    assert w.scales_and_zeros.shape == (k // group, n, 2) and w.scales_and_zeros.dtype == torch.bfloat16
    out = tg.dequant_tinygemm(w, dtype)
    twin = tg.reference_dequant(w, dtype)
    assert torch.equal(out, twin)
    s16 = scale.float().to(torch.bfloat16).float()
    o16 = None if offset is None else offset.to(torch.bfloat16).float()
    assert torch.equal(twin, reference.dequant_w4(int4.pack(q), s16, o16, group, dtype))


def test_shapes_tinygemm_does_not_take() -> None:
    assert tg.supported(4096, 4096, 128)
    assert not tg.supported(4100, 4096, 128)  # N not a multiple of 8
    assert not tg.supported(4096, 4160, 32)  # K not a multiple of 128
    assert not tg.supported(4096, 4096, 4096)  # per channel: no such group in tinygemm
    with pytest.raises(ValueError, match="tinygemm needs"):
        tg.hold(torch.zeros(12, 64, dtype=torch.uint8), torch.ones(12, 1), None, 128, convert=stand_in,
                table=PERM.reshape(tg.TILE_N, tg.TILE_K).to(torch.int32))
