"""The decode GEMVs (kernels/quant_gemv.py, interpreted here, compiled in tests/gpu) against
their twins (reference.gemv_w4 / gemv_w8) and the existing twins (reference.w4a16_linear /
w8_linear): M = 1..8, N not a multiple of the N block, K with several groups, per channel,
symmetric and asymmetric 4-bit, int8 and fp8, bias and none, split K and a single pass; every
element of a poisoned output written; the W4 dequantize kernel bit-exact against its twin; and
which path the int4 / 8-bit CUDA backends take for which M."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stoker.kernels import reference
from stoker.quantization import formats, int4

triton = pytest.importorskip("triton")
from stoker.kernels.quant_gemv import GEMV_ROWS, dequant_w4, gemv_w4, gemv_w8, supports, tile_config  # noqa: E402
from stoker.kernels.w4a16_linear import hold_scales  # noqa: E402


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def w4_weights(n: int, k: int, group: int, symmetric: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, s, o = int4.quantize(torch.randn(n, k, generator=gen) / k**0.5, group, symmetric)
    if not symmetric:
        s = s * (1 + 2**-20)  # not exact in float16: float32 scales, as zero-point checkpoints often hold
    scale, offset = hold_scales(s, o)
    return int4.pack(q), scale, offset


def poisoned(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype)


# (M, N, K, group): N never a multiple of the N block (8 / 4 / 2 rows), K of 2..16 groups or one
# per channel (group = K), and (N 20, K 4096) splits K in two
W4_CASES = [(1, 37, 256, 32), (2, 13, 512, 64), (3, 21, 512, 128), (5, 11, 256, 256), (8, 9, 1024, 128), (4, 8, 4096, 128),
            (7, 5, 384, 384)]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("num_rows, out_features, in_features, group", W4_CASES)
def test_gemv_w4_matches_its_twin_and_the_w4a16_twin(num_rows, out_features, in_features, group, symmetric) -> None:
    packed, scale, offset = w4_weights(out_features, in_features, group, symmetric)
    assert (offset is None) == symmetric
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if num_rows % 2 else None
    out = gemv_w4(x, packed, scale, offset, group, bias, out=poisoned(num_rows, out_features, torch.float32))
    assert not out.isnan().any()
    assert rel_err(out, reference.gemv_w4(x, packed, scale, offset, group, bias)) < 1e-6
    # float32 x: the same as the existing twin, which forms the weight in float32 too
    assert rel_err(out, reference.w4a16_linear(x, packed, scale, offset, group, bias)) < 1e-5
    for dtype in (torch.bfloat16, torch.float16):
        xh = x.to(dtype)
        out = gemv_w4(xh, packed, scale, offset, group, bias, out=poisoned(num_rows, out_features, dtype))
        assert out.dtype == dtype and not out.isnan().any()
        # float32 sums in another order, one rounding of the result (a tie may land the other way)
        assert rel_err(out, reference.gemv_w4(xh, packed, scale, offset, group, bias)) < 1e-3, dtype
        # the w4a16 twin rounds the weight to x's dtype first (~2^-9 of each weight)
        assert rel_err(out, reference.w4a16_linear(xh, packed, scale, offset, group, bias)) < 1e-2, dtype


@pytest.mark.parametrize("dtype, group, num_rows, out_features, in_features",
                         [(d, g, *shape) for d, g in (("int8", 0), ("fp8", 0), ("fp8", 128), ("int8", 32))
                          for shape in ((1, 13, 256), (3, 7, 512), (6, 9, 128))]
                         + [("int8", 32, 8, 5, 8192), ("fp8", 128, 8, 5, 8192)])  # K split in two: two cases (interpreter time)
def test_gemv_w8_matches_its_twin_and_the_w8_twin(dtype, group, num_rows, out_features, in_features) -> None:
    gen = torch.Generator().manual_seed(2)
    q, s = formats.quantize_rows(torch.randn(out_features, in_features, generator=gen), dtype)
    group_k = group or in_features
    if group:  # per-group scales (FP8 blocks, INT8 groups)
        s = torch.rand(out_features, in_features // group, generator=gen) * 0.01 + 1e-3
    x = torch.randn(num_rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if num_rows != 3 else None
    out = gemv_w8(x, q, s, group_k, bias, out=poisoned(num_rows, out_features, torch.float32))
    assert not out.isnan().any()
    assert rel_err(out, reference.gemv_w8(x, q, s, group_k, bias)) < 1e-6
    assert rel_err(out, reference.w8_linear(x, q, s, group_k, bias)) < 1e-5
    xh = x.to(torch.bfloat16)
    out = gemv_w8(xh, q, s, group_k, bias, out=poisoned(num_rows, out_features, torch.bfloat16))
    assert not out.isnan().any()
    assert rel_err(out, reference.gemv_w8(xh, q, s, group_k, bias)) < 1e-3
    assert rel_err(out, reference.w8_linear(xh, q, s, group_k, bias)) < 1e-2


# launch configs other than tile_config's rule (vec, block_n, num_warps, split_k): wider VECs,
# other N blocks and warps, explicit splits (the benchmark's --sweep times these on a GPU)
W4_TILES = [dict(vec=8, block_n=2, num_warps=2), dict(vec=8, block_n=1, num_warps=1, split_k=2), dict(vec=16, block_n=4, num_warps=2)]
W8_TILES = [dict(vec=16, block_n=2, num_warps=1), dict(vec=8, block_n=1, num_warps=2, split_k=2), dict(vec=16, block_n=1, num_warps=2, split_k=4)]


@pytest.mark.parametrize("tiles", W4_TILES, ids=str)
@pytest.mark.parametrize("symmetric", [True, False])
def test_gemv_w4_launch_configs_match_the_twin(tiles: dict, symmetric: bool) -> None:
    packed, scale, offset = w4_weights(11, 1024, 64 if symmetric else 128, symmetric)
    group = 64 if symmetric else 128
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 1024, generator=gen)
    bias = torch.randn(11, generator=gen)
    out = gemv_w4(x, packed, scale, offset, group, bias, out=poisoned(3, 11, torch.float32), **tiles)
    assert not out.isnan().any()
    assert rel_err(out, reference.gemv_w4(x, packed, scale, offset, group, bias)) < 1e-6
    xh = x.to(torch.bfloat16)
    assert rel_err(gemv_w4(xh, packed, scale, offset, group, bias, **tiles), reference.gemv_w4(xh, packed, scale, offset, group, bias)) < 1e-3


@pytest.mark.parametrize("tiles", W8_TILES, ids=str)
@pytest.mark.parametrize("dtype, group", [("int8", 0), ("fp8", 32)])
def test_gemv_w8_launch_configs_match_the_twin(tiles: dict, dtype: str, group: int) -> None:
    gen = torch.Generator().manual_seed(7)
    q, s = formats.quantize_rows(torch.randn(7, 1024, generator=gen), dtype)
    if group:
        s = torch.rand(7, 1024 // group, generator=gen) * 0.01 + 1e-3
    group_k = group or 1024
    x = torch.randn(2, 1024, generator=gen)
    bias = torch.randn(7, generator=gen)
    out = gemv_w8(x, q, s, group_k, bias, out=poisoned(2, 7, torch.float32), **tiles)
    assert not out.isnan().any()
    assert rel_err(out, reference.gemv_w8(x, q, s, group_k, bias)) < 1e-6


def test_a_row_does_not_depend_on_its_batch_or_block_n_for_one_vec_warps_and_split() -> None:
    """What the sweep's batch-invariant choice relies on: VEC, warps and split fixed, BLOCK_N free per M."""
    packed, scale, offset = w4_weights(6, 2048, 128, symmetric=False)
    x = torch.randn(7, 2048, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    whole = gemv_w4(x, packed, scale, offset, 128, vec=16, num_warps=1, split_k=2, block_n=1)
    for rows, block_n in ((slice(1, 3), 4), (slice(6, 7), 2)):
        part = gemv_w4(x[rows].contiguous(), packed, scale, offset, 128, vec=16, num_warps=1, split_k=2, block_n=block_n)
        assert torch.equal(whole[rows], part), rows
    q, s = formats.quantize_rows(torch.randn(6, 2048, generator=torch.Generator().manual_seed(9)), "int8")
    whole = gemv_w8(x, q, s, 2048, vec=16, num_warps=2, split_k=2, block_n=1)
    assert torch.equal(whole[2:4], gemv_w8(x[2:4].contiguous(), q, s, 2048, vec=16, num_warps=2, split_k=2, block_n=4))


def test_launch_config_overrides() -> None:
    default = tile_config(2, 6144, 2048, 4, 132)
    assert tile_config(2, 6144, 2048, 4, 132, vec=None, block_n=None, num_warps=None, split_k=None) == default
    t = tile_config(2, 1024, 2048, 4, 132, vec=16, num_warps=8)
    assert (t["VEC"], t["THREADS_K"], t["num_warps"], t["BLOCK_N"]) == (16, 256, 8, 2)
    assert t["SPLIT_K"] == tile_config(8, 1024, 2048, 4, 132, vec=16, num_warps=8)["SPLIT_K"]  # M's for every M
    assert tile_config(1, 6144, 2048, 4, 132, split_k=4, block_n=2)["SPLIT_K"] == 4
    assert tile_config(1, 6144, 2048, 4, 132, split_k=3)["SPLIT_K"] == 2  # 4 steps of 512 bytes: 2 + 2
    assert tile_config(1, 6144, 2048, 4, 132, vec=16, split_k=2)["SPLIT_K"] == 1  # one step of 2048 bytes
    for bad, match in ((dict(vec=32), "vec 32"), (dict(block_n=3), "power of two"), (dict(num_warps=3), "num_warps"),
                       (dict(split_k=0), "split_k")):
        with pytest.raises(ValueError, match=match):
            tile_config(1, 64, 64, 4, 132, **bad)
    with pytest.raises(ValueError, match="vec 4"):
        gemv_w8(torch.randn(1, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1), 64, vec=4)


def test_gemv_w8_reads_a_per_channel_scale_view() -> None:
    """The scaled_mm backend holds per-row scales as (1, N); the GEMV reads a (N, 1) view of them."""
    gen = torch.Generator().manual_seed(3)
    q, s = formats.quantize_rows(torch.randn(11, 128, generator=gen), "fp8")
    x = torch.randn(2, 128, generator=gen)
    held = s.reshape(1, -1).contiguous()
    assert rel_err(gemv_w8(x, q, held.view(-1, 1), 128), reference.w8_linear(x, q, s, 128)) < 1e-5


def test_tiling_and_split_k() -> None:
    # the cases above: (4, 20, 4096) 4-bit and (8, 5, 8192) 8-bit split K in two; the rest do not
    assert tile_config(4, 20, 2048, 4, 132)["SPLIT_K"] == 2
    assert tile_config(8, 5, 8192, 8, 132)["SPLIT_K"] == 2
    assert tile_config(1, 37, 128, 4, 132)["SPLIT_K"] == 1
    # Llama-3-8B at batch 1: qkv (6144 x 4096) one pass in 768 programs of 8 rows; a K/V
    # projection (1024 rows) splits K in two
    assert tile_config(1, 6144, 2048, 4, 132) == {"BLOCK_M": 1, "BLOCK_N": 8, "THREADS_K": 128, "VEC": 4, "SPLIT_K": 1, "num_warps": 4}
    assert tile_config(1, 1024, 2048, 4, 132)["SPLIT_K"] == 2
    assert tile_config(8, 6144, 2048, 4, 132)["BLOCK_N"] == 2  # 8 accumulators of 2 rows a thread
    assert tile_config(8, 6144, 4096, 8, 132)["BLOCK_N"] == 1
    # a row's sums do not depend on the batch: the tiling of 5..8 rows is one, the split of K is M's for every M
    assert tile_config(5, 4096, 2048, 4, 132) == tile_config(8, 4096, 2048, 4, 132)
    for n, row_bytes, bits in ((1024, 2048, 4), (20, 2048, 4), (1024, 4096, 8), (5, 4096, 8), (6144, 2048, 4)):
        assert len({tile_config(m, n, row_bytes, bits, 132)["SPLIT_K"] for m in range(1, GEMV_ROWS + 1)}) == 1


@pytest.mark.parametrize("in_features", [512, 4096])  # one pass; K split in two
def test_a_row_does_not_depend_on_its_batch(in_features: int) -> None:
    packed, scale, offset = w4_weights(8, in_features, 64, symmetric=False)
    assert tile_config(1, 8, in_features // 2, 4, 132)["SPLIT_K"] == (1 if in_features == 512 else 2)
    x = torch.randn(7, in_features, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    whole = gemv_w4(x, packed, scale, offset, 64)
    for rows in (slice(0, 5), slice(5, 6), slice(1, 3), slice(3, 7)):  # BLOCK_M 8, 1, 2, 4
        assert torch.equal(whole[rows], gemv_w4(x[rows].contiguous(), packed, scale, offset, 64)), rows
    q, s = formats.quantize_rows(torch.randn(8, in_features, generator=torch.Generator().manual_seed(5)), "int8")
    whole = gemv_w8(x, q, s, in_features)
    for rows in (slice(0, 5), slice(5, 6), slice(1, 3), slice(3, 7)):
        assert torch.equal(whole[rows], gemv_w8(x[rows].contiguous(), q, s, in_features)), rows


@pytest.mark.parametrize("group, in_features", [(32, 256), (64, 192), (128, 512), (96, 96)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_dequant_w4_is_the_twins_weight(group: int, in_features: int, symmetric: bool) -> None:
    packed, scale, offset = w4_weights(19, in_features, group, symmetric)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = dequant_w4(packed, scale, offset, group, dtype)
        assert w.dtype == dtype and torch.equal(w, reference.dequant_w4(packed, scale, offset, group, dtype)), dtype


def test_rejects_what_it_does_not_serve() -> None:
    packed = torch.zeros(8, 32, dtype=torch.uint8)  # N 8, K 64
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv_w4(torch.randn(9, 64), packed, torch.ones(8, 2, dtype=torch.float16), None, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemv_w8(torch.randn(2, 48), torch.zeros(8, 48, dtype=torch.int8), torch.ones(8, 1), 48)
    with pytest.raises(ValueError, match="out must be"):
        gemv_w4(torch.randn(2, 64), packed, torch.ones(8, 2, dtype=torch.float16), None, 32, out=torch.empty(2, 8, dtype=torch.float16))
    assert supports(1, 4096, 128, 4) and supports(GEMV_ROWS, 4096, 4096, 8)
    assert not supports(GEMV_ROWS + 1, 4096, 128, 4) and not supports(0, 4096, 128, 4)
    assert not supports(1, 4112, 4112, 4)  # K not a multiple of 32: the tile kernels serve it
    assert not supports(1, 4096, 16, 4) and supports(1, 4096, 16, 8)  # a thread's 8 (4-bit) / 8 (8-bit) columns in one group


# ------------------------------------------------------------------------------ dispatch


def test_routes_by_rows() -> None:
    from stoker.layers.int4_method import GEMV_ROWS, w4a16_route
    from stoker.layers.quantized_method import TRITON_W8_GEMV_ROWS, w8_route

    # the thresholds measured on the H200 (the methods' docstrings)
    assert (GEMV_ROWS, TRITON_W8_GEMV_ROWS) == (4, 1)
    assert [w4a16_route(m, 4096, 128) for m in (1, 2, 3, 4)] == ["gemv"] * 4
    assert [w4a16_route(m, 4096, 128) for m in (5, 8, 16, 64, 256, 2048)] == ["dequant_linear"] * 6
    assert w4a16_route(1, 4112, 4112) == "dequant_linear"  # K not a multiple of 32
    assert [w8_route(m, 4096, 4096) for m in (1, 8, 9, 512)] == ["gemv", "gemv", "gemm", "gemm"]  # scaled_mm
    assert [w8_route(m, 4096, 4096, TRITON_W8_GEMV_ROWS) for m in (1, 2, 8)] == ["gemv", "gemm", "gemm"]  # triton_w8


class Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_triton_backend_takes_each_path_by_rows(symmetric: bool) -> None:
    from stoker.layers.int4_method import Int4LinearMethod
    from stoker.layers.linear import Linear
    from stoker.quantization.config import WeightScheme

    scheme = WeightScheme("int4", "group", group_size=32, symmetric=symmetric)
    layer = Linear(64, 40, bias=True)
    layer.attach(Int4LinearMethod(scheme, online=False, backend="triton_w4a16"))
    gen = torch.Generator().manual_seed(5)
    q, s, o = int4.quantize(torch.randn(40, 64, generator=gen) / 8, 32, symmetric)
    b = torch.randn(40, generator=gen)
    layer.method.load_affine(layer, None, int4.AffineInt4(q, s, o, 32))
    layer.method.load(layer, "bias", None, b)
    layer.method.process_after_loading(layer)
    m = layer.method
    m.gemv, m.dequantize = Spy(m.gemv), Spy(m.dequantize)
    for rows, spy in ((3, m.gemv), (4, m.gemv), (5, m.dequantize), (256, m.dequantize)):
        before = spy.calls
        x = torch.randn(rows, 64, generator=gen)
        out = layer(x)
        assert spy.calls == before + 1, rows
        assert rel_err(out, reference.int4_linear(x, q, s, o, 32, b)) < 1e-5, rows
    assert (m.gemv.calls, m.dequantize.calls) == (2, 2)


@pytest.mark.parametrize("backend", ["triton_w8", "scaled_mm"])
def test_8bit_backends_use_the_gemv_at_decode(backend: str) -> None:
    from stoker.layers.linear import Linear
    from stoker.layers.quantized_method import QuantizedLinearMethod
    from stoker.quantization.config import WeightScheme

    scheme = WeightScheme("fp8", "channel")
    layer = Linear(64, 24, bias=True)
    layer.attach(QuantizedLinearMethod(scheme, online=True, backend=backend))
    gen = torch.Generator().manual_seed(6)
    layer.method.load(layer, "weight", None, torch.randn(24, 64, generator=gen) / 8)
    layer.method.load(layer, "bias", None, torch.randn(24, generator=gen))
    w = formats.dequantize(layer.weight, layer.weight_scale, layer.method.group_k)
    layer.method.process_after_loading(layer)
    layer.method.gemv = spy = Spy(layer.method.gemv)
    x = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    out = layer(x)
    assert spy.calls == 1 and out.dtype == torch.bfloat16
    # decode is weight-only: the weight's own products in float32, rounded once
    assert rel_err(out, F.linear(x.float(), w, layer.bias.float())) < 1e-2
    layer(torch.randn(9, 64, generator=gen).to(torch.bfloat16))  # prefill: the backend's GEMM
    assert spy.calls == 1


def test_benchmark_sweep_smoke(tmp_path) -> None:
    """benchmarks/w4a16_gpu.py --smoke --sweep: every config of sweep_tiles runs (interpreted) and
    agrees with its twin, and the summary names a fastest config per kind, projection and M."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from stoker.kernels.quant_gemv import sweep_tiles

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "sweep.json"
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "w4a16_gpu.py"), "--smoke", "--sweep", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not timed" not in proc.stdout
    data = json.loads(out.read_text())
    for bits, kind in ((4, "w4 group 128 symmetric"), (8, "w8 int8 per channel")):
        for rows in (1, 3):
            timed = [r for r in data["rows"] if r["kind"] == kind and r["rows"] == rows]
            assert len(timed) == len(sweep_tiles(bits, rows)), (kind, rows)
            assert all(r["rel_err"] < 1e-2 for r in timed)
            assert set(data["sweep"]["best"][kind]["smoke"][str(rows)]) >= {"overrides", "tiles", "ms", "default_ms"}
        assert set(data["sweep"]["best_batch_invariant"][kind]["smoke"]["block_n_by_rows"]) == {"1", "3"}
