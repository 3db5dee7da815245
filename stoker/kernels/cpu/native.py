"""Builds, caches and calls the C kernels in this folder (CPU only, float32).

The C sources are compiled into one library once per machine with the system C compiler
(`$CC`, else `cc`/`gcc`: `-O3 -march=native -fopenmp`) into
`$STOKER_CACHE_DIR/kernels/<hash>/` (default `~/.cache/stoker`), keyed by the sources, the
compiler's version and this CPU's flags, and loaded with ctypes. Building takes about a
second; later processes load the cached library.

No compiler, a failed build, or `STOKER_DISABLE_CPU_KERNELS=1` leaves `available()` False and
the callers on the plain-torch twins in `kernels/reference.py` (one warning says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = (Path(__file__).with_name("paged_decode_attention.c"), Path(__file__).with_name("elementwise.c"))
# -ffast-math lets gcc vectorize expf (through glibc's libmvec) and reassociate the dot
# products' sums; the kernel never sees inf/NaN (it reads only positions it attends). It is
# given to the compile step only: linked in, it would add crtfastmath.o, whose constructor
# flushes denormals to zero for the whole process.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-ffast-math"]
_LDFLAGS = ["-shared", "-fopenmp", "-lm"]


class BuildError(RuntimeError):
    pass


def disabled() -> bool:
    """STOKER_DISABLE_CPU_KERNELS=1 forces the torch twins (read per call: tests may flip it)."""
    return os.environ.get("STOKER_DISABLE_CPU_KERNELS", "0").strip().lower() not in ("", "0", "false", "no")


def cache_dir() -> Path:
    base = os.environ.get("STOKER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"), "stoker"
    )
    return Path(base) / "kernels"


def _writable_dir(path: Path) -> Path:
    """`path`, created; or, where it cannot be (a read-only home), a per-user temp folder."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"stoker-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}" / path.name
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc"):
        if cc and shutil.which(cc):
            return cc
    raise BuildError("no C compiler found (set CC, or install gcc)")


def _cpu_flags() -> str:
    """What -march=native depends on: a library built for one CPU must not load on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(sources: tuple[Path, ...] = _SOURCES) -> Path:
    """Compile `sources` into one shared library (or reuse the cached one); returns its path."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    parts = [src.read_text() for src in sources] + [version, " ".join(_CFLAGS + _LDFLAGS), _cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    lib = cache_dir() / key / "stoker_cpu.so"
    if lib.exists():
        return lib
    out_dir = _writable_dir(lib.parent)
    lib = out_dir / lib.name
    if lib.exists():
        return lib
    # Build beside the target and rename: concurrent builders (pytest-xdist workers, several
    # servers) never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    objs = [f"{tmp[:-3]}.{i}.o" for i in range(len(sources))]
    try:
        cmds = [[cc, *_CFLAGS, "-c", str(src), "-o", obj] for src, obj in zip(sources, objs)]
        for cmd in [*cmds, [cc, *objs, *_LDFLAGS, "-o", tmp]]:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise BuildError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        for leftover in (tmp, *objs):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build()))
    except (BuildError, OSError) as exc:
        logger.warning("CPU attention kernel unavailable (%s); decode attention uses the slower torch path", exc)
        return None
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "stoker_paged_decode_attention_f32": ([p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, f32, i64, i32], i32),
        "stoker_rms_norm_f32": ([p, i64, p, i64, p, p, p, i64, i64, f32, i32], None),
        "stoker_silu_and_mul_f32": ([p, i64, p, i64, i64, i32], None),
        "stoker_rotary_f32": ([p, p, i64, p, i64, p, p, p, i64, i64, i64, i64, i64, i32], None),
    }
    for name, (argtypes, restype) in signatures.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, restype
    return lib


def available() -> bool:
    return not disabled() and _library() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The C kernel's domain: CPU float32 query and cache. Anything else takes the torch twin."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and available()
    )


