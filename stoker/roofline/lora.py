"""What multi-LoRA adds to a step: the adapters' weights read and their FLOPs per token (issue 17).

A rank-r LoRA adapter on a projection W (in -> out) adds y += B (A x), with A: (r, in) and
B: (out, r) (Hu et al. 2021, arXiv:2106.09685): r x (in + out) weights, and for each token
2 x r x (in + out) FLOPs (shrink, then expand). On the projections it targets (PEFT's names;
by default all seven of a Llama-family layer: q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj), one adapter holds

    params = layers x sum over targets of r x (in + out)

and a token on an adapter does 2 x params FLOPs. A step serving tokens of `n` distinct adapters
reads each adapter's weights once (Punica's SGMV / vLLM's and Stoker's segment kernels group a
step's tokens by adapter): n x params x element bytes. Adapters are kept in the activation dtype
(vLLM's lora_dtype "auto"; Stoker's slots), also under FP8/INT8 base weights. Beside the weights
the updates move activations, counted as the cost model counts a GEMM's (inputs + outputs): per
merged projection (qkv, gate_up, o, down) the shrink reads x and writes r values per target, the
expand reads them back and adds into the output; in a long prefill this, not the weights, is the
adapters' cost. costmodel.step_cost(..., lora=LoRASpec(...)) adds all of it as one op, `lora`.

Tensor parallelism cuts an adapter as the base weight is cut (vLLM's *WithLoRA layers; Stoker's
runner/lora.py): a column-parallel projection (q, k, v, gate, up: output rows split) keeps
A whole and splits B's rows, r x (in + out / tp) per rank; a row-parallel one (o, down: input
columns split) splits A's columns and keeps B whole, r x (in / tp + out) per rank. FLOPs per
rank follow the same shapes (the whole-A shrink of a column-parallel target runs on every rank).

    p = adapter_params(spec, rank=16)                         # one adapter, whole model
    cost = LoRACost.of(spec, LoRASpec(rank=16, max_loras=4), tp=2, seqs=8)   # one step, per rank

Not modelled: the kernels' launches (two per target per layer), padding to a maximum rank, and
adapters swapped in from host memory. Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.roofline.modelspec import ModelSpec, dtype_bytes

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Row-parallel under Megatron TP (input split, the all-reduce after); every other target is column-parallel.
ROW_PARALLEL = ("o_proj", "down_proj")
# The cost model's op each target's update is added to (its tokens and sharding are that op's).
TARGET_OP = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
             "gate_proj": "mlp_gate_up", "up_proj": "mlp_gate_up", "down_proj": "mlp_down"}


@dataclass(frozen=True)
class LoRASpec:
    """Adapters served beside the base: their rank, how many a step may hold, what they target."""

    rank: int
    max_loras: int = 1
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1 or self.max_loras < 1:
            raise ValueError("LoRA rank and max_loras must be >= 1")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"unknown LoRA target(s) {', '.join(unknown) or '(none given)'}; "
                             f"choose from {', '.join(LORA_TARGETS)}")

    def adapters_in_step(self, seqs: int) -> int:
        """Distinct adapters a step of `seqs` sequences holds at most: each sequence has one."""
        return max(1, min(self.max_loras, seqs))


def projection_dims(m: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) of each LoRA target projection of one layer."""
    if m.is_moe:
        raise ValueError(f"{m.name}: LoRA on MoE experts is not modelled (dense models only)")
    h, i = m.hidden_size, m.intermediate_size
    return {"q_proj": (h, m.q_dim), "k_proj": (h, m.kv_dim), "v_proj": (h, m.kv_dim), "o_proj": (m.q_dim, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def target_params(m: ModelSpec, rank: int, target: str, tp: int = 1) -> float:
    """One adapter's weights on `target` over all layers, on one of `tp` ranks (module docstring)."""
    d_in, d_out = projection_dims(m)[target]
    if target in ROW_PARALLEL:
        return m.num_layers * rank * (d_in / tp + d_out)
    return m.num_layers * rank * (d_in + d_out / tp)


def adapter_params(m: ModelSpec, rank: int, targets: tuple[str, ...] = LORA_TARGETS, tp: int = 1) -> float:
    """Weights of one rank-`rank` adapter on `targets`, all layers; per GPU when tp > 1."""
    return sum(target_params(m, rank, t, tp) for t in targets)


def _op_act_elems(m: ModelSpec, rank: int, targets: tuple[str, ...], op: str, tp: int) -> float:
    """Activation elements per token one merged op's update moves on one GPU, all layers: the
    shrink reads x once and writes the stacked rank-r rows, the expand reads them back and adds
    into the output (the base GEMM's convention: inputs + outputs, as Stoker's merged slots run)."""
    mine = [t for t in targets if TARGET_OP[t] == op]
    if not mine:
        return 0.0
    dims = projection_dims(m)
    d_in = dims[mine[0]][0] / (tp if mine[0] in ROW_PARALLEL else 1)
    d_out = sum(dims[t][1] / (1 if t in ROW_PARALLEL else tp) for t in mine)
    return m.num_layers * (d_in + d_out + 2 * rank * len(mine))


@dataclass(frozen=True)
class LoRACost:
    """The adapters' share of one step on one GPU of the TP group."""

    rank: int
    adapters: int  # distinct adapters the step holds
    tokens: int
    params_per_adapter: float  # per GPU
    bytes_per_param: float  # the activation dtype's
    act_elems_per_token: float  # activations the updates move per token, per GPU

    @classmethod
    def of(cls, m: ModelSpec, lora: LoRASpec, *, tp: int = 1, seqs: int, tokens: int | None = None,
           act_dtype: str = "bf16") -> LoRACost:
        """`seqs` sequences (one adapter each, at most max_loras distinct) computing `tokens`
        tokens (default: one each, a decode step)."""
        ops = dict.fromkeys(TARGET_OP[t] for t in lora.targets)
        return cls(lora.rank, lora.adapters_in_step(seqs), seqs if tokens is None else tokens,
                   adapter_params(m, lora.rank, lora.targets, tp), dtype_bytes(act_dtype),
                   sum(_op_act_elems(m, lora.rank, lora.targets, op, tp) for op in ops))

    @property
    def bytes_per_adapter(self) -> float:
        return self.params_per_adapter * self.bytes_per_param

    @property
    def weight_bytes(self) -> float:
        """Adapter weights the step reads: each adapter present, once."""
        return self.adapters * self.bytes_per_adapter

    @property
    def act_bytes(self) -> float:
        return self.tokens * self.act_elems_per_token * self.bytes_per_param

    @property
    def bytes(self) -> float:
        """HBM traffic of the step's LoRA updates: adapter weights + activations."""
        return self.weight_bytes + self.act_bytes

    @property
    def flops_per_token(self) -> float:
        """2 x one adapter's params: every token runs its own adapter's shrink and expand."""
        return 2.0 * self.params_per_adapter

    @property
    def flops(self) -> float:
        return self.tokens * self.flops_per_token

    def as_dict(self) -> dict[str, float]:
        return {"rank": self.rank, "adapters_in_step": self.adapters, "params_per_adapter": self.params_per_adapter,
                "bytes_per_adapter": self.bytes_per_adapter, "weight_bytes_per_step": self.weight_bytes,
                "bytes_per_step": self.bytes, "flops_per_token": self.flops_per_token, "flops_per_step": self.flops}
