"""Python entry points of linear.c (float32 activations; float32, int8 or FP8 weights): the
weight panels it reads (`pack_linear_weight`, `pack_scales`), `linear`, `linear_q8` and the
gate/up fusion helpers; argument checks, then one ctypes call (4-bit weights: linear_q4.py).

`linear` and `linear_q8` have the semantics of their twins reference.linear_packed and
reference.linear_packed_q8; the weight methods bind them when a model is built
(layers/weight_method.py, layers/quantized_method.py). The C code trusts its indices, so
everything that could make it read or write outside a tensor is checked here first.
"""

from __future__ import annotations

import torch

from stoker.kernels.cpu import elementwise
from stoker.kernels.cpu.common import _as_rows, _checked_library


def target() -> str:
    """The instruction set the loaded library was built for: "avx512", "avx2" or "sse2"."""
    return _checked_library().stoker_cpu_target().decode()


def panel_width() -> int:
    """NR: the columns of one weight panel of the C linear kernel (64 with AVX-512)."""
    return int(_checked_library().stoker_linear_nr())


def pack_linear_weight(weight: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """(N, K) weight -> (P, K, NR) panels, P = ceil(N / NR); columns past N are zero.

    Panel p holds W[p*NR:(p+1)*NR]^T row-major, so the kernel streams one contiguous
    K x NR block per panel (a strided (K, N) layout was up to 2x slower: rows 4 KB apart
    alias in L1 and defeat the prefetchers).
    gate_up: W is [gate; up], (2 * I, K) with I a multiple of NR / 2, and each panel gets
    NR / 2 gate rows then the matching NR / 2 up rows, for `linear(..., silu_and_mul=True)`.
    """
    if weight.dim() > 2 or weight.dtype not in _PANEL_DTYPES or weight.device.type != "cpu":
        raise ValueError(f"pack_linear_weight needs a CPU float32, int8 or fp8 (N, K) weight, got {tuple(weight.shape)} {weight.dtype}")
    if weight.dtype == torch.float8_e4m3fn:  # moved as bytes: not every torch op takes float8
        return pack_linear_weight(weight.view(torch.uint8), gate_up).view(torch.float8_e4m3fn)
    nr = panel_width()
    if gate_up:
        return _pack_gate_up(weight, nr)
    if weight.dim() == 1:  # a bias: same panel order, padded
        return torch.cat([weight, weight.new_zeros(-weight.shape[0] % nr)])
    n, k = weight.shape
    num_panels = -(-n // nr)
    padded = weight
    if n % nr:  # only then a padded copy: packing a large LM head costs one copy, not two
        padded = weight.new_zeros(num_panels * nr, k)
        padded[:n] = weight
    return padded.reshape(num_panels, nr, k).transpose(1, 2).contiguous()


_PANEL_DTYPES = (torch.float32, torch.int8, torch.uint8, torch.float8_e4m3fn)
# linear.c's weight formats
_Q8_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2}
# FP8 panels are widened through fp16 bits, which read each value / 256 (linear.c's header):
# their scales carry the 256.
FP8_SCALE_FOLD = 256.0


def pack_scales(scale: torch.Tensor, fmt_dtype: torch.dtype, gate_up: bool = False) -> torch.Tensor:
    """(N, G) per-row, per-group scales -> (G, P * NR) float32 in the panels' column order
    (zero past N), times FP8_SCALE_FOLD for FP8 weights: what `linear_q8` takes."""
    fold = FP8_SCALE_FOLD if fmt_dtype == torch.float8_e4m3fn else 1.0
    cols = [pack_linear_weight(scale[:, g].float().contiguous() * fold, gate_up=gate_up) for g in range(scale.shape[1])]
    return torch.stack(cols).contiguous()


def linear_q8(
    x: torch.Tensor,  # (..., K) float32
    packed: torch.Tensor,  # (P, K, NR) int8 or float8_e4m3fn panels (pack_linear_weight)
    scales: torch.Tensor,  # (G, P * NR) float32 (pack_scales)
    group_k: int,  # columns of K per scale group (K for one scale per column)
    out_features: int,
    bias: torch.Tensor | None = None,  # (P * NR,) in panel order
    silu_and_mul: bool = False,
) -> torch.Tensor:  # (..., N), or (..., N / 2) with silu_and_mul
    """x @ dequantize(W)^T + bias with one-byte weights (linear.c, stoker_linear_q8)."""
    lib = _checked_library()
    num_panels, k, nr = packed.shape
    fmt = _Q8_FORMATS.get(packed.dtype)
    if fmt is None or not packed.is_contiguous():
        raise ValueError(f"linear_q8 needs contiguous int8 or float8_e4m3fn panels, got {packed.dtype}")
    groups = -(-k // group_k) if group_k > 0 else 0
    if scales.shape != (groups, num_panels * nr) or scales.dtype != torch.float32 or not scales.is_contiguous():
        raise ValueError(f"scales {tuple(scales.shape)} {scales.dtype}, expected contiguous ({groups}, {num_panels * nr}) float32")

    def call(rows: torch.Tensor, stride: int, out: torch.Tensor, width: int) -> None:
        status = lib.stoker_linear_q8(
            rows.data_ptr(), stride, packed.data_ptr(), nr, k * nr, fmt, scales.data_ptr(), num_panels * nr, group_k,
            None if bias is None else bias.data_ptr(), out.data_ptr(), width, rows.shape[0], out_features, k,
            int(silu_and_mul), torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("linear_q8: could not allocate the dequantization buffer")

    return _run_linear(x, packed, out_features, bias, silu_and_mul, call)


def _run_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, silu_and_mul: bool, call,
    nr: int | None = None,
) -> torch.Tensor:
    """What linear, linear_q8 and linear_q4 (linear_q4.py) share: check x and bias against the panels (of nr
    columns: packed's last dimension unless given), view x as rows, allocate the output,
    `call(rows, row_stride, out, width)` the kernel unless x is empty."""
    num_panels, k, last = packed.shape
    nr = nr or last
    _check_linear_args(x, k, nr, num_panels, out_features, bias, silu_and_mul)
    rows, stride = _as_rows(x)
    width = out_features // 2 if silu_and_mul else out_features
    out = torch.empty((rows.shape[0], width), dtype=torch.float32)
    if rows.shape[0]:
        call(rows, stride, out, width)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], width)


