"""Every instruction-set build of the CPU kernels that this machine can run (issue 12).

`STOKER_CPU_ISA` picks the build once per process (kernels/cpu/build.py), so each narrower
build runs the kernel tests in a subprocess of its own: on an AVX-512 machine the AVX2 and the
SSE2-only builds run them too, on an AVX2 machine the SSE2 build. The linear kernel spells out
its fused multiply-adds, so every FMA build (AVX2, AVX-512, and -march=native whatever its
tuning) computes each output with the same operations in the same order: their results must be
equal bit for bit, and the SSE2 build (mul + add, two roundings) within float32 rounding.
The W4A8, Q4_K W4A8 and W6A8 kernels (linear_q4_a8.h, linear_q4k_a8.h, linear_q6_a8.h: exact integer
dot products, then only separately rounded multiplies and adds) give the same bits in every build,
SSE2 included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stoker.kernels.cpu import build

if shutil.which("cc") is None and shutil.which("gcc") is None:
    pytest.skip("no C compiler: the CPU kernels are not built here", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
# The kernel tests that hold each C kernel to its twin, plus batch/thread invariance.
KERNEL_TESTS = [
    "tests/kernels/test_cpu_linear.py",
    "tests/kernels/test_cpu_linear_q8.py",
    "tests/kernels/test_cpu_linear_q4.py",
    "tests/kernels/test_cpu_linear_q4_a8.py",
    "tests/kernels/test_cpu_linear_q6_a8.py",
    "tests/kernels/test_cpu_linear_q4k_a8.py",
    "tests/kernels/test_kv_fp8.py",
    "tests/kernels/test_cpu_paged_decode_attention.py",
    "tests/kernels/test_cpu_prefill_attention.py",
    "tests/kernels/test_cpu_varlen_attention.py",
    "tests/kernels/test_cpu_bert_layer.py",
    "tests/kernels/test_cpu_moe.py",
    "tests/kernels/test_cpu_rows.py",
    "tests/model/test_cpu_weight_layout.py",
]
# Tests in those files that say nothing about an ISA build's arithmetic, which the native run covers
# once: the build machinery's own (they compile from scratch), the Triton kernels (interpreted),
# the torch twins alone, and which backend a layer holds. Each narrower build costs a compile and a
# pytest run of its own, so these would only add minutes to the suite.
ISA_INDEPENDENT = (
    "test_build_is_cached_and_atomic",
    "test_unwritable_cache_dir_builds_in_temp",
    "triton",
    "test_twin_store_is_torchs_cast",
    "test_ops_send_fp8_caches_to_the_c_kernels",
    "test_the_backend_is_not_re_read_per_call",
    "test_projection_weights_are_column_major_without_the_kernels",
    "test_layers_without_the_c_kernels_get_the_torch_twins",
)
NARROWER = [isa for isa in build.supported_isas() if isa != "native"]
EXPECTED_TARGET = {"avx512": "avx512", "avx2": "avx2", "generic": "sse2"}


def _env(isa: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "STOKER_DISABLE_CPU_KERNELS"}
    return {**env, "STOKER_CPU_ISA": isa, "PYTHONPATH": str(ROOT)}


def test_this_machine_tests_more_than_the_widest_build() -> None:
    supported = build.supported_isas()
    assert supported[0] == "native"
    if os.uname().machine in ("x86_64", "amd64"):
        assert "generic" in supported
        flags = build._cpu_flags().split()
        assert ("avx2" in supported) == all(f in flags for f in ("avx2", "fma", "f16c", "bmi2"))
        assert ("avx512" in supported) == all(f"avx512{x}" in flags for x in ("f", "bw", "cd", "dq", "vl"))


def test_an_isa_the_cpu_lacks_is_refused_with_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "_cpu_flags", lambda: "flags\t\t: fpu sse sse2")
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    with pytest.raises(build.BuildError, match="lacks avx2, fma"):
        build._target_flags("avx2")
    with pytest.raises(build.BuildError, match="not one of native, avx512, avx2, generic"):
        build._target_flags("avx3")
    assert build._target_flags("generic") == ["-march=x86-64", "-mtune=generic"]


@pytest.mark.parametrize("isa", NARROWER)
def test_kernel_suite_on_each_narrower_build(isa: str) -> None:
    """The twin and invariance tests of every C kernel, against this ISA's build."""
    check = "from stoker.kernels.cpu import linear as cpu_linear; print(cpu_linear.target())"
    probe = subprocess.run([sys.executable, "-c", check], env=_env(isa), capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip() == EXPECTED_TARGET[isa], probe.stdout + probe.stderr
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *KERNEL_TESTS,
           "-k", " and ".join(f"not {name}" for name in ISA_INDEPENDENT)]
    proc = subprocess.run(cmd, env=_env(isa), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


_LINEAR_OUT = """
import sys, torch
from stoker.kernels.cpu import build
from stoker.kernels.cpu import linear as cpu_linear
if len(sys.argv) > 2:  # another -mtune for this ISA's build (before the library loads)
    flags, needs = build.ISA_TARGETS[build.selected_isa()]
    build.ISA_TARGETS[build.selected_isa()] = ([*flags, "-mtune=" + sys.argv[2]], needs)
gen = torch.Generator().manual_seed(0)
w = torch.randn(300, 200, generator=gen) / 200**0.5
b = torch.randn(300, generator=gen)
x = torch.randn(37, 200, generator=gen)
gate_up = torch.randn(2 * 128, 200, generator=gen) / 200**0.5
y = cpu_linear.linear(x, cpu_linear.pack_linear_weight(w), 300, cpu_linear.pack_linear_weight(b))
h = cpu_linear.linear(x, cpu_linear.pack_linear_weight(gate_up, gate_up=True), 256, silu_and_mul=True)
q8 = {}
for dtype in (torch.int8, torch.float8_e4m3fn):
    q = (w * 300).clamp(-120, 120).to(dtype) if dtype == torch.float8_e4m3fn else (w * 300).round().clamp(-127, 127).to(dtype)
    s = torch.rand(300, 2, generator=gen) * 0.01
    for rows in (1, 37):  # widened in registers, and the dequantized-panel path
        q8[str(dtype), rows] = cpu_linear.linear_q8(x[:rows], cpu_linear.pack_linear_weight(q), cpu_linear.pack_scales(s, dtype), 128, 300)
from stoker.quantization import int4
from stoker.kernels.cpu import linear_q4 as cpu_q4
q4 = {}
for group in (32, 40):  # whole panels and the partial last one (300 = 4 x 64 + 44 = 9 x 32 + 12)
    w4 = w if group == 40 else w[:, :192]
    q, s4, o4 = int4.quantize(w4, group, symmetric=group == 32)
    if group == 32:  # float16 scales, no offsets (GGUF Q4_0's form)
        s4 = s4.half().float()
        o4 = -8 * s4
    args = (cpu_q4.pack_q4_weight(q), *cpu_q4.pack_q4_scales(s4, o4))
    for rows in (1, 37):  # codes converted in registers, and once per panel into a buffer
        q4[group, rows] = cpu_q4.linear_q4(x[:rows, : w4.shape[1]].contiguous(), *args, group, 300)
q4a8 = {}
for group, symmetric in ((32, True), (64, False)):  # W4A8: float16 scales and no offsets, float32 with offsets
    q, s4, o4 = int4.quantize(w[:, :192], group, symmetric)
    args = (cpu_q4.pack_q4_weight(q), *cpu_q4.pack_q4_scales(s4, o4))
    for rows in (1, 37):  # row tiles of one and of two (AVX-512)
        q4a8[group, rows] = cpu_q4.linear_q4_a8(x[:rows, :192].contiguous(), *args, group, 300)
from stoker.kernels.cpu import linear_q6 as cpu_q6
q6 = torch.cat([w, w, w], dim=1)[:, :512].mul(200).round().clamp(-32, 31).to(torch.int8)  # (300, 512): K two super-blocks
sc6 = torch.randint(-128, 128, (300, 32), generator=gen, dtype=torch.int8)
d6 = torch.rand(300, 2, generator=gen) * 1e-3
q6a8 = {}
for rows in (1, 37):  # W6A8: row tiles of one and of two (AVX-512)
    x6 = torch.cat([x, x, x], dim=1)[:rows, :512].contiguous()
    q6a8[rows] = cpu_q6.linear_q6_a8(x6, cpu_q6.pack_q6_weight(q6, sc6), cpu_q6.pack_q6_super_scales(d6), 300)
q4k = {}  # Q4_K's own bytes, W4A8: 6-bit sub-scales, float pairs per 256
codes4 = torch.randint(0, 16, (300, 512), generator=gen, dtype=torch.uint8)
sub4 = torch.randint(0, 64, (2, 300, 16), generator=gen, dtype=torch.uint8)
sup4 = torch.rand(2, 300, 2, generator=gen) * 1e-2
for rows in (1, 37):
    x4 = torch.cat([x, x, x], dim=1)[:rows, :512].contiguous()
    q4k[rows] = cpu_q4.linear_q4k_a8(x4, cpu_q4.pack_q4_weight(codes4), *cpu_q4.pack_q4k_scales(sub4, sup4), 32, 300)
from stoker.kernels.cpu import moe as cpu_moe
moe = {}
for inter in (64, 17):  # SiLU fused into the gate/up tiles (NR 32 and 64), and unfused with odd I
    w13, w2 = torch.randn(8, 2 * inter, 72, generator=gen) / 72**0.5, torch.randn(8, 72, inter, generator=gen) / inter**0.5
    xm, ids = torch.randn(21, 72, generator=gen), torch.randn(21, 8, generator=gen).topk(3).indices
    p13, p2 = cpu_moe.pack_experts(w13, w2, inter == 64)
    moe[inter] = cpu_moe.fused_moe(xm, p13, p2, torch.rand(21, 3, generator=gen), ids, inter, inter == 64)
torch.save({"target": cpu_linear.target(), "linear": y, "silu": h, "q8": q8, "q4": q4, "q4a8": q4a8, "q6a8": q6a8, "q4k": q4k, "moe": moe}, sys.argv[1])
"""


def test_fma_builds_agree_bit_for_bit(tmp_path: Path) -> None:
    """Columns in full vector tiles and in the scalar tail, rows in full and partial tiles: the
    same in-order FMA sum in every FMA build, whatever its vector width or -mtune."""
    runs = [(isa, None) for isa in build.supported_isas()]
    if "avx2" in build.supported_isas():
        # gcc's znver2 tuning avoids FMA chains: before linear.c spelled its FMAs out, it
        # fused some tiles' sums and not others (issue 12's AVX2 EPYC), on any CPU.
        runs.append(("avx2", "znver2"))
    outs = {}
    for isa, tune in runs:
        path = tmp_path / f"{isa}-{tune}.pt"
        cmd = [sys.executable, "-c", _LINEAR_OUT, str(path), *([tune] if tune else [])]
        proc = subprocess.run(cmd, env=_env(isa), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[isa if tune is None else f"{isa} -mtune={tune}"] = torch.load(path)
    fma = [isa for isa, out in outs.items() if out["target"] != "sse2"]
    for isa in fma[1:]:
        assert torch.equal(outs[isa]["linear"], outs[fma[0]]["linear"]), f"{isa} and {fma[0]} builds differ"
        for key, y in outs[isa]["q8"].items():  # int8 / FP8 panels: exact widening in every build
            assert torch.equal(y, outs[fma[0]]["q8"][key]), f"{isa} and {fma[0]} builds differ on {key}"
        for key, y in outs[isa]["q4"].items():  # 4-bit: exact codes, the same FMA order per group (linear_q4.h)
            assert torch.equal(y, outs[fma[0]]["q4"][key]), f"{isa} and {fma[0]} builds differ on int4 {key}"
        # SiLU's exp comes from glibc's vector math library, whose AVX2 and AVX-512 variants
        # may round differently: close, not necessarily equal.
        torch.testing.assert_close(outs[isa]["silu"], outs[fma[0]]["silu"], rtol=1e-6, atol=1e-6)
        # The MoE kernel's GEMMs and sums are linear.c's, but every expert goes through SiLU:
        # close, as above (within each build it equals the per-expert path bit for bit,
        # test_cpu_moe.py, run by every build through KERNEL_TESTS).
        for inter, y in outs[isa]["moe"].items():
            torch.testing.assert_close(y, outs[fma[0]]["moe"][inter], rtol=1e-6, atol=1e-6)
    for isa, out in outs.items():  # W4A8, W6A8: exact integer dot products, then mul and add (no FMA): SSE2 too
        for key, y in out["q4a8"].items():
            assert torch.equal(y, outs["native"]["q4a8"][key]), f"{isa} and native builds differ on W4A8 {key}"
        for key, y in out["q6a8"].items():
            assert torch.equal(y, outs["native"]["q6a8"][key]), f"{isa} and native builds differ on W6A8 {key}"
        for key, y in out["q4k"].items():
            assert torch.equal(y, outs["native"]["q4k"][key]), f"{isa} and native builds differ on Q4_K W4A8 {key}"
    for out in outs.values():
        torch.testing.assert_close(out["linear"], outs["native"]["linear"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["silu"], outs["native"]["silu"], rtol=1e-5, atol=1e-5)
        for key, y in out["q4"].items():  # SSE2: mul + add in the sums (the codes are the same values)
            torch.testing.assert_close(y, outs["native"]["q4"][key], rtol=1e-5, atol=1e-5)
        for inter, y in out["moe"].items():
            torch.testing.assert_close(y, outs["native"]["moe"][inter], rtol=1e-5, atol=1e-5)
