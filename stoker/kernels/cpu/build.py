"""Builds and caches the C kernels in this folder into one library, and loads it (ctypes).

The C sources are compiled into one library once per machine and instruction set with the
system C compiler (`$CC`, else `cc`/`gcc`: `-O3 -fopenmp -ffast-math` and the target of
`STOKER_CPU_ISA`, see `ISA_TARGETS`) into `<cache root>/kernels/<hash>/`
(`stoker.paths.cache_root()`: `$STOKER_CACHE_DIR`, default `~/.cache/stoker`), keyed by the
sources, the compiler's version, the flags and this CPU's flags, and loaded with ctypes.
Building takes ~3.6 s for -march=native (docs/benchmarks.md, `benchmarks/kernel_build_time.py`);
later processes load the cached library.

`STOKER_CPU_ISA` is read once, when the library is first loaded: `native` (the default,
`-march=native`), `avx512`, `avx2` or `generic` (x86-64 with SSE2 only). The narrower builds
exist so that one machine can test every code path the kernels have (tests/kernels/
test_cpu_isa.py); an ISA this CPU lacks is refused with a BuildError that says which.

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

from stoker.paths import cache_root

logger = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_decode_attention.c", "prefill_attention.c", "elementwise.c", "linear.c", "store_kvcache.c", "lora.c", "encoder_layer.c", "decoder_layer.c", "moe.c", "mla_decode_attention.c"))
# Included by the sources: part of the cache key, so an edit rebuilds.
_HEADERS = (Path(__file__).with_name("fp8.h"), Path(__file__).with_name("linear_q4.h"),
            Path(__file__).with_name("linear_q4_a8.h"), Path(__file__).with_name("linear_q6_a8.h"),
            Path(__file__).with_name("linear_q4k_a8.h"), Path(__file__).with_name("rows.h"))
# -ffast-math lets gcc vectorize expf (through glibc's libmvec) and reassociate the dot
# products' sums; the kernel never sees inf/NaN (it reads only positions it attends). It is
# given to the compile step only: linked in, it would add crtfastmath.o, whose constructor
# flushes denormals to zero for the whole process.
_CFLAGS = ["-O3", "-fopenmp", "-fPIC", "-ffast-math"]
_LDFLAGS = ["-shared", "-fopenmp", "-lm"]
# linear.c promises that a row's result does not depend on the rows beside it: it spells out
# its multiply-adds (explicit FMA where the ISA has it), so the compiler must not contract or
# reassociate any on its own. Left to gcc, -march=znver2/znver3 (whose tuning avoids FMA
# chains) kept some tiles' accumulations as mul + add and fused others, and a row computed in
# a 1-row tile differed from the same row in a 3-row tile by a few ulps (issue 12).
_SOURCE_CFLAGS = {name: ["-ffp-contract=off", "-fno-associative-math"] for name in ("linear.c", "lora.c", "moe.c")}

# STOKER_CPU_ISA -> (gcc target flags, the /proc/cpuinfo flags the CPU needs to run that build)
ISA_TARGETS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "native": (["-march=native"], ()),
    "avx512": (["-march=x86-64-v4", "-mtune=generic"], ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma")),
    "avx2": (["-march=x86-64-v3", "-mtune=generic"], ("avx2", "fma", "f16c", "bmi2")),
    "generic": (["-march=x86-64", "-mtune=generic"], ()),
}


class BuildError(RuntimeError):
    pass


def disabled() -> bool:
    """STOKER_DISABLE_CPU_KERNELS=1 forces the torch twins (read per call: tests may flip it)."""
    return _parse_disabled(os.environ.get("STOKER_DISABLE_CPU_KERNELS"))


@functools.lru_cache(maxsize=8)
def _parse_disabled(value: str | None) -> bool:
    # Cached per raw value: this runs before every kernel call (~10 per layer and step).
    return (value or "0").strip().lower() not in ("", "0", "false", "no")


def cache_dir() -> Path:
    return cache_root() / "kernels"


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


def selected_isa() -> str:
    """`STOKER_CPU_ISA`, lower-cased; `native` when unset."""
    return (os.environ.get("STOKER_CPU_ISA") or "native").strip().lower()


def supported_isas() -> list[str]:
    """The ISA builds this CPU can run, `native` first (x86-64 only; elsewhere just `native`)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["native"]
    have = set(_cpu_flags().split())
    return [isa for isa, (_, needs) in ISA_TARGETS.items() if all(flag in have for flag in needs)]


def _target_flags(isa: str) -> list[str]:
    if isa not in ISA_TARGETS:
        raise BuildError(f"STOKER_CPU_ISA={isa!r} is not one of {', '.join(ISA_TARGETS)}")
    if isa != "native" and isa not in supported_isas():
        missing = [f for f in ISA_TARGETS[isa][1] if f not in _cpu_flags().split()]
        raise BuildError(f"STOKER_CPU_ISA={isa}: this CPU lacks {', '.join(missing)}; use one of {', '.join(supported_isas())}")
    return ISA_TARGETS[isa][0]


def _compile_flags(src: Path, isa: str) -> list[str]:
    return [*_CFLAGS, *_target_flags(isa), *_SOURCE_CFLAGS.get(src.name, [])]


