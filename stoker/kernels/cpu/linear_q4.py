"""Python entry points of the 4-bit linear kernel (linear_q4.h, built into linear.c's library):
the panels it reads (`pack_q4_weight`, `pack_q4_scales`, their inverse `unpack_q4_panels`)
and `linear_q4` (W4A16) and `linear_q4_a8` (W4A8: the activations quantized to int8 per
block of 32, linear_q4_a8.h); argument checks, then one ctypes call. `BoundQ4Linear` is
either entry point with a layer's weights checked once, for the weight method's hot path.

The kernel computes x @ W^T + bias for W = q * s + o (quantization/int4.py) regrouped per
group g of K: y = sum_g s_g * (x_g . (q_g - 8)) + o'_g * sum(x_g) with o' = o + 8 s, which
is 0 for symmetric weights (then no offsets are stored). linear_q4.h's header says why and in
which order; reference.linear_packed_q4 is the twin.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stoker.kernels.cpu.common import _checked_library
from stoker.kernels.cpu.linear import _check_linear_args, _run_linear, pack_linear_weight, pack_scales, panel_width

ROWS_PER_BLOCK = 8  # rows of K per int32 lane (one nibble each)
Q8_BLOCK = 32  # W4A8: columns of K per int8 activation block (llama.cpp's Q8_0), one scale each


def pack_q4_weight(q: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """(N, K) uint8 codes in [0, 15] -> (P, K, NR / 2) uint8 panels for `linear_q4`: each
    panel's rows in blocks of 8, a block NR int32s, lane n holding rows 8b..8b+7 of column
    p*NR + n in nibbles 0..7 as q ^ 8 (linear_q4.h's layout; columns past N hold code 8, i.e. 0)."""
    if q.dim() != 2 or q.dtype != torch.uint8:
        raise ValueError(f"pack_q4_weight needs (N, K) uint8 codes, got {tuple(q.shape)} {q.dtype}")
    if q.shape[1] % ROWS_PER_BLOCK:
        raise ValueError(f"pack_q4_weight: the 4-bit kernel reads K in blocks of {ROWS_PER_BLOCK}; K = {q.shape[1]} is not a multiple")
    panels = pack_linear_weight(q ^ 8, gate_up=gate_up)  # (P, K, NR), padded columns 0 = code 8
    num_panels, k, nr = panels.shape
    blocks = panels.view(num_panels, k // ROWS_PER_BLOCK, ROWS_PER_BLOCK, nr).to(torch.int64)
    shifts = (4 * torch.arange(ROWS_PER_BLOCK, dtype=torch.int64)).view(1, 1, ROWS_PER_BLOCK, 1)
    lanes = (blocks << shifts).sum(dim=2)  # (P, K / 8, NR) in [0, 2^32)
    lanes = torch.where(lanes >= 2**31, lanes - 2**32, lanes).to(torch.int32)
    return lanes.contiguous().view(torch.uint8).view(num_panels, k, nr // 2)


def unpack_q4_panels(packed: torch.Tensor) -> torch.Tensor:
    """(P, K, NR / 2) panels of `pack_q4_weight` -> (P, K, NR) int64 codes q - 8 in [-8, 7]."""
    num_panels, k, half = packed.shape
    lanes = packed.contiguous().view(torch.int32).view(num_panels, k // ROWS_PER_BLOCK, 2 * half).to(torch.int64)
    shifts = (4 * torch.arange(ROWS_PER_BLOCK, dtype=torch.int64)).view(1, 1, ROWS_PER_BLOCK, 1)
    nibbles = (lanes.unsqueeze(2) >> shifts) & 0x0F  # (P, K / 8, 8, NR)
    return ((nibbles ^ 8) - 8).view(num_panels, k, 2 * half)


def pack_q4_scales(scale: torch.Tensor, offset: torch.Tensor, gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, G) scales and offsets of w = q * s + o -> (G, P * NR) scales in panel order, float16
    where every scale is exact in it (GGUF's are; 4.5 bits a weight in all) else float32, and
    (G, P * NR) float32 offsets o' = o + 8 s, or None when all are 0 (symmetric weights)."""
    s32 = pack_scales(scale.float(), torch.float32, gate_up)
    o8 = pack_scales((offset.float() + 8.0 * scale.float()).contiguous(), torch.float32, gate_up)
    s16 = s32.to(torch.float16)
    scales = s16 if torch.equal(s16.float(), s32) else s32
    return scales, (None if not torch.any(o8) else o8)


def linear_q4(
    x: torch.Tensor,  # (..., K) float32
    packed: torch.Tensor,  # (P, K, NR / 2) uint8 panels (pack_q4_weight)
    scales: torch.Tensor,  # (G, P * NR) float16 or float32 (pack_q4_scales)
    offsets: torch.Tensor | None,  # (G, P * NR) float32 o' = o + 8 s, or None (pack_q4_scales)
    group_k: int,  # columns of K per group, a multiple of 8
    out_features: int,
    bias: torch.Tensor | None = None,  # (P * NR,) in panel order
    silu_and_mul: bool = False,
) -> torch.Tensor:  # (..., N), or (..., N / 2) with silu_and_mul
    """x @ W^T + bias with W = q * scale + offset per group (linear_q4.h, stoker_linear_q4)."""
    return _run_q4("stoker_linear_q4", ROWS_PER_BLOCK, x, packed, scales, offsets, group_k, out_features, bias, silu_and_mul)


def linear_q4_a8(
    x: torch.Tensor,  # (..., K) float32
    packed: torch.Tensor,  # (P, K, NR / 2) uint8 panels (pack_q4_weight)
    scales: torch.Tensor,  # (G, P * NR) float16 or float32 (pack_q4_scales)
    offsets: torch.Tensor | None,  # (G, P * NR) float32 o' = o + 8 s, or None (pack_q4_scales)
    group_k: int,  # columns of K per group, a multiple of 32
    out_features: int,
    bias: torch.Tensor | None = None,  # (P * NR,) in panel order
    silu_and_mul: bool = False,
) -> torch.Tensor:  # (..., N), or (..., N / 2) with silu_and_mul
    """W4A8: as `linear_q4` on the same panels, with x quantized to int8 per block of 32
    columns (llama.cpp's Q8_0) and integer dot products (linear_q4_a8.h, stoker_linear_q4_a8;
    twin: reference.linear_packed_q4_a8)."""
    return _run_q4("stoker_linear_q4_a8", Q8_BLOCK, x, packed, scales, offsets, group_k, out_features, bias, silu_and_mul)


def _check_q4_panels(symbol: str, group_multiple: int, packed: torch.Tensor, scales: torch.Tensor,
                     offsets: torch.Tensor | None, group_k: int) -> tuple[int, int, int]:
    """The panels, scales and offsets of a 4-bit call fit together -> (num_panels, K, NR)."""
    num_panels, k, half = packed.shape
    nr = 2 * half
    if packed.dtype != torch.uint8 or not packed.is_contiguous() or nr != panel_width():
        raise ValueError(f"linear_q4 needs contiguous uint8 panels of {panel_width() // 2} bytes a row, got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    if group_k <= 0 or k % group_k or group_k % group_multiple:
        raise ValueError(f"{symbol.removeprefix('stoker_')}: group_k {group_k} must divide K = {k} and be a multiple of {group_multiple}")
    groups = (k // group_k, num_panels * nr)
    if scales.shape != groups or scales.dtype not in (torch.float16, torch.float32) or not scales.is_contiguous():
        raise ValueError(f"scales {tuple(scales.shape)} {scales.dtype}, expected contiguous {groups} float16 or float32")
    if offsets is not None and (offsets.shape != groups or offsets.dtype != torch.float32 or not offsets.is_contiguous()):
        raise ValueError(f"offsets {tuple(offsets.shape)} {offsets.dtype}, expected contiguous {groups} float32 or None")
    return num_panels, k, nr


def _run_q4(symbol: str, group_multiple: int, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
            offsets: torch.Tensor | None, group_k: int, out_features: int, bias: torch.Tensor | None,
            silu_and_mul: bool) -> torch.Tensor:
    """The argument checks of both 4-bit entry points, then one ctypes call of `symbol`."""
    kernel = getattr(_checked_library(), symbol)
    num_panels, k, nr = _check_q4_panels(symbol, group_multiple, packed, scales, offsets, group_k)
    half = nr // 2

    def call(rows: torch.Tensor, stride: int, out: torch.Tensor, width: int) -> None:
        status = kernel(
            rows.data_ptr(), stride, packed.data_ptr(), k * half, scales.data_ptr(), int(scales.dtype == torch.float16),
            None if offsets is None else offsets.data_ptr(), num_panels * nr, group_k,
            None if bias is None else bias.data_ptr(), out.data_ptr(), width, rows.shape[0], out_features, k,
            int(silu_and_mul), torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError(f"{symbol.removeprefix('stoker_')}: could not allocate its buffers")

    return _run_linear(x, packed, out_features, bias, silu_and_mul, call, nr)


class BoundQ4Linear:
    """One layer's `linear_q4` or `linear_q4_a8` with its weights checked once, when bound:
    a call checks x alone and makes the same ctypes call with the same arguments (so the same
    bits), without the per-call checks of the panels, scales, offsets and bias, the library
    lookup and the closure (~7 us a call, 112 calls a decode step of a 28-layer model).

    It holds detached views of the tensors it was bound to, so their storage outlives it:
    a layer whose parameters are replaced afterwards must bind again. x that is not a
    (M, K) float32 matrix with unit column stride and rows at least K apart takes the
    entry point itself (its checks, its copy)."""

    __slots__ = ("entry", "_args", "_before", "_after", "_kernel", "_k", "_width")

    def __init__(self, entry: Callable[..., torch.Tensor], packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group_k: int,
                 out_features: int, bias: torch.Tensor | None = None, silu_and_mul: bool = False) -> None:
        symbol, multiple = _ENTRY_POINTS[entry]
        self.entry = entry  # linear_q4 or linear_q4_a8: what a caller may compare its own kernel with
        num_panels, k, nr = _check_q4_panels(symbol, multiple, packed, scales, offsets, group_k)
        _check_linear_args(torch.empty(0, k, dtype=torch.float32), k, nr, num_panels, out_features, bias, silu_and_mul)
        self._args = (entry, packed.detach(), scales.detach(), None if offsets is None else offsets.detach(), group_k,
                      out_features, None if bias is None else bias.detach(), silu_and_mul)
        self._kernel = getattr(_checked_library(), symbol)
        self._k = k
        self._width = out_features // 2 if silu_and_mul else out_features
        # the ctypes arguments between x's row stride and out's pointer, and after M
        self._before = (packed.data_ptr(), k * nr // 2, scales.data_ptr(), int(scales.dtype == torch.float16),
                        None if offsets is None else offsets.data_ptr(), num_panels * nr, group_k,
                        None if bias is None else bias.data_ptr())
        self._after = (out_features, k, int(silu_and_mul))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) float32 -> (..., N) or (..., N / 2)
        k = self._k
        shape, strides = x.shape, x.stride()  # one call each: a tensor attribute costs ~0.2 us
        if len(shape) != 2 or shape[1] != k or strides[1] != 1 or x.dtype is not torch.float32 or (
                shape[0] > 1 and strides[0] < k) or not x.is_cpu:
            entry, *rest = self._args
            return entry(x, *rest)
        m = shape[0]
        width = self._width
        out = torch.empty((m, width), dtype=torch.float32)
        if m:
            status = self._kernel(x.data_ptr(), strides[0], *self._before, out.data_ptr(), width, m, *self._after,
                                  torch.get_num_threads())
            if status:
                raise MemoryError(f"{self._args[0].__name__}: could not allocate its buffers")
        return out


_ENTRY_POINTS = {linear_q4: ("stoker_linear_q4", ROWS_PER_BLOCK), linear_q4_a8: ("stoker_linear_q4_a8", Q8_BLOCK)}


# -- GGUF's Q4_K in its own bytes, W4A8 (linear_q4k_a8.h) ---------------------------------------
Q4K_SUPER = 256  # columns of K per super-block: one d and one dmin
Q4K_SUB_MAX = 63  # sc and m are 6-bit


def _factor_unsigned(v: torch.Tensor, per: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(N, G) float32 values -> (ints (N, G) uint8 in [0, 63], D (N, G / per) float32) with
    D * ints == v exactly for every value, or None when some run of `per` has no such factoring.
    D is the run's value of largest magnitude over the integer it was quantized to: tried from
    63 down (llama.cpp's Q4_K quantizer gives the largest sub-scale 63; most runs resolve there)."""
    n, g = v.shape
    if g % per or v.dtype != torch.float32:
        return None
    runs = v.reshape(-1, per)  # (N * S, per)
    top = runs.gather(1, runs.abs().argmax(dim=1, keepdim=True))  # (N * S, 1), signed
    ints = torch.zeros_like(runs)
    scale = torch.zeros_like(top)
    todo = (top != 0).squeeze(1).nonzero().squeeze(1)  # an all-zero run: D = 0, ints 0
    for c in range(Q4K_SUB_MAX, 0, -1):
        if todo.numel() == 0:
            break
        cand = top[todo] / c
        q = torch.round(runs[todo] / cand)
        ok = ((q >= 0) & (q <= Q4K_SUB_MAX) & (cand * q == runs[todo])).all(dim=1)
        ints[todo[ok]], scale[todo[ok]] = q[ok], cand[ok]
        todo = todo[~ok]
    if todo.numel():
        return None
    return ints.to(torch.uint8).reshape(n, g), scale.reshape(n, g // per)


def factor_q4_k(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The 4-bit method's (N, K / 32) scales and offsets of a Q4_K weight (scale = d sc, offset
    = -(dmin m)) -> (sub (2, N, K / 32) uint8 [sc; m], sup (2, N, K / 256) float32 [d; dmin]),
    every product exact, or None (not Q4_K's form: other groups, offsets of either sign ...)."""
    per = Q4K_SUPER // Q8_BLOCK
    s = _factor_unsigned(scale.float().contiguous(), per)
    o = _factor_unsigned((-offset.float()).contiguous(), per)
    if s is None or o is None:
        return None
    return torch.stack([s[0], o[0]]), torch.stack([s[1], o[1]])


def pack_q4k_scales(sub: torch.Tensor, sup: torch.Tensor, gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """factor_q4_k's (2, N, G) uint8 and (2, N, S) float32 -> (2, G, P * NR) uint8 and (2, S, P *
    NR) float32, columns in the panels' order (zero past N): what `linear_q4k_a8` takes."""
    def columns(t: torch.Tensor) -> torch.Tensor:  # (N, R) -> (R, P * NR)
        return torch.stack([pack_linear_weight(t[:, r].contiguous(), gate_up=gate_up) for r in range(t.shape[1])])

    return (torch.stack([columns(sub[0]), columns(sub[1])]).contiguous(),
            torch.stack([columns(sup[0]), columns(sup[1])]).contiguous())


def check_q4k(packed: torch.Tensor, sub: torch.Tensor, sup: torch.Tensor) -> tuple[int, int, int]:
    """The panels and sub- / super-scales of a Q4_K W4A8 call fit together -> (num_panels, K, NR)."""
    num_panels, k, half = packed.shape
    nr = 2 * half
    if packed.dtype != torch.uint8 or not packed.is_contiguous() or nr != panel_width():
        raise ValueError(f"linear_q4k_a8 needs contiguous uint8 panels of {panel_width() // 2} bytes a row, got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    k_groups = k // Q8_BLOCK
    if k % Q4K_SUPER:
        raise ValueError(f"linear_q4k_a8: K = {k} is not a multiple of {Q4K_SUPER}")
    if sub.shape != (2, k_groups, num_panels * nr) or sub.dtype != torch.uint8 or not sub.is_contiguous():
        raise ValueError(f"sub-scales {tuple(sub.shape)} {sub.dtype}, expected contiguous (2, {k_groups}, {num_panels * nr}) uint8")
    if sup.shape != (2, k // Q4K_SUPER, num_panels * nr) or sup.dtype != torch.float32 or not sup.is_contiguous():
        raise ValueError(f"super-scales {tuple(sup.shape)} {sup.dtype}, expected contiguous "
                         f"(2, {k // Q4K_SUPER}, {num_panels * nr}) float32")
    return num_panels, k, nr


def linear_q4k_a8(
    x: torch.Tensor,  # (..., K) float32
    packed: torch.Tensor,  # (P, K, NR / 2) uint8 panels (pack_q4_weight)
    sub: torch.Tensor,  # (2, K / 32, P * NR) uint8 [sc; m] (pack_q4k_scales)
    sup: torch.Tensor,  # (2, K / 256, P * NR) float32 [d; dmin]
    group_k: int,  # 32: the 4-bit method's call shape (Q4_K's groups)
    out_features: int,
    bias: torch.Tensor | None = None,  # (P * NR,) in panel order
    silu_and_mul: bool = False,
) -> torch.Tensor:  # (..., N), or (..., N / 2) with silu_and_mul
    """W4A8 on Q4_K's own bytes: the 4-bit panels with integer sub-scales sc and m per 32 and
    float32 d, dmin per 256 (linear_q4k_a8.h, stoker_linear_q4k_a8; twin
    reference.linear_packed_q4k_a8)."""
    if group_k != Q8_BLOCK:
        raise ValueError(f"linear_q4k_a8 holds Q4_K's groups of {Q8_BLOCK}, not {group_k}")
    lib = _checked_library()
    num_panels, k, nr = check_q4k(packed, sub, sup)

    def call(rows: torch.Tensor, stride: int, out: torch.Tensor, width: int) -> None:
        status = lib.stoker_linear_q4k_a8(
            rows.data_ptr(), stride, packed.data_ptr(), k * nr // 2, sub.data_ptr(), sup.data_ptr(), num_panels * nr,
            None if bias is None else bias.data_ptr(), out.data_ptr(), width, rows.shape[0], out_features, k,
            int(silu_and_mul), torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("linear_q4k_a8: could not allocate its buffers")

    return _run_linear(x, packed, out_features, bias, silu_and_mul, call, nr)
