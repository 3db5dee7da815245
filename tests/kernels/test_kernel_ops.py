"""ops.py: CPU tensors take the twins; the Triton branch is wired with the right arguments;
STOKER_DISABLE_TRITON is honoured; importing ops needs no triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from stoker.kernels import ops, reference


def _inputs(gen: torch.Generator) -> dict[str, tuple]:
    from paged_cases import make_paged_batch

    b = make_paged_batch([20, 35], 2, 64, 16, torch.float32, "cpu", gen)
    kc, vc = b.k_ref, b.v_ref
    ctx = b.context_lens_tensor()
    cache = torch.cat((torch.rand(64, 32), torch.rand(64, 32)), dim=-1)
    kv = torch.randn(4, 2, 64, generator=gen)
    return {
        "store_kvcache": (kv, kv.clone(), kc.clone(), vc.clone(), torch.tensor([0, 5, -1, 40])),
        "paged_decode_attention": (torch.randn(2, 8, 64, generator=gen), kc, vc, b.block_tables, ctx, 0.125, 7),
        "paged_attention": (torch.randn(12, 8, 64, generator=gen), kc, vc, b.block_tables, [0, 10, 12], [20, 35], 0.125, 9),
        "rms_norm": (torch.randn(3, 64, generator=gen), torch.randn(64, generator=gen), 1e-6),
        "fused_add_rms_norm": (torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen), torch.randn(64), 1e-6),
        "silu_and_mul": (torch.randn(3, 128, generator=gen),),
        "rotary_embedding": (torch.tensor([0, 3, 63]), torch.randn(3, 4, 64), torch.randn(3, 2, 64), cache),
    }


def _flatten(result: object) -> list[torch.Tensor]:
    if result is None:
        return []
    return list(result) if isinstance(result, tuple) else [result]  # type: ignore[arg-type]


def test_cpu_tensors_take_the_twins_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_DISABLE_CPU_KERNELS", "1")  # the C decode kernel: test_cpu_paged_decode_attention.py
    assert not ops.use_triton(torch.zeros(1))
    for name, args in _inputs(torch.Generator().manual_seed(0)).items():
        got = _flatten(getattr(ops, name)(*args))
        want = _flatten(getattr(reference, name)(*args))
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), name


_MODULES = {
    "store_kvcache": "store_kvcache",
    "paged_decode_attention": "paged_decode_attention",
    "paged_attention": "paged_prefill_attention",
    "rms_norm": "rms_norm",
    "fused_add_rms_norm": "rms_norm",
    "silu_and_mul": "activation",
    "rotary_embedding": "rotary",
}


def test_triton_branch_wiring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the Triton branch on CPU tensors (the interpreter runs them) and compare with the twins."""
    pytest.importorskip("triton")
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    calls: list[str] = []
    for name, module in _MODULES.items():
        mod = ops._kernel(module)
        launcher = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _l=launcher, _n=name, **k: (calls.append(_n), _l(*a, **k))[1])
    inputs = _inputs(torch.Generator().manual_seed(1))
    for name, args in inputs.items():
        mutable = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got = _flatten(getattr(ops, name)(*mutable))
        want = _flatten(getattr(reference, name)(*args))
        if name == "store_kvcache":  # compare the caches it wrote
            got, want = mutable[2:4], list(args[2:4])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    assert calls == list(inputs), "every op must reach its Triton launcher"


def test_disable_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOKER_DISABLE_TRITON", "1")
    assert ops.triton_disabled()
    monkeypatch.setenv("STOKER_DISABLE_TRITON", "0")
    assert not ops.triton_disabled()
    monkeypatch.delenv("STOKER_DISABLE_TRITON")
    assert not ops.triton_disabled()


def test_import_and_cpu_path_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "from stoker.kernels import ops\n"
        "assert not ops.triton_available()\n"
        "x = torch.randn(2, 8)\n"
        "assert ops.rms_norm(x, torch.ones(8), 1e-6).shape == (2, 8)\n"
        "assert 'stoker.kernels.rms_norm' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
