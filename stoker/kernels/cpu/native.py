"""Python entry points of the CPU C kernels (float32): argument checks, then one ctypes call.

Each function has reference.py's signature and semantics (its twin); `kernels/ops.py` calls
them for CPU float32 tensors when `build.available()`. The C code trusts its indices, so
everything that could make it read or write outside a tensor is checked here first.
"""

from __future__ import annotations

import ctypes

import torch

from stoker.kernels._common import kv_inverse_scales
from stoker.kernels.cpu.build import BuildError, available, library


KV_DTYPES = (torch.float32, torch.float8_e4m3fn)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The C kernels' domain: CPU float32 query, float32 or FP8 E4M3 cache. Anything else takes the torch twin."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and k_cache.dtype in KV_DTYPES
        and available()
    )


def store_supported(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The C store's domain: CPU float32 K/V rows into a float32 or FP8 cache."""
    return supports_rows(key, value) and k_cache.dtype in KV_DTYPES and k_cache.device.type == "cpu"


def _checked_library():
    lib = library()
    if lib is None:
        raise BuildError("the CPU kernel library is not available")
    return lib


def _check_paged(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Query (.., H, D) and caches (num_blocks, block_size, Hkv, D) fit together; returns the cache's shape."""
    num_heads, head_dim = query.shape[-2:]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads or k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"shape mismatch: query {tuple(query.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (num_blocks, block_size, Hkv, D)")
    if query.dtype != torch.float32 or k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"float32 query and float32 or fp8 caches only: query {query.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    return num_blocks, block_size, num_kv_heads, head_dim


def _is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def _raise_for_status(status: int, kernel: str, bad_lengths: str, num_blocks: int) -> None:
    """The attention kernels' return codes: 1 no memory, 2 inconsistent lengths, 3 bad block id."""
    if status == 1:
        raise MemoryError(f"{kernel}: could not allocate the per-thread scratch buffers")
    if status == 2:
        raise ValueError(bad_lengths)
    if status == 3:
        raise ValueError(f"block_tables hold ids outside [0, {num_blocks})")


def paged_decode_attention(
    query: torch.Tensor,  # (B, H, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    context_lens: torch.Tensor,  # (B,) int32
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # FP8 caches: dequantization scales of this layer
    v_scale: float = 1.0,
) -> torch.Tensor:  # (B, H, D)
    lib = _checked_library()
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = _check_paged(query, k_cache, v_cache)
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"{num_seqs} queries but block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)}"
        )
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    # The C code checks every length and block id it will use before reading (return 2, 3).
    args = (
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window or 0,
    )  # fmt: skip
    if _is_fp8(k_cache):
        status = lib.stoker_paged_decode_attention_fp8(*args, k_scale, v_scale, torch.get_num_threads())
    else:
        status = lib.stoker_paged_decode_attention_f32(*args, torch.get_num_threads())
    _raise_for_status(
        status, "paged_decode_attention",
        f"context_lens must be in [0, {block_tables.shape[1] * block_size}] (the block table's "
        f"{block_tables.shape[1]} blocks of {block_size})", num_blocks,
    )  # fmt: skip
    return out


