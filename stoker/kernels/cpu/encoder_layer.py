"""Python entry points of encoder_layer.c (float32): `bert_encoder`, whole post-LayerNorm BERT
layers in one C call, and the pointer arrays it takes (`bert_layer_params`,
`bert_encoder_params`); argument checks, then one ctypes call.

pooling/bert.py calls it (FusedBertLayers). The C code trusts its indices, so everything that
could make it read or write outside a tensor is checked here first.
"""

from __future__ import annotations

import ctypes

import torch

from stoker.kernels.cpu.common import _check_varlen_tables, _checked_library, _raise_for_status
from stoker.kernels.cpu.linear import panel_width


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
