"""The Mixture-of-Experts feed-forward: `FusedMoE` holds every expert's weights stacked,
and a `MoEMethod` (the weight-method seam's four verbs, layers/weight_method.py) stores,
loads and applies them.

    w13 (E, 2I, H)   each expert's [gate; up] rows (checkpoint w1 = gate_proj, w3 = up_proj)
    w2  (E, H, I)    each expert's down projection (checkpoint w2 = down_proj)

Options (gpt-oss's experts): `activation`, a gated activation layer over [gate | up] in
place of `hidden_act`'s (layers/activation.ClampedSwiGLU), and `has_bias`: per-expert biases

    w13_bias (E, 2I)  added to each expert's [gate; up] before the activation
    w2_bias  (E, H)   added to each expert's output before its routing weight scales it

(checkpoint shard `(expert, "w1" | "w3" | "w2")`, parameter "bias"). Under tensor parallelism
w13_bias is cut with I and w2_bias is held by rank 0 only (the others hold zeros), so the
all-reduce adds it once, as a row-parallel projection's bias.

The router is not part of the layer (layers/moe_router.py): `forward(x, topk_weights,
topk_ids)` takes the choices already made, so a router with a bias, groups or a sigmoid
slots in without touching the experts.

Tensor parallelism cuts I (Megatron's MLP layout, expert by expert): each rank holds its
columns of every expert's gate and up and the matching rows of its down projection, its
output is a partial sum, and `forward` all-reduces it after the method, as the dense MLP's
down projection does. Expert parallelism (`--enable-expert-parallel`) cuts E instead: each
rank holds whole experts, a run of them (distributed/expert_partition.py), computes their
share of every token (layers/moe_expert_parallel.py) and `forward` all-reduces the same way.
`num_experts` is then this rank's count (what the method creates), as `intermediate_size` is
this rank's I; `global_num_experts` is the model's.

Loading: the checkpoint keeps one tensor per expert and projection; a shard key is
`(expert, "w1" | "w2" | "w3")` (models/moe_loading.py maps the checkpoint's names onto it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from stoker.distributed.expert_partition import ExpertPartition, whole_experts
from stoker.distributed.parallel_state import TensorParallelGroup
from stoker.distributed.partition import WHOLE, Partition
from stoker.layers.activation import ClampedSwiGLU, SiluAndMul, get_gated_activation
from stoker.layers.moe_expert_parallel import apply_held_experts
from stoker.layers.moe_load import ExpertTokenCounter
from stoker.layers.weight_method import expect_shape
from stoker.quantization.formats import FLOAT_CHECKPOINT_DTYPES

EXPERT_SHARDS = ("w1", "w2", "w3")


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        *,
        split: Partition = WHOLE,
        tp: TensorParallelGroup | None = None,
        experts: ExpertPartition | None = None,
        activation: nn.Module | None = None,
        has_bias: bool = False,
    ) -> None:
        super().__init__()
        experts = experts or whole_experts(num_experts)
        if experts.num_experts != num_experts:
            raise ValueError(f"the expert partition is of {experts.num_experts} experts; the layer has {num_experts}")
        if not split.is_whole and not experts.is_whole:
            raise ValueError("a FusedMoE cuts either its experts (expert parallelism) or their I (tensor parallelism), not both")
        if (not split.is_whole or not experts.is_whole) and tp is None:
            raise ValueError("a tensor- or expert-parallel FusedMoE needs its group (for the all-reduce)")
        self.global_num_experts = num_experts
        self.expert_split = experts
        self.num_experts = experts.size  # this rank's experts: what the method creates and loads
        self.hidden_size = hidden_size
        self.checkpoint_intermediate_size = intermediate_size
        self.split = split
        self.intermediate_size = split.size(intermediate_size)  # this rank's I
        self.reduce = tp if not (split.is_whole and experts.is_whole) else None
        # tokens routed per expert (all E), on the device; the engine reads it at its log interval and on a scrape
        self.expert_tokens = ExpertTokenCounter(num_experts)
        self.hidden_act = hidden_act  # the ACT2FN name, for a kernel that applies the gate itself
        # (n, 2I) [gate | up] -> (n, I); kernels bound at build
        self.act = activation if activation is not None else get_gated_activation(hidden_act)
        # a layer-supplied activation (gpt-oss's clamped SwiGLU) that hidden_act does not name
        self.custom_activation = activation is not None
        self.has_bias = has_bias
        self.method: MoEMethod | None = None

    def attach(self, method: MoEMethod) -> None:
        """Give this layer its method; the method creates the parameters (build time)."""
        if self.method is not None:
            raise RuntimeError("a FusedMoE's method is chosen once, when the model is built")
        self.method = method
        method.create_weights(self)

    @property
    def is_split(self) -> bool:
        return not self.split.is_whole

    @property
    def is_silu(self) -> bool:
        """SiLU-gated (what the fused CPU kernel can apply in the gate/up GEMM)."""
        return isinstance(self.act, SiluAndMul)

    @property
    def holds_down_bias(self) -> bool:
        """This rank adds w2_bias: always, but under tensor parallelism only rank 0 (the
        all-reduce sums the ranks' partial outputs, which would add it once per rank)."""
        return not self.is_split or self.reduce is None or self.reduce.is_first

    def checkpoint_slice(self, shard: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The part of one expert's checkpoint tensor `shard` ("w1", "w2", "w3") this rank reads:
        its rows of gate and up, its columns of down; None (all of it) when not split."""
        i, h = self.checkpoint_intermediate_size, self.hidden_size
        expect_shape(shape, (h, i) if shard == "w2" else (i, h), "expert weight", shard)
        if not self.is_split:
            return None
        cut = slice(*self.split.range(i))
        return (slice(None), cut) if shard == "w2" else (cut,)

    def bias_slice(self, shard: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The part of one expert's checkpoint bias of `shard` this rank reads: its I of gate and
        up; all of down's (H,)."""
        if not self.has_bias:
            raise ValueError(f"expert {shard} bias: this layer's experts have no biases")
        i = self.checkpoint_intermediate_size
        expect_shape(shape, (self.hidden_size,) if shard == "w2" else (i,), "expert bias", shard)
        if shard == "w2" or not self.is_split:
            return None
        return (slice(*self.split.range(i)),)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # (T, H), (T, k) float32, (T, k) int64 -> (T, H)
        if self.method is None:
            raise RuntimeError("this FusedMoE has no method: build models with models.loader.build_model")
        self.expert_tokens.record(topk_ids)
        if self.expert_split.is_whole:
            out = self.method.apply(self, x, topk_weights, topk_ids)
        else:  # this rank's experts only; every rank joins the all-reduce, chosen or not
            out = apply_held_experts(self.method, self, x, topk_weights, topk_ids)
        return out if self.reduce is None else self.reduce.all_reduce(out)

    def extra_repr(self) -> str:
        held = self.expert_split
        experts = f"{self.num_experts}" if held.is_whole else f"[{held.start}, {held.stop}) of {self.global_num_experts}"
        return (f"experts={experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"method={self.method.describe() if self.method else None}")


@dataclass(frozen=True)
class ExpertGroups:
    """The step's (token, choice) pairs grouped by expert, computed once per layer call.

    Each token's choices are first put in ascending expert order (their weights with them), so
    the k contributions of a token are later summed in that order, whatever the batch: the
    same order as an expert-by-expert loop (reference.fused_moe, transformers' eager path).
    """

    order: torch.Tensor  # (T * k,) flat (token, slot) index of each pair, pairs sorted by expert (stable)
    token_of: torch.Tensor  # (T * k,) the token of each sorted pair
    weights: torch.Tensor  # (T * k,) float32 routing weight of each sorted pair
    segments: list[tuple[int, int, int]]  # (expert, first, stop) of each expert with tokens


def expert_by_expert(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
    expert_forward: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x (T, H), topk (T, k) -> (T, H): each expert's rows through `expert_forward(e, rows)` once,
    scaled by their routing weights, then each token's k results summed in ascending expert
    order: a fixed order per token whatever the batch, where index_add_ on CUDA (atomics) has none."""
    num_tokens, k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    groups = group_by_expert(topk_weights, topk_ids, num_experts)
    xs = x.index_select(0, groups.token_of)  # (T * k, H) grouped by expert
    ys = torch.empty_like(xs)
    for e, first, stop in groups.segments:
        ys[first:stop] = expert_forward(e, xs[first:stop])
    ys = (ys * groups.weights[:, None]).to(x.dtype)
    per_choice = torch.empty_like(ys)
    per_choice[groups.order] = ys
    per_choice = per_choice.view(num_tokens, k, -1)  # (T, k, H), choices in ascending expert order
    out = per_choice[:, 0].clone()
    for j in range(1, k):
        out += per_choice[:, j]
    return out


def group_by_expert(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    k = topk_ids.shape[1]
    ids, perm = topk_ids.sort(dim=1)  # (T, k) ascending expert per token
    weights = topk_weights.gather(1, perm).reshape(-1)  # (T * k,)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, as a counting sort: tokens in order within one
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host sync: the GEMM sizes
    segments, first = [], 0
    for e, n in enumerate(counts):
        if n:
            segments.append((e, first, first + n))
            first += n
    return ExpertGroups(order, order // k, weights[order], segments)


class MoEMethod:
    """Base: float experts, one GEMM pair per expert over the tokens routed to it."""

    kind = "float"
    #: False: `apply` reads each expert's token count on the host (a sync), so a CUDA graph
    #: cannot hold it; the runner then decodes eagerly
    graph_capturable = False

    def create_weights(self, layer: FusedMoE) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        layer.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)  # [gate; up] per expert
        layer.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.create_biases(layer)

    @staticmethod
    def create_biases(layer: FusedMoE) -> None:
        """w13_bias (E, 2I), w2_bias (E, H) in the model dtype when the layer has biases (every method)."""
        if layer.has_bias:
            e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
            layer.w13_bias = nn.Parameter(torch.zeros(e, 2 * i), requires_grad=False)
            layer.w2_bias = nn.Parameter(torch.zeros(e, h), requires_grad=False)

    @staticmethod
    def load_bias(layer: FusedMoE, expert: int, shard: str, tensor: torch.Tensor) -> None:
        """One expert's bias of `shard` (this rank's part: `FusedMoE.bias_slice`)."""
        if not layer.has_bias:
            raise ValueError(f"expert {expert} {shard}: a bias, but this layer's experts have none")
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"unknown expert shard {shard!r}; expected one of {EXPERT_SHARDS}")
        i = layer.intermediate_size
        target = {"w1": layer.w13_bias[expert, :i], "w3": layer.w13_bias[expert, i:], "w2": layer.w2_bias[expert]}[shard]
        expect_shape(tuple(tensor.shape), tuple(target.shape), f"expert {expert} bias", shard)
        with torch.no_grad():
            target.copy_(tensor if shard != "w2" or layer.holds_down_bias else torch.zeros_like(tensor))

    def checkpoint_params(self) -> tuple[str, ...]:
        """The tensors each expert projection has in the checkpoint (`...experts.{e}.{leaf}.{param}`);
        a quantized method (layers/moe_quant.py) adds its scales."""
        return ("weight",)

    def checkpoint_slice(
        self, layer: FusedMoE, shard: str, param: str, shape: tuple[int, ...]
    ) -> tuple[slice, ...] | None:
        """The part of checkpoint tensor `param` of `shard` this rank reads (None: all of it)."""
        if param == "bias":
            return layer.bias_slice(shard, shape)
        return layer.checkpoint_slice(shard, shape)

    def load(self, layer: FusedMoE, expert: int, shard: str, tensor: torch.Tensor, param: str = "weight") -> None:
        """One expert's checkpoint tensor (this rank's part of it, `layer.checkpoint_slice`)."""
        if param == "bias":
            return self.load_bias(layer, expert, shard, tensor)
        if param != "weight":
            raise ValueError(f"expert {expert} {shard}: unexpected checkpoint tensor {param!r} for float experts "
                             "(the quantization config ignores them, or declares no quantization)")
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"unknown expert shard {shard!r}; expected one of {EXPERT_SHARDS}")
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} does not exist: the config has num_experts {layer.num_experts}")
        if tensor.dtype not in FLOAT_CHECKPOINT_DTYPES:
            raise ValueError(f"expert {expert} {shard} is {tensor.dtype}; the experts run unquantized, so an 8-bit "
                             "weight would be read without its scale")
        i = layer.intermediate_size
        target = {"w1": layer.w13[expert, :i], "w3": layer.w13[expert, i:], "w2": layer.w2[expert]}[shard]
        expect_shape(tuple(tensor.shape), tuple(target.shape), f"expert {expert}", shard)
        with torch.no_grad():
            target.copy_(tensor)

    def process_after_loading(self, layer: FusedMoE) -> None:
        pass

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # (T, H) -> (T, H), this rank's partial sum under tensor parallelism
        return expert_by_expert(x, topk_weights, topk_ids, layer.num_experts,
                                lambda e, rows: self.expert_forward(layer, e, rows))

    def expert_forward(self, layer: FusedMoE, e: int, rows: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
        if layer.has_bias:
            return layer.act(rows @ layer.w13[e].t() + layer.w13_bias[e]) @ layer.w2[e].t() + layer.w2_bias[e]
        return layer.act(rows @ layer.w13[e].t()) @ layer.w2[e].t()

    def describe(self) -> str:
        return type(self).__name__


class TorchMoEMethod(MoEMethod):
    """Float experts through torch matmuls: CUDA (cuBLAS), CPU without the C kernels, any dtype."""


class PackedCpuMoEMethod(MoEMethod):
    """CPU float32 with the C kernels: each expert's w13 and w2 as the linear kernel's panels
    (kernels/cpu/linear.c), SiLU-and-mul fused into the gate/up GEMM when I fits whole panels.

    A SiLU-gated layer runs all its experts in one C call (kernels/cpu/moe.c: counting sort by
    expert, every expert's grouped GEMMs in one parallel region, each token's k outputs summed
    in ascending expert order); another gate (GELU, ...) loops over the experts in Python,
    calling the linear kernel per expert. gpt-oss's clamped SwiGLU and expert biases run in the
    one call too (unfused: the gate_up-packed panels would interleave the bias). Either way each GEMM row is the linear kernel's
    in-order sum whatever the rows beside it, so with the fixed per-token order a token's result
    does not depend on its batch, as on the dense path. After loading: w13 (E, P13, H, NR),
    w2 (E, P2, I, NR).
    """

    def __init__(self, fuse_silu_and_mul: bool) -> None:
        from stoker.kernels.cpu import linear as cpu_linear
        from stoker.kernels.cpu import moe as cpu_moe

        self.fuse_silu_and_mul = fuse_silu_and_mul
        self.kernel = cpu_linear.linear  # or its twin reference.linear_packed, for tests
        # The one-call kernel, or None for the per-expert loop (a non-SiLU gate; tests that
        # run the loop on the twin). Chosen here and in create_weights, never per call.
        self.fused_moe = cpu_moe.fused_moe

    def create_weights(self, layer: FusedMoE) -> None:
        super().create_weights(layer)
        if self.fuse_silu_and_mul and (layer.has_bias or not layer.is_silu):
            raise ValueError("SiLU-and-mul fuses only into a SiLU-gated gate/up GEMM without biases")
        # moe.c applies SiLU-and-mul or gpt-oss's clamped SwiGLU; another gate takes the loop
        self.activation = "silu" if layer.is_silu else "swigluoai" if isinstance(layer.act, ClampedSwiGLU) else None
        if self.activation is None:
            self.fused_moe = None

    def process_after_loading(self, layer: FusedMoE) -> None:
        from stoker.kernels.cpu import moe as cpu_moe

        w13, w2 = cpu_moe.pack_experts(layer.w13.data, layer.w2.data, self.fuse_silu_and_mul)
        layer.w13 = nn.Parameter(w13, requires_grad=False)
        layer.w2 = nn.Parameter(w2, requires_grad=False)
        if layer.has_bias:  # (E, P13 * NR), (E, P2 * NR): padded to the panels, as the linear kernel reads them
            layer.w13_bias = nn.Parameter(cpu_moe.pack_expert_bias(layer.w13_bias.data), requires_grad=False)
            layer.w2_bias = nn.Parameter(cpu_moe.pack_expert_bias(layer.w2_bias.data), requires_grad=False)

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # (T, H) -> (T, H)
        if self.fused_moe is None:
            return super().apply(layer, x, topk_weights, topk_ids)
        b13, b2 = (layer.w13_bias, layer.w2_bias) if layer.has_bias else (None, None)
        alpha, limit = (layer.act.alpha, layer.act.limit) if self.activation == "swigluoai" else (0.0, 0.0)
        return self.fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.intermediate_size,
                              self.fuse_silu_and_mul, b13, b2, self.activation, alpha, limit)

    def expert_forward(self, layer: FusedMoE, e: int, rows: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
        i = layer.intermediate_size
        b13, b2 = (layer.w13_bias[e], layer.w2_bias[e]) if layer.has_bias else (None, None)
        h = self.kernel(rows, layer.w13[e], 2 * i, b13, self.fuse_silu_and_mul)  # (n, I) or (n, 2I)
        if not self.fuse_silu_and_mul:
            h = layer.act(h)
        return self.kernel(h, layer.w2[e], layer.hidden_size, b2, False)

    def describe(self) -> str:
        # the same before and after create_weights (the chooser counts methods before attaching)
        return f"{type(self).__name__}(fused silu)" if self.fuse_silu_and_mul else type(self).__name__