def prefill_supported(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The C prefill kernel's domain: CPU float32, head_dim a multiple of the vector width."""
    return supports(query, k_cache) and query.shape[-1] % int(library().stoker_linear_vl()) == 0


def paged_attention(
    query: torch.Tensor,  # (T, H, D), packed over sequences
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    cu_seqlens_q: list[int] | torch.Tensor,  # (B + 1,)
    context_lens: list[int] | torch.Tensor,  # (B,)
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # FP8 caches: dequantization scales of this layer
    v_scale: float = 1.0,
) -> torch.Tensor:  # (T, H, D)
    """reference.paged_attention's semantics, in C (prefill_attention.c)."""
    lib = _checked_library()
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = _check_paged(query, k_cache, v_cache)
    cu = torch.as_tensor(cu_seqlens_q, dtype=torch.int64).contiguous()
    ctx = torch.as_tensor(context_lens, dtype=torch.int64).contiguous()
    num_seqs = ctx.shape[0]
    if cu.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"cu_seqlens_q {tuple(cu.shape)}, context_lens {tuple(ctx.shape)} and block_tables disagree")
    if num_seqs and (int(cu[0]) < 0 or int(cu[-1]) > num_tokens or bool((cu[1:] < cu[:-1]).any())):
        raise ValueError(f"cu_seqlens_q must rise from >= 0 to <= {num_tokens} (the query rows)")
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    args = (
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_tables.data_ptr(),
        block_tables.shape[1], cu.data_ptr(), ctx.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads,
        head_dim, block_size, scale, sliding_window or 0,
    )  # fmt: skip
    if _is_fp8(k_cache):
        status = lib.stoker_paged_prefill_attention_fp8(*args, k_scale, v_scale, torch.get_num_threads())
    else:
        status = lib.stoker_paged_prefill_attention_f32(*args, torch.get_num_threads())
    _raise_for_status(
        status, "paged_attention",
        f"each sequence needs 0 <= query rows <= context_len <= the block table's {block_tables.shape[1] * block_size} positions",
        num_blocks,
    )  # fmt: skip
    return out


def varlen_attention(
    query: torch.Tensor,  # (T, H, D) packed over sequences, contiguous
    key: torch.Tensor,  # (T, Hkv, D) contiguous
    value: torch.Tensor,  # (T, Hkv, D) contiguous
    token_table: torch.Tensor,  # (B, max_len) int32: row s = the token rows of sequence s (then anything)
    cu_seqlens: torch.Tensor,  # (B + 1,) int64
    lengths: torch.Tensor,  # (B,) int64
    scale: float,
    causal: bool,
) -> torch.Tensor:  # (T, H, D)
    """Attention of whole packed sequences with no KV cache (pooling models), each sequence over
    its own tokens only, with no padding: prefill_attention.c reading `key`/`value` as a cache
    of block_size 1 whose block table is each sequence's token rows; bidirectional (an encoder)
    or causal (a decoder embedding model). Semantics: SDPA per sequence."""
    lib = _checked_library()
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        raise ValueError("varlen_attention needs contiguous query, key and value")
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} do not match")
    if token_table.dtype != torch.int32 or cu_seqlens.dtype != torch.int64 or lengths.dtype != torch.int64:
        raise ValueError("token_table must be int32, cu_seqlens and lengths int64")
    num_seqs = lengths.shape[0]
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    args = (
        query.data_ptr(), key.data_ptr(), value.data_ptr(), num_tokens, token_table.data_ptr(), token_table.shape[1],
        cu_seqlens.data_ptr(), lengths.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, 1, scale,
    )  # fmt: skip
    if causal:
        status = lib.stoker_paged_prefill_attention_f32(*args, 0, torch.get_num_threads())
    else:
        status = lib.stoker_prefill_attention_bidirectional_f32(*args, torch.get_num_threads())
    _raise_for_status(status, "varlen_attention", "each sequence's length must fit its token_table row", num_tokens)
    return out


def encoder_attention(
    qkv: torch.Tensor,  # (T, 3, H, D) an encoder's fused projection, contiguous
    token_table: torch.Tensor,  # (B, max_len) int32: row s = the token rows of sequence s
    cu_seqlens: torch.Tensor,  # (B + 1,) int64
    lengths: torch.Tensor,  # (B,) int64
    scale: float,
) -> torch.Tensor:  # (T, H, D)
    """varlen_attention, not causal, reading q, k and v in place from one fused projection
    (prefill_attention.c, stoker_encoder_attention_f32): no copy of each."""
    num_tokens, three, num_heads, head_dim = qkv.shape
    if three != 3 or qkv.dtype != torch.float32 or not qkv.is_contiguous():
        raise ValueError(f"encoder_attention needs contiguous float32 (T, 3, H, D), got {tuple(qkv.shape)} {qkv.dtype}")
    _check_varlen_tables(token_table, cu_seqlens, lengths, num_tokens)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float32)
    if lengths.shape[0]:
        status = _checked_library().stoker_encoder_attention_f32(
            qkv.data_ptr(), num_tokens, token_table.data_ptr(), token_table.shape[1], cu_seqlens.data_ptr(),
            lengths.data_ptr(), out.data_ptr(), lengths.shape[0], num_heads, head_dim, scale, torch.get_num_threads(),
        )  # fmt: skip
        _raise_for_status(status, "encoder_attention", "each sequence's length must fit its token_table row", num_tokens)
    return out