def _check_linear_args(
    x: torch.Tensor, k: int, nr: int, num_panels: int, out_features: int, bias: torch.Tensor | None, silu_and_mul: bool
) -> None:
    if x.shape[-1] != k or not (num_panels - 1) * nr < out_features <= num_panels * nr:
        raise ValueError(f"x {tuple(x.shape)} does not fit packed weight ({num_panels}, {k}, {nr}) with {out_features} outputs")
    if silu_and_mul and out_features != num_panels * nr:
        raise ValueError(f"silu_and_mul needs whole panels: {out_features} outputs, panels of {nr}")
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if bias is not None and (bias.shape != (num_panels * nr,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype}, expected packed ({num_panels * nr},) float32")


def gate_up_fusable(intermediate_size: int) -> bool:
    return intermediate_size % (panel_width() // 2) == 0


def _pack_gate_up(weight: torch.Tensor, nr: int) -> torch.Tensor:
    """[gate; up] (2I, ...) -> per panel NR/2 gate rows then NR/2 up rows (a bias: (2I,))."""
    inter, half = weight.shape[0] // 2, nr // 2
    if weight.shape[0] % 2 or not gate_up_fusable(inter):
        raise ValueError(f"gate_up weight of {weight.shape[0]} rows: needs 2 * I rows with I a multiple of {half}")
    rest = weight.shape[1:]
    gate, up = weight[:inter].reshape(inter // half, half, *rest), weight[inter:].reshape(inter // half, half, *rest)
    interleaved = torch.cat([gate, up], dim=1)  # (P, NR, ...)
    if not rest:
        return interleaved.reshape(-1).contiguous()
    return interleaved.transpose(1, 2).contiguous()  # (P, K, NR)


def gate_up_rows(out_features: int) -> torch.Tensor:
    """(2I,) int64: the [gate; up] row each output column of a gate_up-packed layer holds when
    the kernel runs without silu_and_mul (its panel order), so out[:, c] is row gate_up_rows[c]."""
    return _pack_gate_up(torch.arange(out_features), panel_width())


def silu_and_mul_panels(pre: torch.Tensor) -> torch.Tensor:
    """(T, 2I) a gate_up-packed layer's output in panel order -> (T, I) silu(gate) * up in
    [gate; up] order: each panel is NR/2 gate then NR/2 up columns, so the rows of NR are
    [gate | up] pairs for silu_and_mul, and panel p's results are columns p*NR/2.. of the output."""
    num_tokens, n = pre.shape
    return elementwise.silu_and_mul(pre.reshape(-1, panel_width())).view(num_tokens, n // 2)


def linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None, silu_and_mul: bool = False
) -> torch.Tensor:
    """x (..., K) @ W^T + bias -> (..., N), with W given as `pack_linear_weight(W)` and bias
    as `pack_linear_weight(bias)` (its panel order, padded). silu_and_mul: W and bias packed
    with gate_up=True, N = 2 * I, and the result is silu(gate) * up, (..., I)."""
    lib = _checked_library()
    num_panels, k, nr = packed.shape
    if packed.dtype != torch.float32 or not packed.is_contiguous():
        raise ValueError(f"float32 and contiguous panels only: x {x.dtype}, packed {packed.dtype}")

    def call(rows: torch.Tensor, stride: int, out: torch.Tensor, width: int) -> None:
        lib.stoker_linear_f32(
            rows.data_ptr(), stride, packed.data_ptr(), nr, k * nr, None if bias is None else bias.data_ptr(),
            out.data_ptr(), width, rows.shape[0], out_features, k, int(silu_and_mul), torch.get_num_threads(),
        )  # fmt: skip

    return _run_linear(x, packed, out_features, bias, silu_and_mul, call)
