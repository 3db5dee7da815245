"""Python entry points of the 6-bit W6A8 kernel (linear_q6_a8.h, built into linear.c's library):
the panels it reads (`pack_q6_weight`, `unpack_q6_panels`) and `linear_q6_a8`; argument checks,
then one ctypes call. reference.linear_packed_q6_a8 is the twin.

What it holds: GGUF's Q6_K exactly, w = (q - 32) * sc * D with q in [0, 63], an int8 sub-scale
sc per 16 columns of K and a float32 super-scale D per 256. The GGUF loader gives a Q6_K tensor
as the int8 method's codes q - 32 and scales d * sc per 16 (quantization/gguf_blocks.py);
`factor_q6_scales` recovers sc and D from those products exactly (llama.cpp's quantizer gives
the largest sub-scale of each super-block sc = -128, so D = -s_max / 128 = d), and checks every
product, so the panels hold Q6_K's bits or are not built at all.
"""

from __future__ import annotations

import torch

from stoker.kernels.cpu.common import _checked_library
from stoker.kernels.cpu.linear import _run_linear, pack_linear_weight, pack_scales, panel_width

CHUNK = 16  # rows of K per sub-scale (a chunk of the panel)
SUPER = 256  # rows of K per super-scale
# The sub-scale the largest |scale| of a super-block was given, tried in this order: llama.cpp's
# quantizers (quantize_row_q6_K_ref and the importance-weighted one) give it -128; a quantizer
# that clamps at 127 or mirrors the sign gives one of the others.
_TOP_SUBSCALES = (-128.0, 127.0, -127.0, 128.0)


def chunk_bytes(nr: int) -> int:
    """Bytes of one 16-row chunk of a panel of nr columns (linear_q6_a8.h's layout)."""
    return 13 * nr


