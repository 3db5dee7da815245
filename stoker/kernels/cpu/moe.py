"""Python entry point of moe.c: a MoE layer's routed experts in one C call (CPU float32).

`fused_moe` has the semantics of its twin reference.fused_moe (an expert-by-expert loop),
with the weights as linear.c's panels, one set per expert (`pack_experts`). The C code
trusts its shapes and strides, so they are checked here; the expert ids it checks itself
(a host read of them here would cost what the kernel saves at decode).
"""

from __future__ import annotations

import torch

from stoker.kernels.cpu import linear as cpu_linear
from stoker.kernels.cpu.common import _as_rows, _checked_library
from stoker.kernels.cpu.huge_pages import empty_huge


#: the activations moe.c applies after the gate/up GEMM (its ACT_* enum)
ACTIVATIONS = {"silu": 0, "swigluoai": 1}


def pack_experts(w13: torch.Tensor, w2: torch.Tensor, silu_fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 (E, 2I, H) [gate; up], w2 (E, H, I) -> (E, P13, H, NR), (E, P2, I, NR) panels;
    gate_up-interleaved w13 when silu_fused (I a multiple of NR / 2). In huge pages where the
    system allows (huge_pages.py: the kernel streams them, and at 1-64 tokens that stream is
    most of a call), one expert packed at a time."""
    packed = []
    for stacked, gate_up in ((w13, silu_fused), (w2, False)):
        first = cpu_linear.pack_linear_weight(stacked[0], gate_up=gate_up)
        out = empty_huge((stacked.shape[0], *first.shape), first.dtype)
        out[0] = first
        for e in range(1, stacked.shape[0]):
            out[e] = cpu_linear.pack_linear_weight(stacked[e], gate_up=gate_up)
        packed.append(out)
    return packed[0], packed[1]


def pack_expert_bias(bias: torch.Tensor) -> torch.Tensor:
    """(E, N) per-expert biases -> (E, P * NR), each padded with zeros to whole panels (the
    plain panels' column order is the natural one; gate_up-packed panels take no bias)."""
    nr = cpu_linear.panel_width()
    return torch.nn.functional.pad(bias.float(), (0, -bias.shape[1] % nr)).contiguous()


def fused_moe(
    x: torch.Tensor,  # (T, H) float32
    w13: torch.Tensor,  # (E, P13, H, NR) float32 panels (pack_experts)
    w2: torch.Tensor,  # (E, P2, I, NR)
    topk_weights: torch.Tensor,  # (T, k) float32
    topk_ids: torch.Tensor,  # (T, k) int64 in [0, E)
    intermediate_size: int,
    silu_fused: bool,
    b13: torch.Tensor | None = None,  # (E, P13 * NR) float32 (pack_expert_bias), or None
    b2: torch.Tensor | None = None,  # (E, P2 * NR)
    activation: str = "silu",  # or "swigluoai": gpt-oss's clamped SwiGLU with alpha and limit
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:  # (T, H)
    """sum over each token's choices, in ascending expert order, of
    w * (act(x @ gate_e^T + b13_e[:I], x @ up_e^T + b13_e[I:]) @ down_e^T + b2_e) (moe.c)."""
    lib = _checked_library()
    num_experts, p13, hidden, nr = w13.shape
    inter = intermediate_size
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype != torch.float32:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}: expected (T, {hidden}) float32")
    if w13.dtype != torch.float32 or w2.dtype != torch.float32 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("w13 and w2 must be contiguous float32 panels (pack_experts)")
    if nr != cpu_linear.panel_width() or p13 != -(-2 * inter // nr):
        raise ValueError(f"w13 {tuple(w13.shape)} is not (E, ceil(2 * {inter} / NR), H, NR) panels, NR = {cpu_linear.panel_width()}")
    if silu_fused and (2 * inter) % nr:
        raise ValueError(f"silu_fused needs I = {inter} to fill whole panels of {nr} columns")
    if w2.shape != (num_experts, -(-hidden // nr), inter, nr):
        raise ValueError(f"w2 {tuple(w2.shape)} is not ({num_experts}, ceil({hidden} / NR), {inter}, {nr}) panels")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: moe.c applies {', '.join(ACTIVATIONS)}")
    if silu_fused and (activation != "silu" or b13 is not None):
        raise ValueError("silu_fused takes SiLU without a gate/up bias (gate_up-packed panels interleave the columns)")
    _check_biases(((("b13", b13, p13 * nr), ("b2", b2, w2.shape[1] * nr))), num_experts)
    ids, weights, out = _routing(x, topk_weights, topk_ids, hidden)
    num_tokens, k = ids.shape
    if num_tokens == 0:
        return out
    rows, stride = _as_rows(x)
    status = lib.stoker_fused_moe_f32(
        rows.data_ptr(), stride, ids.data_ptr(), weights.data_ptr(), num_tokens, k, num_experts,
        w13.data_ptr(), hidden * nr, p13 * hidden * nr, w2.data_ptr(), inter * nr, w2.shape[1] * inter * nr,
        hidden, inter, int(silu_fused), b13.data_ptr() if b13 is not None else None,
        b2.data_ptr() if b2 is not None else None, ACTIVATIONS[activation], alpha, limit,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _raise_on(status, "fused_moe", num_experts)
    return out


def fused_moe_mxfp4(
    x: torch.Tensor,  # (T, H) float32
    w13_blocks: torch.Tensor,  # (E, 2I, H / 32, 16) uint8, rows [gate; up]
    w13_scales: torch.Tensor,  # (E, 2I, H / 32) uint8
    w2_blocks: torch.Tensor,  # (E, H, I / 32, 16) uint8
    w2_scales: torch.Tensor,  # (E, H, I / 32) uint8
    topk_weights: torch.Tensor,  # (T, k) float32
    topk_ids: torch.Tensor,  # (T, k) int64 in [0, E)
    b13: torch.Tensor | None = None,  # (E, P13 * NR) float32 (pack_expert_bias), or None
    b2: torch.Tensor | None = None,  # (E, P2 * NR)
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:  # (T, H)
    """`fused_moe` with MXFP4 experts held as their blocks and scales (moe.c dequantizes each
    GEMM task's panel): the twin is reference.fused_moe on formats.dequantize_mxfp4's weights."""
    lib = _checked_library()
    num_experts, n13, groups13, nb = w13_blocks.shape
    hidden, inter, nr = groups13 * 32, n13 // 2, cpu_linear.panel_width()
    for name, t, shape in (("w13_blocks", w13_blocks, (num_experts, 2 * inter, hidden // 32, 16)),
                           ("w13_scales", w13_scales, (num_experts, 2 * inter, hidden // 32)),
                           ("w2_blocks", w2_blocks, (num_experts, hidden, inter // 32, 16)),
                           ("w2_scales", w2_scales, (num_experts, hidden, inter // 32))):
        if tuple(t.shape) != shape or t.dtype != torch.uint8 or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype}: expected contiguous uint8 {shape}")
    if inter % 32:
        raise ValueError(f"MXFP4 experts need I = {inter} to be a multiple of 32")
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype != torch.float32:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}: expected (T, {hidden}) float32")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: moe.c applies {', '.join(ACTIVATIONS)}")
    _check_biases((("b13", b13, -(-2 * inter // nr) * nr), ("b2", b2, -(-hidden // nr) * nr)), num_experts)
    ids, weights, out = _routing(x, topk_weights, topk_ids, hidden)
    num_tokens, k = ids.shape
    if num_tokens == 0:
        return out
    rows, stride = _as_rows(x)
    status = lib.stoker_fused_moe_mxfp4_f32(
        rows.data_ptr(), stride, ids.data_ptr(), weights.data_ptr(), num_tokens, k, num_experts,
        w13_blocks.data_ptr(), w13_scales.data_ptr(), w2_blocks.data_ptr(), w2_scales.data_ptr(), hidden, inter,
        b13.data_ptr() if b13 is not None else None, b2.data_ptr() if b2 is not None else None,
        ACTIVATIONS[activation], alpha, limit, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _raise_on(status, "fused_moe_mxfp4", num_experts)
    return out


def pack_coded_experts(codes: torch.Tensor, scale: torch.Tensor,
                       offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coded experts (layers/moe_int4.py, layers/moe_mixed.py) into moe.c's panels: codes
    (E, N, B) one byte each, B = K / 2 for int4 (uint8, two a byte with even k in the low
    nibble) or K for int8 (int8, one a byte), scale and offset (E, N, G) float32 ->
    codes (E, P, B, NR), byte b of a panel row holding its NR columns' byte b (int4: k = 2b
    low, 2b + 1 high), and scale, offset (E, P, G, NR); columns past N zero (they dequantize to
    0, as pack_linear_weight pads). Contiguous along NR, so the kernel dequantizes a row of a
    panel as one vector loop."""
    nr = cpu_linear.panel_width()
    e, n, width = codes.shape
    pad = -n % nr
    # the bytes stay as they are, regrouped by panel and transposed
    padded = torch.nn.functional.pad(codes, (0, 0, 0, pad))  # (E, P * NR, B)
    panels = padded.view(e, -1, nr, width).transpose(2, 3).contiguous()
    groups = []
    for t in (scale, offset):
        t = torch.nn.functional.pad(t.float(), (0, 0, 0, pad))  # (E, P * NR, G)
        groups.append(t.view(e, -1, nr, t.shape[2]).transpose(2, 3).contiguous())
    return panels, groups[0], groups[1]


#: a coded projection for fused_moe_coded: codes (E, P, K / 2, NR) uint8 (int4) or (E, P, K, NR)
#: int8, scale and offset (E, P, K / group, NR) float32 (pack_coded_experts), group, bits (4 or 8)
CodedWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]


def fused_moe_int4(
    x: torch.Tensor,  # (T, H) float32
    w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],  # codes (E, P13, H / 2, NR), scale, offset (E, P13, H / g13, NR), g13
    w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],  # codes (E, P2, I / 2, NR), scale, offset (E, P2, I / g2, NR), g2
    topk_weights: torch.Tensor,  # (T, k) float32
    topk_ids: torch.Tensor,  # (T, k) int64 in [0, E)
    b13: torch.Tensor | None = None,  # (E, P13 * NR) float32 (pack_expert_bias), or None
    b2: torch.Tensor | None = None,  # (E, P2 * NR)
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:  # (T, H)
    """`fused_moe` with int4 experts held as their codes, scales and offsets in panels
    (pack_coded_experts; w = q * scale + offset per group; moe.c dequantizes each GEMM task's
    panel): the twin is reference.fused_moe on int4.dequantize's weights."""
    return fused_moe_coded(x, (*w13, 4), (*w2, 4), topk_weights, topk_ids, b13, b2, activation, alpha, limit)


def fused_moe_coded(
    x: torch.Tensor,  # (T, H) float32
    w13: CodedWeights,  # [gate; up]: K = H, N = 2I
    w2: CodedWeights,  # down: K = I, N = H
    topk_weights: torch.Tensor,  # (T, k) float32
    topk_ids: torch.Tensor,  # (T, k) int64 in [0, E)
    b13: torch.Tensor | None = None,  # (E, P13 * NR) float32 (pack_expert_bias), or None
    b2: torch.Tensor | None = None,  # (E, P2 * NR)
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:  # (T, H)
    """`fused_moe` with each projection held as int4 or int8 codes with a scale and an offset
    per group, in panels (pack_coded_experts; w = q * scale + offset; moe.c dequantizes each
    GEMM task's panel, q * s rounded, + o rounded): the twin is reference.fused_moe on
    int4.dequantize's weights (which takes int8 codes as well)."""
    lib = _checked_library()
    (c13, s13, o13, g13, bits13), (c2, s2, o2, g2, bits2) = w13, w2
    nr = cpu_linear.panel_width()
    if bits13 not in (4, 8) or bits2 not in (4, 8):
        raise ValueError(f"coded experts hold 4- or 8-bit codes, not {bits13} (w13) and {bits2} (w2)")
    per_byte13, per_byte2 = 2 if bits13 == 4 else 1, 2 if bits2 == 4 else 1
    num_experts, p13, bytes13, _ = c13.shape
    hidden, inter = per_byte13 * bytes13, per_byte2 * c2.shape[2]
    p2 = -(-hidden // nr)
    if g13 <= 0 or g2 <= 0 or g13 % 2 or g2 % 2 or hidden % g13 or inter % g2:
        raise ValueError(f"coded groups of {g13} (of H = {hidden}) and {g2} (of I = {inter}) columns: moe.c needs "
                         "even groups that divide their K")
    if p13 != -(-2 * inter // nr):
        raise ValueError(f"w13 codes {tuple(c13.shape)} are not (E, ceil(2 * {inter} / NR), H bytes, NR) panels, NR = {nr}")
    code13, code2 = (torch.uint8 if b == 4 else torch.int8 for b in (bits13, bits2))
    for name, t, shape, dtype in (("w13 codes", c13, (num_experts, p13, hidden // per_byte13, nr), code13),
                                  ("w13 scale", s13, (num_experts, p13, hidden // g13, nr), torch.float32),
                                  ("w13 offset", o13, (num_experts, p13, hidden // g13, nr), torch.float32),
                                  ("w2 codes", c2, (num_experts, p2, inter // per_byte2, nr), code2),
                                  ("w2 scale", s2, (num_experts, p2, inter // g2, nr), torch.float32),
                                  ("w2 offset", o2, (num_experts, p2, inter // g2, nr), torch.float32)):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype}: expected contiguous {dtype} {shape} (pack_coded_experts)")
    if x.dim() != 2 or x.shape[1] != hidden or x.dtype != torch.float32:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}: expected (T, {hidden}) float32")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: moe.c applies {', '.join(ACTIVATIONS)}")
    _check_biases((("b13", b13, p13 * nr), ("b2", b2, p2 * nr)), num_experts)
    ids, weights, out = _routing(x, topk_weights, topk_ids, hidden)
    num_tokens, k = ids.shape
    if num_tokens == 0:
        return out
    rows, stride = _as_rows(x)
    status = lib.stoker_fused_moe_coded_f32(
        rows.data_ptr(), stride, ids.data_ptr(), weights.data_ptr(), num_tokens, k, num_experts,
        c13.data_ptr(), bits13, s13.data_ptr(), o13.data_ptr(), g13, c2.data_ptr(), bits2, s2.data_ptr(), o2.data_ptr(),
        g2, hidden, inter, b13.data_ptr() if b13 is not None else None, b2.data_ptr() if b2 is not None else None,
        ACTIVATIONS[activation], alpha, limit, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _raise_on(status, "fused_moe_coded", num_experts)
    return out


def _routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing as moe.c reads it: ids (T, k) int64 and weights (T, k) float32, contiguous,
    and the (T, hidden) float32 output; the shapes checked against x's tokens."""
    num_tokens, k = topk_ids.shape
    if topk_weights.shape != (num_tokens, k) or num_tokens != x.shape[0]:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)} and x "
                         f"{tuple(x.shape)} disagree")
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    return ids, weights, torch.empty(num_tokens, hidden, dtype=torch.float32)


def _check_biases(biases: tuple[tuple[str, torch.Tensor | None, int], ...], num_experts: int) -> None:
    """Each given bias (name, tensor, panel-padded width) is contiguous float32 (E, width) (pack_expert_bias)."""
    for name, bias, width in biases:
        if bias is not None and (bias.shape != (num_experts, width) or bias.dtype != torch.float32
                                 or not bias.is_contiguous()):
            raise ValueError(f"{name} {tuple(bias.shape)} {bias.dtype}: expected contiguous float32 "
                             f"({num_experts}, {width}) (pack_expert_bias)")


def _raise_on(status: int, kernel: str, num_experts: int) -> None:
    """moe.c's status: 1 scratch allocation failed, 2 an expert id out of range."""
    if status == 1:
        raise MemoryError(f"{kernel}: could not allocate the scratch buffers")
    if status == 2:
        raise ValueError(f"topk_ids hold expert ids outside [0, {num_experts})")