def build(sources: tuple[Path, ...] = _SOURCES, isa: str = "native") -> Path:
    """Compile `sources` for `isa` into one shared library (or reuse the cached one); returns its path."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    flags = [" ".join(_compile_flags(src, isa)) for src in sources]
    parts = [src.read_text() for src in (*sources, *_HEADERS)] + [version, *flags, " ".join(_LDFLAGS), _cpu_flags()]
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
        # The sources compile side by side (linear.c alone takes ~0.9 s), then link.
        cmds = [[cc, *_compile_flags(src, isa), "-c", str(src), "-o", obj] for src, obj in zip(sources, objs)]
        procs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) for cmd in cmds]
        link = [cc, *objs, *_LDFLAGS, "-o", tmp]
        results = []
        for cmd, proc in procs:
            _, stderr = proc.communicate()  # reads the pipes while waiting: a long error cannot block
            results.append((cmd, proc.returncode, stderr))
        if all(code == 0 for _, code, _ in results):
            proc = subprocess.run(link, check=False, capture_output=True, text=True)
            results.append((link, proc.returncode, proc.stderr))
        for cmd, code, stderr in results:
            if code != 0:
                raise BuildError(f"{' '.join(cmd)} failed: {stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        for leftover in (tmp, *objs):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library (built for `STOKER_CPU_ISA`, read here once per process) with its
    functions' signatures set, or None (and a warning) if it cannot be built."""
    isa = selected_isa()
    try:
        lib = ctypes.CDLL(str(build(isa=isa)))
    except (BuildError, OSError) as exc:
        logger.warning("CPU C kernels unavailable (%s); using the torch path (slower attention and row ops)", exc)
        return None
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "stoker_paged_decode_attention_f32": ([p, p, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, f32, i64, i32, p, f32], i32),
        "stoker_paged_decode_attention_fp8": ([p, p, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, f32, i64, f32, f32, i32, p, f32], i32),
        "stoker_rms_norm_f32": ([p, i64, p, i64, p, p, p, i64, i64, f32, i32], None),
        "stoker_silu_and_mul_f32": ([p, i64, p, i64, i64, i32], None),
        "stoker_rotary_f32": ([p, p, i64, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, i32], i32),
        "stoker_linear_f32": ([p, i64, p, i64, i64, p, p, i64, i64, i64, i64, i32, i32], None),
        "stoker_linear_q8": ([p, i64, p, i64, i64, i32, p, i64, i64, p, p, i64, i64, i64, i64, i32, i32], i32),
        "stoker_linear_q4": ([p, i64, p, i64, p, i32, p, i64, i64, p, p, i64, i64, i64, i64, i32, i32], i32),
        "stoker_linear_q4_a8": ([p, i64, p, i64, p, i32, p, i64, i64, p, p, i64, i64, i64, i64, i32, i32], i32),
        "stoker_linear_q6_a8": ([p, i64, p, i64, p, i64, p, p, i64, i64, i64, i64, i32, i32], i32),
        "stoker_linear_q4k_a8": ([p, i64, p, i64, p, p, i64, p, p, i64, i64, i64, i64, i32, i32], i32),
        "stoker_linear_nr": ([], i32),
        "stoker_linear_vl": ([], i32),
        "stoker_cpu_target": ([], ctypes.c_char_p),
        "stoker_paged_prefill_attention_f32": ([p, p, p, i64, p, i64, p, p, p, i64, i64, i64, i64, i64, f32, i64, i32, p, f32], i32),
        "stoker_paged_prefill_attention_fp8": ([p, p, p, i64, p, i64, p, p, p, i64, i64, i64, i64, i64, f32, i64, f32, f32, i32, p, f32], i32),
        "stoker_prefill_attention_bidirectional_f32": ([p, p, p, i64, p, i64, p, p, p, i64, i64, i64, i64, i64, f32, i32], i32),
        "stoker_store_kvcache_f32": ([p, i64, p, i64, p, p, p, i64, i64, i64, i32], i64),
        "stoker_store_kvcache_fp8": ([p, i64, p, i64, p, p, p, i64, i64, i64, f32, f32, i32], i64),
        "stoker_lora_f32": ([p, i64, i64, p, p, i64, i64, p, i64, p, i64, p, p, i64, i32], i32),
        "stoker_encoder_attention_f32": ([p, i64, p, i64, p, p, p, i64, i64, i64, f32, i32], i32),
        "stoker_fused_moe_f32": ([p, i64, p, p, i64, i64, i64, p, i64, i64, p, i64, i64, i64, i64, i32, p, p, i32, f32, f32,
                                  p, i32], i32),
        "stoker_fused_moe_mxfp4_f32": ([p, i64, p, p, i64, i64, i64, p, p, p, p, i64, i64, p, p, i32, f32, f32, p, i32],
                                       i32),
        "stoker_fused_moe_coded_f32": ([p, i64, p, p, i64, i64, i64, p, i32, p, p, i64, p, i32, p, p, i64, i64, i64, p, p,
                                        i32, f32, f32, p, i32], i32),
        "stoker_bert_encoder_f32": ([p, i64, i64, i64, i64, i64, p, f32, i32, p, i64, p, p, i64, f32, p, i32], i32),
        "stoker_decoder_decode_f32": ([p, p, i64, i64, i64, p, p, p, i64, i64, i64, i64, i64, f32, f32, f32, p, p, i64, p,
                                       i64, i64, i32], i32),
        "stoker_decoder_layer_slots": ([], i32),
        "stoker_decoder_linear_slots": ([], i32),
        "stoker_decoder_max_parts": ([], i32),
        "stoker_mla_decode_attention_f32": ([p, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, f32, i32], i32),
        "stoker_mla_decode_attention_fp8": ([p, p, i64, p, i64, p, p, i64, i64, i64, i64, i64, f32, f32, i32], i32),
    }
    for name, (argtypes, restype) in signatures.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, restype
    return lib


def available() -> bool:
    return not disabled() and library() is not None
