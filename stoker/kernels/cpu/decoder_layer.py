"""Python entry points of decoder_layer.c: `decoder_decode`, a decode step's Llama-family
decoder layers in one C call, and the int64 slots that describe them (`linear_slots_*` for a
projection, `layer_slots` for a layer, `DecoderLayers` for the whole stack).

runner/cpu_decode.py builds them once, after the KV cache is allocated, from the weight methods
(`LinearMethod.c_linear_slots`). The C code trusts what the slots say, so every tensor they
point at is checked here when they are built, and the per-step inputs on every call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from stoker.kernels.cpu.common import _checked_library

# decoder_layer.c's kinds of projection
KIND_F32, KIND_Q8, KIND_Q4, KIND_Q4_A8, KIND_Q6_A8, KIND_Q4K_A8 = 0, 1, 2, 3, 4, 5
Q8_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2}

# decoder_layer.c's status codes -> what refused
_STATUS = {
    1: "a scratch buffer could not be allocated",
    2: "a position is outside the rotary table (max_model_len)",
    3: "a slot_mapping entry is past the KV cache's slots",
    4: "a context length is negative or needs more blocks than its block_tables row holds",
    5: "a block id is outside the KV cache",
    6: "a projection's kernel refused its arguments",
}


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"decoder_layer: {what}")


def _check_bias(bias: torch.Tensor | None, width: int) -> None:
    _check(bias is None or (bias.shape == (width,) and bias.dtype == torch.float32 and bias.is_contiguous()),
           f"bias must be packed ({width},) float32")


def _check_panels(packed: torch.Tensor, out_features: int, nr: int, silu: bool) -> tuple[int, int]:
    """(num_panels, K) of contiguous panels that hold out_features columns (whole panels with silu)."""
    num_panels, k = packed.shape[0], packed.shape[1]
    _check(packed.is_contiguous() and packed.device.type == "cpu", "panels must be contiguous on CPU")
    _check((num_panels - 1) * nr < out_features <= num_panels * nr, f"{out_features} outputs do not fit {num_panels} panels of {nr}")
    _check(not silu or out_features == num_panels * nr, "silu_and_mul needs whole panels")
    return num_panels, k


# the slots of a run that say where its columns go: DecoderLayers fills them in
_RUN_SLOTS = 13  # kind .. silu: what linear_slots_* give
N_SLOT, K_SLOT, SILU_SLOT = 10, 11, 12


@dataclass(frozen=True)
class LinearSlots:
    """One projection as decoder_layer.c reads it: one run (or several side by side: a composite
    GGUF layer's, layers/composite_method.py), each as its kernel's int64s, and the tensors they
    point at (held here, so that their storage outlives the slots)."""

    runs: tuple[tuple[int, ...], ...]
    tensors: tuple[torch.Tensor | None, ...]

    @property
    def out_features(self) -> int:
        return sum(r[N_SLOT] for r in self.runs)

    @property
    def in_features(self) -> int:
        return self.runs[0][K_SLOT]

    @property
    def silu(self) -> bool:
        return bool(self.runs[0][SILU_SLOT])

    @staticmethod
    def side_by_side(parts: list[LinearSlots]) -> LinearSlots:
        """A composite projection: its runs' slots in output order."""
        return LinearSlots(tuple(r for p in parts for r in p.runs), tuple(t for p in parts for t in p.tensors))


def linear_slots_f32(packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, silu: bool) -> LinearSlots:
    """A float32 projection (kernels/cpu/linear.py's pack_linear_weight panels, (P, K, NR))."""
    _check(packed.dtype == torch.float32 and packed.dim() == 3, "float32 (P, K, NR) panels")
    nr = packed.shape[2]
    num_panels, k = _check_panels(packed, out_features, nr, silu)
    _check_bias(bias, num_panels * nr)
    return LinearSlots(((KIND_F32, packed.data_ptr(), nr, k * nr, 0, 0, 0, 0, k, _ptr(bias), out_features, k, int(silu)),),
                       (packed, bias))


def linear_slots_q8(packed: torch.Tensor, scales: torch.Tensor, group_k: int, bias: torch.Tensor | None, out_features: int,
                    silu: bool) -> LinearSlots:
    """A one-byte projection (int8 or FP8 panels (P, K, NR), (G, P * NR) float32 scales)."""
    _check(packed.dtype in Q8_FORMATS and packed.dim() == 3, "int8 or float8_e4m3fn (P, K, NR) panels")
    nr = packed.shape[2]
    num_panels, k = _check_panels(packed, out_features, nr, silu)
    groups = -(-k // group_k) if group_k > 0 else 0
    _check(scales.shape == (groups, num_panels * nr) and scales.dtype == torch.float32 and scales.is_contiguous(),
           f"scales must be contiguous ({groups}, {num_panels * nr}) float32")
    _check_bias(bias, num_panels * nr)
    return LinearSlots(((KIND_Q8, packed.data_ptr(), nr, k * nr, Q8_FORMATS[packed.dtype], scales.data_ptr(), 0,
                         num_panels * nr, group_k, _ptr(bias), out_features, k, int(silu)),), (packed, scales, bias))


def linear_slots_q4(activations_int8: bool, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                    group_k: int, bias: torch.Tensor | None, out_features: int, silu: bool) -> LinearSlots:
    """A 4-bit projection (linear_q4.py's panels, scales and offsets), W4A16 or W4A8."""
    from stoker.kernels.cpu.linear_q4 import Q8_BLOCK, ROWS_PER_BLOCK, _check_q4_panels

    symbol = "stoker_linear_q4_a8" if activations_int8 else "stoker_linear_q4"
    num_panels, k, nr = _check_q4_panels(symbol, Q8_BLOCK if activations_int8 else ROWS_PER_BLOCK, packed, scales,
                                         offsets, group_k)
    _check_panels(packed, out_features, nr, silu)
    _check_bias(bias, num_panels * nr)
    return LinearSlots(((KIND_Q4_A8 if activations_int8 else KIND_Q4, packed.data_ptr(), k * nr // 2, 0,
                         int(scales.dtype == torch.float16), scales.data_ptr(), _ptr(offsets), num_panels * nr, group_k,
                         _ptr(bias), out_features, k, int(silu)),), (packed, scales, offsets, bias))


def linear_slots_q6_a8(packed: torch.Tensor, super_scales: torch.Tensor, bias: torch.Tensor | None,
                       out_features: int, silu: bool) -> LinearSlots:
    """A 6-bit W6A8 projection (linear_q6.py's panels and super-scales: GGUF's Q6_K)."""
    from stoker.kernels.cpu.linear_q6 import CHUNK, check_q6_panels

    num_panels, k, nr = check_q6_panels(packed, super_scales)
    _check_panels(packed.view(num_panels, k, -1), out_features, nr, silu)
    _check_bias(bias, num_panels * nr)
    return LinearSlots(((KIND_Q6_A8, packed.data_ptr(), k // CHUNK * packed.shape[2], 0, 0, super_scales.data_ptr(), 0,
                         num_panels * nr, 0, _ptr(bias), out_features, k, int(silu)),), (packed, super_scales, bias))


def linear_slots_q4k_a8(packed: torch.Tensor, sub: torch.Tensor, sup: torch.Tensor, bias: torch.Tensor | None,
                        out_features: int, silu: bool) -> LinearSlots:
    """A Q4_K projection in its own bytes, W4A8 (linear_q4.py's panels, sub- and super-scales)."""
    from stoker.kernels.cpu.linear_q4 import check_q4k

    num_panels, k, nr = check_q4k(packed, sub, sup)
    _check_panels(packed, out_features, nr, silu)
    _check_bias(bias, num_panels * nr)
    return LinearSlots(((KIND_Q4K_A8, packed.data_ptr(), k * nr // 2, 0, 0, sub.data_ptr(), sup.data_ptr(),
                         num_panels * nr, 0, _ptr(bias), out_features, k, int(silu)),), (packed, sub, sup, bias))


@dataclass
class LayerTensors:
    """What one decoder layer's slots point at, besides its projections' own slots."""

    input_norm: torch.Tensor  # (hidden,) float32
    post_norm: torch.Tensor  # (hidden,)
    q_norm: torch.Tensor | None  # (head_dim,): Qwen3's per-head norms, or None
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D) float32
    v_cache: torch.Tensor
    sliding_window: int | None
    qkv: LinearSlots  # linear_slots_*
    o: LinearSlots
    gate_up: LinearSlots
    down: LinearSlots


class DecoderLayers:
    """The slots of a stack of decoder layers, checked against each other once; holds the
    tensors they point at (so their storage outlives the slots). Like a captured CUDA graph it
    addresses the weights and the KV cache as they were when built: whatever re-lays either
    (allocate_kv_cache does) must build it again."""

    def __init__(self, layers: list[LayerTensors], hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 cos_sin: torch.Tensor, eps: float, qk_eps: float, scale: float) -> None:
        lib = _checked_library()
        run_slots, max_parts = lib.stoker_decoder_linear_slots(), lib.stoker_decoder_max_parts()
        _check(run_slots == _RUN_SLOTS + 2, f"decoder_layer.c reads {run_slots} slots a run")
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        _check(bool(layers), "no layers")
        _check(cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and cos_sin.dim() == 2
               and cos_sin.shape[1] % 2 == 0 and cos_sin.shape[1] <= head_dim, "cos_sin must be contiguous (max_position, rot_dim) float32")
        cache_shape = layers[0].k_cache.shape
        _check(len(cache_shape) == 4 and tuple(cache_shape[2:]) == (num_kv_heads, head_dim), f"KV cache {tuple(cache_shape)}")

        def projection(p: LinearSlots, name: str) -> list[int]:
            """The runs' slots with their output columns, padded to max_parts runs."""
            _check(1 <= len(p.runs) <= max_parts and all(len(r) == _RUN_SLOTS and r[K_SLOT] == p.in_features for r in p.runs)
                   and (len(p.runs) == 1 or not any(r[SILU_SLOT] for r in p.runs)),
                   f"{name}: 1 to {max_parts} runs of one input width (silu_and_mul in a run of its own)")
            width = p.out_features // 2 if p.silu else p.out_features
            out, offset = [], 0
            for r in p.runs:
                out += [*r, offset, width]
                offset += r[N_SLOT]
            return out + ([-1] + [0] * (run_slots - 1)) * (max_parts - len(p.runs))  # kind -1: no run

        slots: list[int] = []
        for i, t in enumerate(layers):
            for name in ("input_norm", "post_norm"):
                w = getattr(t, name)
                _check(w.shape == (hidden,) and w.dtype == torch.float32 and w.is_contiguous(), f"layer {i}: {name} must be ({hidden},) float32")
            _check((t.q_norm is None) == (t.k_norm is None) == (layers[0].q_norm is None),
                   f"layer {i}: q_norm and k_norm come together, in every layer or none")
            for w in (t.q_norm, t.k_norm):
                _check(w is None or (w.shape == (head_dim,) and w.dtype == torch.float32 and w.is_contiguous()),
                       f"layer {i}: q_norm / k_norm must be ({head_dim},) float32")
            for c in (t.k_cache, t.v_cache):
                _check(c.shape == cache_shape and c.dtype == torch.float32 and c.is_contiguous(), f"layer {i}: float32 KV caches of one shape")
            for name, (k, n) in {"qkv": (hidden, q_size + 2 * kv_size), "o": (q_size, hidden)}.items():
                p = getattr(t, name)
                _check(p.in_features == k and p.out_features == n and not p.silu, f"layer {i}: {name} takes {k} -> {n} without an epilogue")
            gu, down = t.gate_up, t.down
            _check(gu.in_features == hidden and gu.out_features % 2 == 0 and down.in_features == gu.out_features // 2
                   and down.out_features == hidden and not down.silu, f"layer {i}: gate_up ({hidden} -> 2 I) and down (I -> {hidden}) do not fit")
            slots += [_ptr(t.input_norm), _ptr(t.post_norm), _ptr(t.q_norm), _ptr(t.k_norm), _ptr(t.k_cache),
                      _ptr(t.v_cache), int(t.sliding_window or 0)]
            for name in ("qkv", "o", "gate_up", "down"):
                slots += projection(getattr(t, name), f"layer {i}: {name}")
        _check(len(slots) == len(layers) * lib.stoker_decoder_layer_slots(), "slot count")
        self.array = (ctypes.c_int64 * len(slots))(*slots)
        self.layers = layers
        self.num_layers, self.hidden = len(layers), hidden
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.cos_sin = cos_sin
        self.eps, self.qk_eps, self.scale = eps, qk_eps, scale
        self.num_blocks, self.block_size = cache_shape[0], cache_shape[1]


def decoder_decode(
    layers: DecoderLayers,
    x: torch.Tensor,  # (T, hidden) float32, contiguous: the embeddings in; the last MLP's output out
    positions: torch.Tensor,  # (T,) int64
    slot_mapping: torch.Tensor,  # (T,) int64
    block_tables: torch.Tensor,  # (T, max_blocks) int32
    context_lens: torch.Tensor,  # (T,) int32, the new token counted
) -> torch.Tensor:  # (T, hidden): the residual stream beside x, for the final norm
    """A decode step (one new token per sequence, T sequences) through every layer, the GIL
    released (decoder_layer.c). Raises ValueError naming the stage that refused; the cache
    may then hold some of this step's K/V, which the step's failure discards."""
    t, hidden = x.shape
    _check(x.dtype == torch.float32 and x.is_contiguous() and hidden == layers.hidden, f"x must be contiguous (T, {layers.hidden}) float32")
    for name, v, dtype in (("positions", positions, torch.int64), ("slot_mapping", slot_mapping, torch.int64),
                           ("context_lens", context_lens, torch.int32)):
        _check(v.shape == (t,) and v.dtype == dtype and v.is_contiguous(), f"{name} must be contiguous ({t},) {dtype}")
    _check(block_tables.dim() == 2 and block_tables.shape[0] == t and block_tables.dtype == torch.int32
           and block_tables.is_contiguous(), f"block_tables must be contiguous ({t}, max_blocks) int32")
    res = torch.empty_like(x)
    status = _checked_library().stoker_decoder_decode_f32(
        x.data_ptr(), res.data_ptr(), t, hidden, layers.num_layers, layers.array, positions.data_ptr(),
        layers.cos_sin.data_ptr(), layers.cos_sin.shape[0], layers.cos_sin.shape[1], layers.num_heads, layers.num_kv_heads,
        layers.head_dim, layers.eps, layers.qk_eps, layers.scale, slot_mapping.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), layers.num_blocks, layers.block_size, torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise ValueError(f"decoder_decode: {_STATUS.get(status, f'status {status}')}")
    return res