def _check_varlen_tables(token_table: torch.Tensor, cu_seqlens: torch.Tensor, lengths: torch.Tensor, num_tokens: int) -> None:
    """The C side trusts cu_seqlens; it checks each length against token_table's width and each row id against T."""
    if token_table.dtype != torch.int32 or cu_seqlens.dtype != torch.int64 or lengths.dtype != torch.int64:
        raise ValueError("token_table must be int32, cu_seqlens and lengths int64")
    num_seqs = lengths.shape[0]
    if token_table.dim() != 2 or token_table.shape[0] != num_seqs or cu_seqlens.shape != (num_seqs + 1,):
        raise ValueError(f"token_table {tuple(token_table.shape)}, cu_seqlens {tuple(cu_seqlens.shape)} and lengths "
                         f"{tuple(lengths.shape)} disagree on the number of sequences")
    if not (token_table.is_contiguous() and cu_seqlens.is_contiguous() and lengths.is_contiguous()):
        raise ValueError("token_table, cu_seqlens and lengths must be contiguous")
    if num_seqs and (int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens):
        raise ValueError(f"cu_seqlens must run from 0 to the {num_tokens} tokens")


# BertLayer's activations, as encoder_layer.c numbers them
BERT_ACTIVATIONS = {"gelu": 0, "gelu_new": 1, "gelu_pytorch_tanh": 1, "relu": 2}