def factor_q6_scales(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(N, K / 16) float32 scales s = D * sc -> (sc (N, K / 16) int8, D (N, K / 256) float32) with
    D * sc == s exactly for every group, or None when some super-block has no such factoring
    (not Q6_K's scales). K must be a multiple of 256."""
    n, groups = scale.shape
    per_super = SUPER // CHUNK
    if groups % per_super or scale.dtype != torch.float32:
        return None
    s = scale.reshape(n, groups // per_super, per_super)
    top = s.gather(2, s.abs().argmax(dim=2, keepdim=True))  # (N, S, 1): the signed largest
    found = top == 0  # an all-zero super-block: D = 0, sc = 0
    d = torch.zeros_like(top)
    sc = torch.zeros_like(s)
    for c in _TOP_SUBSCALES:
        cand = top / c
        q = torch.round(s / torch.where(cand == 0, torch.ones_like(cand), cand))
        ok = ~found & ((q >= -128) & (q <= 127) & (cand * q == s)).all(dim=2, keepdim=True)
        d = torch.where(ok, cand, d)
        sc = torch.where(ok, q, sc)
        found |= ok
        if bool(found.all()):
            return sc.to(torch.int8).reshape(n, groups), d.reshape(n, -1).contiguous()
    return None


def pack_q6_weight(q: torch.Tensor, sc: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """(N, K) int8 codes q - 32 in [-32, 31] and (N, K / 16) int8 sub-scales -> (P, K / 16,
    13 NR) uint8 panels for `linear_q6_a8` (linear_q6_a8.h's layout; columns past N hold code 0
    with sub-scale 0). gate_up: rows in the [gate; up] panel order of pack_linear_weight."""
    if q.dim() != 2 or q.dtype != torch.int8 or q.shape[1] % SUPER:
        raise ValueError(f"pack_q6_weight needs (N, K) int8 codes with K a multiple of {SUPER}, got {tuple(q.shape)} {q.dtype}")
    n, k = q.shape
    if sc.shape != (n, k // CHUNK) or sc.dtype != torch.int8:
        raise ValueError(f"pack_q6_weight: sub-scales must be ({n}, {k // CHUNK}) int8, got {tuple(sc.shape)} {sc.dtype}")
    if bool((q < -32).any()) or bool((q > 31).any()):
        raise ValueError("pack_q6_weight: codes outside [-32, 31] do not fit 6 bits")
    codes = pack_linear_weight((q.to(torch.int16) + 32).to(torch.uint8), gate_up=gate_up)  # (P, K, NR) in [0, 63]
    scales = pack_linear_weight(sc, gate_up=gate_up)  # (P, K / 16, NR) int8
    num_panels, _, nr = codes.shape
    rows = codes.view(num_panels, k // CHUNK, CHUNK, nr).to(torch.int64)  # (P, C, 16, NR)
    low, high = rows & 0x0F, rows >> 4
    nibble_shift = (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8, 1)
    lanes0 = (low[:, :, :8] << nibble_shift).sum(dim=2)  # (P, C, NR): rows 0..7 in nibbles 0..7
    lanes1 = (low[:, :, 8:] << nibble_shift).sum(dim=2)
    # byte i: top bits of rows 2i, 2i+1, 8+2i, 8+2i+1 at bits 0-1, 2-3, 4-5, 6-7
    i = torch.arange(4)
    fields = high[:, :, 2 * i] | (high[:, :, 2 * i + 1] << 2) | (high[:, :, 8 + 2 * i] << 4) | (high[:, :, 9 + 2 * i] << 6)
    hi_lanes = (fields << (8 * i.view(1, 1, 4, 1))).sum(dim=2)  # (P, C, NR)

    def as_bytes(lanes: torch.Tensor) -> torch.Tensor:  # (P, C, NR) in [0, 2^32) -> (P, C, 4 NR) uint8
        lanes = torch.where(lanes >= 2**31, lanes - 2**32, lanes).to(torch.int32).contiguous()
        return lanes.view(torch.uint8).view(num_panels, k // CHUNK, 4 * nr)

    chunks = torch.cat([as_bytes(lanes0), as_bytes(lanes1), as_bytes(hi_lanes), scales.view(torch.uint8)], dim=2)
    return chunks.contiguous()


def unpack_q6_panels(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, K / 16, 13 NR) panels of `pack_q6_weight` -> ((P, K, NR) int64 codes q - 32 in [-32, 31],
    (P, K / 16, NR) int64 sub-scales)."""
    num_panels, num_chunks, width = packed.shape
    nr = width // 13
    lanes = packed[..., : 12 * nr].contiguous().view(torch.int32).view(num_panels, num_chunks, 3, nr).to(torch.int64)
    lanes = lanes & 0xFFFFFFFF
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 1, 8, 1)
    low0 = (lanes[:, :, 0:1] >> shifts) & 0x0F  # (P, C, 8, NR)
    low1 = (lanes[:, :, 1:2] >> shifts) & 0x0F
    high = lanes[:, :, 2]  # (P, C, NR)
    top = torch.empty(num_panels, num_chunks, CHUNK, nr, dtype=torch.int64)
    for i in range(4):
        byte = (high >> (8 * i)) & 0xFF
        top[:, :, 2 * i], top[:, :, 2 * i + 1] = byte & 3, (byte >> 2) & 3
        top[:, :, 8 + 2 * i], top[:, :, 9 + 2 * i] = (byte >> 4) & 3, (byte >> 6) & 3
    codes = torch.cat([low0, low1], dim=2) | (top << 4)  # (P, C, 16, NR)
    sc = packed[..., 12 * nr:].contiguous().view(torch.int8).to(torch.int64)
    return (codes - 32).view(num_panels, num_chunks * CHUNK, nr), sc


def pack_q6_super_scales(d: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """(N, K / 256) float32 super-scales -> (K / 256, P * NR) in the panels' column order."""
    return pack_scales(d, torch.float32, gate_up)


def check_q6_panels(packed: torch.Tensor, super_scales: torch.Tensor) -> tuple[int, int, int]:
    """The panels and super-scales of a W6A8 call fit together -> (num_panels, K, NR)."""
    nr = panel_width()
    if packed.dim() != 3 or packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.shape[2] != chunk_bytes(nr):
        raise ValueError(f"linear_q6_a8 needs contiguous uint8 panels (P, K / {CHUNK}, {chunk_bytes(nr)}), got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    num_panels, num_chunks, _ = packed.shape
    k = num_chunks * CHUNK
    if k % SUPER:
        raise ValueError(f"linear_q6_a8: K = {k} is not a multiple of {SUPER}")
    want = (k // SUPER, num_panels * nr)
    if super_scales.shape != want or super_scales.dtype != torch.float32 or not super_scales.is_contiguous():
        raise ValueError(f"super-scales {tuple(super_scales.shape)} {super_scales.dtype}, expected contiguous {want} float32")
    return num_panels, k, nr


def linear_q6_a8(
    x: torch.Tensor,  # (..., K) float32
    packed: torch.Tensor,  # (P, K / 16, 13 NR) uint8 panels (pack_q6_weight)
    super_scales: torch.Tensor,  # (K / 256, P * NR) float32 (pack_q6_super_scales)
    out_features: int,
    bias: torch.Tensor | None = None,  # (P * NR,) in panel order
    silu_and_mul: bool = False,
) -> torch.Tensor:  # (..., N), or (..., N / 2) with silu_and_mul
    """W6A8: x quantized to int8 per block of 32 (as linear_q4_a8), integer dot products
    against the 6-bit codes, the sub-scales applied in integers, one float multiply per block
    and per super-block (linear_q6_a8.h, stoker_linear_q6_a8)."""
    lib = _checked_library()
    num_panels, k, nr = check_q6_panels(packed, super_scales)
    view = packed.view(num_panels, k, -1)  # _run_linear reads (P, K, ...) for its checks

    def call(rows: torch.Tensor, stride: int, out: torch.Tensor, width: int) -> None:
        status = lib.stoker_linear_q6_a8(
            rows.data_ptr(), stride, packed.data_ptr(), packed.shape[1] * packed.shape[2], super_scales.data_ptr(),
            num_panels * nr, None if bias is None else bias.data_ptr(), out.data_ptr(), width, rows.shape[0],
            out_features, k, int(silu_and_mul), torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("linear_q6_a8: could not allocate its buffers")

    return _run_linear(x, view, out_features, bias, silu_and_mul, call, nr)