def paged_decode_attention(
    query: torch.Tensor,  # (B, H, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    context_lens: torch.Tensor,  # (B,) int32
    scale: float,
    sliding_window: int | None = None,
    max_context_len: int | None = None,  # max(context_lens), if the caller knows it (saves a read)
) -> torch.Tensor:  # (B, H, D)
    lib = _library()
    if lib is None:
        raise BuildError("the CPU kernel library is not available")
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads or k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"shape mismatch: query {tuple(query.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (num_blocks, block_size, Hkv, D)")
    if not (query.dtype == k_cache.dtype == v_cache.dtype == torch.float32):
        raise ValueError(f"float32 only: query {query.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"{num_seqs} queries but block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)}"
        )
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0
    # The C code trusts its indices; a bad block id or length would read outside the cache.
    if max_context_len > block_tables.shape[1] * block_size:
        raise ValueError(f"a context of {max_context_len} tokens needs more than the block table's {block_tables.shape[1]} blocks")
    if num_seqs and block_tables.numel() and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < num_blocks:
        raise ValueError(f"block_tables hold ids outside [0, {num_blocks})")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    failed = lib.stoker_paged_decode_attention_f32(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_context_len, scale,
        sliding_window or 0, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("paged_decode_attention: could not allocate the per-thread scratch buffer")
    return out


# ---------------------------------------------------------------- row-wise kernels (elementwise.c)
# Below this many elements a kernel runs on one thread: waking the OpenMP team costs more
# than it saves (torch's own grain size for element-wise ops is 32768).
_PARALLEL_MIN_ELEMENTS = 32768


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= _PARALLEL_MIN_ELEMENTS else 1


def supports_rows(*tensors: torch.Tensor) -> bool:
    """The row kernels' domain: CPU float32 tensors whose last dim is contiguous."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() >= 1 and t.stride(-1) == 1 for t in tensors)
        and available()
    )


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (..., n) -> (rows, n) view (copy only if the leading dims cannot be merged), row stride."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows, rows.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, stride = _as_rows(x)
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype)
    _library().stoker_rms_norm_f32(
        rows.data_ptr(), stride, None, 0, weight.data_ptr(), out.data_ptr(), None, rows.shape[0], rows.shape[1], eps,
        _threads(rows.numel()),
    )
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both new tensors."""
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    rows, stride = _as_rows(x)
    res_rows, res_stride = _as_rows(residual)
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype)
    new_residual = torch.empty(rows.shape, dtype=x.dtype)
    _library().stoker_rms_norm_f32(
        rows.data_ptr(), stride, res_rows.data_ptr(), res_stride, weight.data_ptr(), out.data_ptr(),
        new_residual.data_ptr(), rows.shape[0], rows.shape[1], eps, _threads(rows.numel()),
    )
    return out.view(x.shape), new_residual.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2 * d) [gate | up] -> (..., d) silu(gate) * up."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate | up), got {x.shape[-1]}")
    rows, stride = _as_rows(x)
    d = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], d), dtype=x.dtype)
    _library().stoker_silu_and_mul_f32(rows.data_ptr(), stride, out.data_ptr(), rows.shape[0], d, _threads(rows.numel()))
    return out.view(*x.shape[:-1], d)


def _head_rows(t: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """(T, heads, D) with contiguous heads (stride(1) == D, stride(2) == 1); returns it and its row stride."""
    if t.dim() != 3:
        raise ValueError(f"{name} must be (num_tokens, num_heads, head_dim), got {tuple(t.shape)}")
    if not (t.stride(2) == 1 and t.stride(1) == t.shape[2]):
        t = t.contiguous()
    return t, t.stride(0)


def rotary_embedding(
    positions: torch.Tensor,  # (T,)
    query: torch.Tensor,  # (T, H, D)
    key: torch.Tensor,  # (T, Hkv, D)
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim) float32: [cos | sin]
) -> tuple[torch.Tensor, torch.Tensor]:
    q, q_stride = _head_rows(query, "query")
    k, k_stride = _head_rows(key, "key")
    num_tokens, head_dim = q.shape[0], q.shape[2]
    rot_dim = cos_sin_cache.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)}, query {tuple(q.shape)}, key {tuple(k.shape)} disagree")
    if rot_dim % 2 or rot_dim > head_dim or cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype} does not fit head_dim {head_dim}")
    positions = positions.to(torch.int64).contiguous()
    # The C code indexes the table with these: an out-of-range position would read past it.
    if num_tokens and not 0 <= int(positions.min()) <= int(positions.max()) < cos_sin_cache.shape[0]:
        raise ValueError(f"positions must be in [0, {cos_sin_cache.shape[0]})")
    cos_sin = cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    _library().stoker_rotary_f32(
        positions.data_ptr(), q.data_ptr(), q_stride, k.data_ptr(), k_stride, cos_sin.data_ptr(), q_out.data_ptr(),
        k_out.data_ptr(), num_tokens, q.shape[1], k.shape[1], head_dim, rot_dim, _threads(q.numel()),
    )
    return q_out, k_out