def bert_encoder(
    x: torch.Tensor,  # (T, hidden) float32, contiguous: read, and overwritten with the last layer's output
    params: ctypes.Array,  # 12 data pointers, bert_layer_params' order; 12 x L: every layer, one call
    num_heads: int,
    intermediate: int,
    eps: float,
    act: int,  # BERT_ACTIVATIONS
    token_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    workspace: torch.Tensor,  # >= T * (5 * hidden + intermediate) float32, contiguous
) -> None:
    """Post-LayerNorm BERT layers in one C call, the GIL released throughout (encoder_layer.c):
    one layer, or with `params` holding 12 x L pointers (bert_layer_params of each layer, joined
    by bert_encoder_params) all L of them, layer after layer."""
    num_tokens, hidden = x.shape
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"bert_encoder needs contiguous float32 (T, hidden), got {x.dtype}")
    if workspace.dtype != torch.float32 or not workspace.is_contiguous() or workspace.numel() < num_tokens * (5 * hidden + intermediate):
        raise ValueError(f"workspace of {workspace.numel()} floats, need {num_tokens * (5 * hidden + intermediate)}")
    if act not in BERT_ACTIVATIONS.values():
        raise ValueError(f"act {act}: not one of BERT_ACTIVATIONS' {sorted(set(BERT_ACTIVATIONS.values()))}")
    _check_varlen_tables(token_table, cu_seqlens, lengths, num_tokens)
    if not lengths.shape[0]:
        return
    if len(params) % 12 or not params:
        raise ValueError(f"params holds {len(params)} pointers: 12 per layer")
    status = _checked_library().stoker_bert_encoder_f32(
        x.data_ptr(), num_tokens, hidden, num_heads, intermediate, len(params) // 12, params, eps, act,
        token_table.data_ptr(), token_table.shape[1], cu_seqlens.data_ptr(), lengths.data_ptr(), lengths.shape[0], scale,
        workspace.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _raise_for_status(status, "bert_encoder", "each sequence's length must fit its token_table row", num_tokens)


def bert_layer_params(tensors: list[torch.Tensor], hidden: int, intermediate: int) -> ctypes.Array:
    """The 12 tensors of a layer (Wqkv, bqkv, Wo, bo, LN1 weight and bias, W1, b1, W2, b2, LN2
    weight and bias; projections as pack_linear_weight panels, biases packed too), checked
    once, as the ctypes array bert_encoder takes. The tensors must outlive it."""
    nr = panel_width()
    whole = lambda n: -(-n // nr) * nr  # noqa: E731  (outputs padded to whole panels)
    expected = [(whole(3 * hidden) // nr, hidden, nr), (whole(3 * hidden),), (whole(hidden) // nr, hidden, nr), (whole(hidden),),
                (hidden,), (hidden,), (whole(intermediate) // nr, hidden, nr), (whole(intermediate),),
                (whole(hidden) // nr, intermediate, nr), (whole(hidden),), (hidden,), (hidden,)]  # fmt: skip
    if len(tensors) != 12:
        raise ValueError(f"a BERT layer has 12 parameter tensors, got {len(tensors)}")
    for i, (t, shape) in enumerate(zip(tensors, expected)):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"parameter {i} of a BERT layer: {tuple(t.shape)} {t.dtype}, expected contiguous {shape} float32 on CPU")
    return (ctypes.c_void_p * 12)(*(t.data_ptr() for t in tensors))


def bert_encoder_params(layers: list[ctypes.Array]) -> ctypes.Array:
    """Several layers' bert_layer_params as one array of 12 x L pointers, for one bert_encoder call."""
    return (ctypes.c_void_p * (12 * len(layers)))(*(ptr for layer in layers for ptr in layer))


# ---------------------------------------------------------------- store_kvcache (store_kvcache.c)
def store_kvcache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,) int64, -1 = not stored
    k_scale: float = 1.0,  # FP8 caches: x is stored as e4m3(clamp(x / scale, +-448))
    v_scale: float = 1.0,
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k, k_stride = _head_rows(key, "key")
    v, v_stride = _head_rows(value, "value")
    if k.shape[1:] != (num_kv_heads, head_dim) or v.shape != k.shape or slot_mapping.shape != (k.shape[0],):
        raise ValueError(
            f"key {tuple(k.shape)}, value {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)} "
            f"do not fit the cache {tuple(k_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError("k_cache and v_cache must be contiguous (num_blocks, block_size, Hkv, D)")
    if not (k.dtype == v.dtype == torch.float32 and k_cache.dtype in KV_DTYPES and v_cache.dtype == k_cache.dtype):
        raise ValueError(f"float32 K/V into a float32 or fp8 cache only: key {k.dtype}, value {v.dtype}, cache {k_cache.dtype}")
    slots = slot_mapping.to(torch.int64).contiguous()
    args = (
        k.data_ptr(), k_stride, v.data_ptr(), v_stride, k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        k.shape[0], num_kv_heads * head_dim, num_blocks * block_size,
    )  # fmt: skip
    if _is_fp8(k_cache):
        bad = library().stoker_store_kvcache_fp8(*args, *kv_inverse_scales(k_scale, v_scale), _threads(k.numel()))
    else:
        bad = library().stoker_store_kvcache_f32(*args, _threads(k.numel()))
    if bad:
        raise ValueError(f"{bad} slot_mapping entries are past the cache's {num_blocks * block_size} slots")


# ---------------------------------------------------------------- linear (linear.c)
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
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, silu_and_mul: bool, call
) -> torch.Tensor:
    """What linear and linear_q8 share: check x and bias against the panels, view x as rows,
    allocate the output, `call(rows, row_stride, out, width)` the kernel unless x is empty."""
    num_panels, k, nr = packed.shape
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
    return silu_and_mul(pre.reshape(-1, panel_width())).view(num_tokens, n // 2)


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


# ---------------------------------------------------------------- row-wise kernels (elementwise.c)
# Below this many elements a kernel runs on one thread: waking the OpenMP team costs more
# than it saves (torch's own grain size for element-wise ops is 32768).
_PARALLEL_MIN_ELEMENTS = 32768


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= _PARALLEL_MIN_ELEMENTS else 1


def supports_rows(*tensors: torch.Tensor) -> bool:
    """The row kernels' domain: CPU float32 tensors whose last dim is contiguous."""
    for t in tensors:  # a plain loop: this runs before every kernel call
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() < 1 or t.stride(-1) != 1:
            return False
    return available()


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
    library().stoker_rms_norm_f32(
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
    library().stoker_rms_norm_f32(
        rows.data_ptr(), stride, res_rows.data_ptr(), res_stride, weight.data_ptr(), out.data_ptr(),
        new_residual.data_ptr(), rows.shape[0], rows.shape[1], eps, _threads(rows.numel()),
    )
    return out.view(x.shape), new_residual.view(x.shape)


def lora(
    x: torch.Tensor,  # (T, K) float32, unit column stride
    a: torch.Tensor,  # (S, W, K) every slot's A, shards stacked along W
    bt: torch.Tensor,  # (S, W, N) every slot's expand, transposed, zero outside `blocks`
    segments: torch.Tensor,  # (G, 3) int64: slot, first token, end token
    blocks: torch.Tensor,  # (E, 4) int64: rank rows [w0, w1) reach output columns [n0, n1)
    ranks: torch.Tensor,  # (S,) int64: the rows of each block the adapter in the slot fills
    out: torch.Tensor,  # (T, >= N) float32, updated in place
) -> torch.Tensor:
    """out[t] += (x[t] @ A[s].T) @ BT[s] for the tokens of each segment (lora.c)."""
    num_slots, w, k = a.shape
    n = bt.shape[2]
    if x.dim() != 2 or x.shape[1] != k or bt.shape[:2] != (num_slots, w) or out.shape[0] != x.shape[0] or out.shape[1] < n:
        raise ValueError(f"lora: x {tuple(x.shape)}, A {tuple(a.shape)}, BT {tuple(bt.shape)}, out {tuple(out.shape)} do not chain")
    if not all(t.dtype == torch.float32 for t in (x, a, bt, out)) or not (a.is_contiguous() and bt.is_contiguous()):
        raise ValueError("lora needs float32 tensors and contiguous slot buffers")
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("lora needs x and out with unit column stride")
    for t in (segments, blocks, ranks):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError("lora's segments, blocks and ranks must be contiguous int64")
    if int(segments.shape[0]) == 0:
        return out
    status = _checked_library().stoker_lora_f32(
        x.data_ptr(), x.stride(0), k, a.data_ptr(), bt.data_ptr(), w, n, segments.data_ptr(), segments.shape[0],
        blocks.data_ptr(), blocks.shape[0], ranks.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("lora: could not allocate its scratch buffer")
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2 * d) [gate | up] -> (..., d) silu(gate) * up."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate | up), got {x.shape[-1]}")
    rows, stride = _as_rows(x)
    d = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], d), dtype=x.dtype)
    library().stoker_silu_and_mul_f32(rows.data_ptr(), stride, out.data_ptr(), rows.shape[0], d, _threads(rows.numel()))
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
    cos_sin = cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    # The C code indexes the table with the positions; it checks them all before any read.
    bad = library().stoker_rotary_f32(
        positions.data_ptr(), q.data_ptr(), q_stride, k.data_ptr(), k_stride, cos_sin.data_ptr(), cos_sin.shape[0],
        q_out.data_ptr(), k_out.data_ptr(), num_tokens, q.shape[1], k.shape[1], head_dim, rot_dim, _threads(q.numel()),
    )  # fmt: skip
    if bad:
        raise ValueError(f"positions must be in [0, {cos_sin_cache.shape[0]})")
    return q_out, k_out
