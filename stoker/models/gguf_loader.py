"""Load a GGUF file (llama.cpp's format) as Stoker loads a Hugging Face folder.

`read_gguf_config(path)` synthesizes the config.json fields Stoker's models read from the
file's metadata ({arch}.embedding_length, .block_count, .attention.head_count, ...), for the
architectures llama (Llama, and Mistral, which llama.cpp writes as llama; Mixtral: llama with
experts), qwen2, qwen3, qwen2moe and qwen3moe;
`GGUFTensors` gives the file's tensors under HF names, as safetensors' `safe_open` does, so
`models/loader.load_weights` reads it like any checkpoint:

  * float tensors (F32, F16, BF16) as they are;
  * 4-bit blocks (Q4_0, Q4_1, Q4_K) decoded exactly into `int4.AffineInt4` (codes, scale and
    offset per group of 32), and 5-bit affine blocks (Q5_K, Q5_1) into
    `int8_affine_method.AffineInt8`, handed whole to the projection's method
    (`load_affine_weights`, which load_weights calls after the keys): they are not keys, since
    those forms have no safetensors-like tensors;
  * 8-bit symmetric blocks (Q8_0, Q6_K, Q5_0) decoded exactly (quantization/gguf_blocks.py) into
    `weight` (int8) and `weight_scale` (per group), the int8 per-group method's checkpoint
    tensors, the scales of a merged projection's coarser shard repeated to its finer group (or,
    beside an affine shard, handed whole as an AffineInt8 with offsets 0);
  * the shards of a merged projection that mix families (a Q4_K_M file's Q4_K q/k beside a Q6_K
    v) each go to their run of the layer's composite method (layers/composite_method.py);
  * q/k rows of llama-architecture files put back in HF's order (llama.cpp's converter
    interleaves each head's rotary halves, models/gguf_names.py);
  * `rope_freqs.weight` (Llama 3.1's rope scaling) read into the config (models/gguf_rope.py);
  * a MoE layer's stacked experts (blk.N.ffn_*_exps, (E, N, K)) as the per-expert tensors of
    an HF checkpoint (models/gguf_names.expert_names), each expert's slice read on its own:
    float types as they are, symmetric int8 blocks (Q8_0, Q6_K, Q5_0) as `weight` and
    `weight_scale` for the quantized MoE method (layers/moe_quant.py), whose int8 groups of K
    per expert row are the blocks' own, 4-bit blocks (Q4_0, Q4_1, Q4_K) decoded as for a dense
    projection into `weight` (codes, uint8), `weight_scale` and `weight_offset` (per 32 columns)
    for the int4 MoE method (layers/moe_int4.py, layout "gguf"); a layer held per projection (a
    Q4_K_M file's Q4_K gate/up beside a Q6_K down; Q5_K_M's Q5_K) gives every projection's
    `weight` (uint8 4-bit codes, or int8 codes), `weight_scale` and `weight_offset` (0 for a
    symmetric type) at its own group (layers/moe_mixed.py); which layer runs how, and the types
    and mixes refused by name, is quantization/gguf.py's (`expert_scheme`, `expert_projections`);
  * the token embedding dequantized to floats (embedding rows are gathered, not streamed per
    token); when the file ties the output to a quantized token_embd, the LM head gets
    token_embd's blocks as an int8 projection of its own (config tie_word_embeddings false),
    so the logits GEMM reads one byte per weight.
Which tensor types run how, and what is refused, is quantization/gguf.py's; the tokenizer,
engine/tokenizer.py's.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stoker.models import gguf_names
from stoker.models.gguf_rope import llama3_rope_scaling
from stoker.quantization import gguf as gguf_types
from stoker.quantization import gguf_blocks

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# GGUF architecture -> the HF model_type of its MoE family (llama with experts: Mixtral)
_MOE_TYPES = {"llama": ("mixtral", "MixtralForCausalLM"), "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
              "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM")}
# llama.cpp's llama_expert_gating_func_type: the softmax router is the one these families use
_GATING_SOFTMAX = 1


def is_gguf_file(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def _reader(path: str | Path) -> Any:
    """The file's GGUFReader, one per file and version in the process: gguf-py parses every
    metadata array element by element when it opens a file, which for a 150k-token vocabulary
    and its merges takes seconds (tens of seconds on a busy machine); the config, the weights
    and the chat template all read the same one. Tensor data stays memory-mapped."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file {str(p)!r} does not exist")
    stat = p.stat()
    return _open_reader(str(p.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_reader(path: str, mtime_ns: int, size: int) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _type_name(tensor: Any) -> str:
    return tensor.tensor_type.name


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """The HF config.json a GGUF file stands for; refuses an architecture, a tensor type or a
    rope scheme Stoker cannot run, naming it, before any weight is read."""
    reader = _reader(path)
    arch = _meta(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} ({path}) is not supported; supported: {', '.join(ARCHITECTURES)}")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = _meta(reader, f"{arch}.{key}", default)
        if required and value is None:
            raise ValueError(f"GGUF file {path} has no {arch}.{key}, which the model needs")
        if isinstance(value, list):  # per-layer values (some files give head counts per layer)
            if len(set(value)) != 1:
                raise ValueError(f"GGUF {arch}.{key} differs between layers ({value[:4]} ...); Stoker needs one value")
            value = value[0]
        return value

    hidden, heads = int(get("embedding_length", required=True)), int(get("attention.head_count", required=True))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF {arch}.attention.value_length differs from key_length {head_dim}; Stoker needs them equal")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"GGUF {arch}.rope.dimension_count {get('rope.dimension_count')} is a partial rotary "
                         f"dimension (head_dim {head_dim}); Stoker's {arch} model rotates the whole head")
    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = tensors.pop(gguf_names.ROPE_FREQS, None)
    layer_experts: dict[str, list[tuple[str, str]]] = {}
    for name, t in tensors.items():
        if gguf_names.is_experts(name):
            gguf_types.check_type(name, _type_name(t))
            layer_experts.setdefault(name.split(".")[1], []).append((name, _type_name(t)))
        else:
            gguf_names.hf_name(name, arch)  # refuses a tensor the model has no place for
            gguf_types.check_type(name, _type_name(t))
            if _BLOCK_ROUTER in name and _type_name(t) not in gguf_types.FLOAT_TYPES:
                raise ValueError(f"GGUF tensor {name} (a MoE router) is {_type_name(t)}; Stoker's router runs in "
                                 f"float32 and takes {', '.join(gguf_types.FLOAT_TYPES)}")
    for experts in layer_experts.values():  # how each layer is held, or refused naming its tensors
        gguf_types.expert_projections(experts)
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"GGUF file {path} has no token_embd.weight")
    vocab = int(get("vocab_size", None) or int(embd.shape[1]))
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(get("feed_forward_length", required=not any(map(gguf_names.is_experts, tensors)))
                                 or 0),
        "vocab_size": vocab,
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
    }
    if tokens is not None and len(tokens) != vocab:
        logger.info("GGUF %s: %d tokens in the vocabulary, %d embedding rows", path, len(tokens), vocab)
    if (bos := _meta(reader, "tokenizer.ggml.bos_token_id")) is not None:
        cfg["bos_token_id"] = int(bos)
    # End of generation: EOS, and the end-of-turn / end-of-message tokens llama.cpp also stops at
    # (Llama 3's <|eot_id|>, <|eom_id|>), as a generation_config.json lists them
    eog = [int(v) for key in ("eos_token_id", "eot_token_id", "eom_token_id")
           if (v := _meta(reader, f"tokenizer.ggml.{key}")) is not None]
    if eog:
        cfg["eos_token_id"] = list(dict.fromkeys(eog)) if len(set(eog)) > 1 else eog[0]
    if arch == "qwen2":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "qwen2moe":
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    cfg.update(_moe_config(arch, get, tensors, cfg, path))
    cfg.update(_rope_scaling(get, path))
    if rope_freqs is not None:
        if "rope_scaling" in cfg:
            raise ValueError(f"GGUF file {path} has both {arch}.rope.scaling.type and rope_freqs.weight; Stoker takes one")
        if _type_name(rope_freqs) != "F32":
            raise ValueError(f"GGUF tensor rope_freqs.weight is {_type_name(rope_freqs)}; the converter writes F32")
        cfg["rope_scaling"] = llama3_rope_scaling(np.array(rope_freqs.data), cfg["rope_theta"], head_dim,
                                                  get("rope.scaling.original_context_length"))
    # Weight types, per HF module, for quantization/gguf.py
    types: dict[str, list[str]] = {}
    for name, t in tensors.items():
        if gguf_names.is_experts(name):  # one entry per expert: the chooser asks per checkpoint module
            for expert in gguf_names.expert_names(name, arch, int(t.shape[-1])):
                types[expert.rpartition(".")[0]] = [name, _type_name(t)]
        elif len(t.shape) == 2 and name != "token_embd.weight" and _BLOCK_ROUTER not in name:
            types[gguf_names.hf_name(name, arch).rpartition(".")[0]] = [name, _type_name(t)]
    embd_type = _type_name(embd)
    tied = "output.weight" not in tensors
    if tied and embd_type not in gguf_types.FLOAT_TYPES:
        types["lm_head"] = ["token_embd.weight", embd_type]  # its own int8 projection, see the module docstring
        tied = False
    cfg["tie_word_embeddings"] = tied
    if any(kind not in gguf_types.FLOAT_TYPES for _, kind in types.values()):
        cfg["quantization_config"] = {"quant_method": "gguf", "tensors": types}
    cfg["gguf_architecture"] = arch
    return cfg


_BLOCK_ROUTER = f".{gguf_names.ROUTER}."
_SHARED_EXPERT_GATE = ".shared_expert_gate.weight"


def _moe_config(arch: str, get: Any, tensors: dict[str, Any], cfg: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The HF MoE config fields a file with expert tensors stands for (none without): the
    family (Mixtral for llama), the expert count and width read off the tensors (E, I, H), the
    top-k, the dense layers (`mlp_only_layers`: those with no experts), Qwen2-MoE's shared
    expert width, and top-k renormalisation as llama.cpp computes it (qwen3moe and Mixtral
    renormalise, qwen2moe does not)."""
    gates = {int(n.split(".")[1]): t for n, t in tensors.items() if n.endswith(".ffn_gate_exps.weight")}
    if not gates:
        if arch in ("qwen2moe", "qwen3moe"):
            raise ValueError(f"GGUF file {path} is {arch} but has no expert tensors (blk.N.ffn_gate_exps.weight)")
        return {}
    shapes = {tuple(int(d) for d in reversed(t.shape.tolist())) for t in gates.values()}  # (E, I, H)
    if len(shapes) != 1:
        raise ValueError(f"GGUF file {path}: the experts differ in shape between layers ({sorted(shapes)}); "
                         "Stoker needs one")
    num_experts, inter, _ = shapes.pop()
    if int(get("expert_count", num_experts)) != num_experts:
        raise ValueError(f"GGUF {arch}.expert_count {get('expert_count')} differs from the {num_experts} experts "
                         f"the tensors hold ({path})")
    if (gating := get("expert_gating_func")) not in (None, _GATING_SOFTMAX):
        raise ValueError(f"GGUF {arch}.expert_gating_func {gating} is not softmax; Stoker's {arch} router is")
    if get("expert_weights_scale") not in (None, 0.0, 1.0):
        raise ValueError(f"GGUF {arch}.expert_weights_scale {get('expert_weights_scale')} is not supported")
    model_type, architecture = _MOE_TYPES[arch]
    dense = [i for i in range(cfg["num_hidden_layers"]) if i not in gates]
    out: dict[str, Any] = {"architectures": [architecture], "model_type": model_type,
                           "num_experts_per_tok": int(get("expert_used_count", required=True))}
    if arch == "llama":
        if dense:
            raise ValueError(f"GGUF file {path}: layers {dense[:4]} have no experts; a Mixtral model has them in every layer")
        return {**out, "num_local_experts": num_experts, "intermediate_size": inter}
    out.update(num_experts=num_experts, moe_intermediate_size=inter, decoder_sparse_step=1, mlp_only_layers=dense,
               norm_topk_prob=arch == "qwen3moe")
    if dense and not cfg["intermediate_size"]:
        raise ValueError(f"GGUF file {path} has dense layers {dense[:4]} but no {arch}.feed_forward_length")
    if arch == "qwen2moe":
        shared = next((t for n, t in tensors.items() if n.endswith(".ffn_gate_shexp.weight")), None)
        out["shared_expert_intermediate_size"] = 0 if shared is None else int(shared.shape[-1])
    return out


def _rope_scaling(get: Any, path: str | Path) -> dict[str, Any]:
    kind = get("rope.scaling.type", "none")
    if kind in (None, "none"):
        return {}
    factor = get("rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    if kind == "yarn" and factor:
        orig = get("rope.scaling.original_context_length")
        return {"rope_scaling": {"rope_type": "yarn", "factor": float(factor),
                                 **({"original_max_position_embeddings": int(orig)} if orig else {})}}
    raise ValueError(f"GGUF rope scaling {kind!r} (factor {factor}) in {path} is not supported; linear and yarn are")


def chat_template(path: str | Path) -> str | None:
    """The file's `tokenizer.chat_template`, if it has one."""
    return _meta(_reader(path), "tokenizer.chat_template")


class _Slice:
    """safetensors' get_slice: the shape without the data, and a part of it."""

    def __init__(self, owner: GGUFTensors, name: str) -> None:
        self.owner, self.name = owner, name

    def get_shape(self) -> list[int]:
        return list(self.owner.shape(self.name))

    def __getitem__(self, part: Any) -> torch.Tensor:
        return self.owner.get_tensor(self.name)[part]


class GGUFTensors:
    """A GGUF file's tensors under HF names, through safetensors' `safe_open` interface
    (keys, get_tensor, get_slice), decoded for the methods `model` was built with."""

    def __init__(self, path: str | Path, model: torch.nn.Module) -> None:
        self.path = str(path)
        self.reader = _reader(path)
        config = model.config
        self.arch = config.get("gguf_architecture") or _meta(self.reader, "general.architecture")
        self.heads, self.kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        qc = config.get("quantization_config") or {}
        self.types: dict[str, list[str]] = qc.get("tensors", {})
        self.schemes = self._schemes(model)
        # HF name -> (GGUF tensor, what to give: "float" | "q" | "scale" | "offset" | "dequant")
        self.entries: dict[str, tuple[Any, str]] = {}
        # HF name of one expert's slice of a stacked experts tensor -> that expert's index
        self.expert_of: dict[str, int] = {}
        # HF module -> its GGUF tensor decoded whole and handed to the method (load_affine_weights):
        # 4-bit types, and every int8 tensor of a projection whose method holds offsets (Q5_K, Q5_1)
        self.affine: dict[str, Any] = {}
        for t in self.reader.tensors:
            if t.name == gguf_names.ROPE_FREQS:  # read into the config's rope_scaling (read_gguf_config)
                continue
            if gguf_names.is_experts(t.name):
                self._add_experts(t)
                continue
            hf = gguf_names.hf_name(t.name, self.arch)
            module = hf.rpartition(".")[0]
            if t.name == "token_embd.weight":
                self.entries[hf] = (t, "float" if _type_name(t) in gguf_types.FLOAT_TYPES else "dequant")
                if "lm_head" in self.types and self.types["lm_head"][0] == t.name:
                    module, hf = "lm_head", "lm_head.weight"
                else:
                    continue
            scheme = self.schemes.get(module)
            if _type_name(t) in gguf_types.FLOAT_TYPES:
                self.entries[hf] = (t, "float")
            elif scheme is None:
                raise ValueError(f"GGUF tensor {t.name} ({_type_name(t)}) matches no projection of the model")
            elif scheme.dtype == "int4" or not scheme.symmetric:
                self.affine[module] = t  # not a key: handed whole to the method (load_affine_weights)
            else:
                self.entries[hf], self.entries[f"{module}.weight_scale"] = (t, "q"), (t, "scale")
        self._decoded: dict[str, tuple[dict[str, torch.Tensor], set[str]]] = {}

    def _add_experts(self, t: Any) -> None:
        """Each expert's slice of a stacked experts tensor under its per-expert HF name: float,
        or `weight` and `weight_scale` (int8 blocks, the quantized MoE method) and `weight_offset`
        (4-bit blocks, the int4 MoE method), all decoded from one read of the expert's blocks."""
        for expert, hf in enumerate(gguf_names.expert_names(t.name, self.arch, int(t.shape[-1]))):
            module = hf.rpartition(".")[0]
            if _type_name(t) in gguf_types.FLOAT_TYPES:
                self.entries[hf] = (t, "float")
            elif module not in self.schemes:
                raise ValueError(f"GGUF tensor {t.name} ({_type_name(t)}) matches no MoE layer of the model")
            else:
                self.entries[hf], self.entries[f"{module}.weight_scale"] = (t, "q"), (t, "scale")
                self.expert_of[f"{module}.weight_scale"] = expert
                scheme = self.schemes[module]
                if scheme.dtype == "int4" or not scheme.symmetric:  # the int4 and the per-projection methods
                    self.entries[f"{module}.weight_offset"] = (t, "offset")
                    self.expert_of[f"{module}.weight_offset"] = expert
            self.expert_of[hf] = expert

    def _schemes(self, model: torch.nn.Module) -> dict[str, Any]:
        """HF module -> the WeightScheme its weight is held in: its own type's, or for a shard
        of a merged projection its run's (quantization/gguf.py shard_runs: the finest group of
        its same-family siblings, affine when one of them is)."""
        from stoker.layers.linear import Linear
        from stoker.layers.moe import FusedMoE
        from stoker.models.packed import checkpoint_module_name

        if not self.types:
            return {}
        config = gguf_types.gguf_quant_config({"tensors": self.types})
        schemes: dict[str, Any] = {}
        leaves = list(getattr(model, "expert_params", {}))
        for name, layer in model.named_modules():
            if isinstance(layer, FusedMoE):  # its experts as the chooser holds them: one scheme, or one per projection
                names = [f"{name}.{e}.{leaf}" for e in range(layer.global_num_experts) for leaf in leaves]
                if all(n in self.types for n in names) and not config.is_ignored(names[0]):
                    pair = config.expert_projections(names)
                    if pair is None:
                        schemes.update(dict.fromkeys(names, config.weights_for(names)))
                    else:  # (gate/up, down): layers/moe_mixed.py
                        schemes.update({n: pair[".ffn_down_exps." in self.types[n][0]] for n in names})
                continue
            if not isinstance(layer, Linear):
                continue
            names = [checkpoint_module_name(model, name, shard) for shard in layer.shard_offsets] or [name]
            if not all(n in self.types for n in names):
                continue
            for idx, scheme in config.shard_runs(names):
                schemes.update({names[i]: scheme for i in idx})
        return schemes

    # -- safe_open's interface
    def __enter__(self) -> GGUFTensors:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._decoded.clear()

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self, name)

    def shape(self, name: str) -> tuple[int, ...]:
        t, what = self.entries[name]
        dims = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne0 (K) first
        if name in self.expert_of:  # one expert's slice: (N, K) of (E, N, K)
            dims = dims[1:]
        if len(dims) == 1 and name.endswith(_SHARED_EXPERT_GATE):
            dims = (1, dims[0])
        if what in ("scale", "offset"):
            return dims[0], dims[1] // self.schemes[name.rpartition(".")[0]].group_size
        return dims

    def get_tensor(self, name: str) -> torch.Tensor:
        t, what = self.entries[name]
        module = name.rpartition(".")[0]
        expert = self.expert_of.get(name)
        if what == "float":
            out = self._float(t, expert)
            if out.dim() == 1 and name.endswith(_SHARED_EXPERT_GATE):  # a (H,) gate: HF's Linear(H, 1)
                out = out.reshape(1, -1)
        elif what == "dequant":
            out = gguf_blocks.dequantize(self._raw(t), _type_name(t))
        else:  # weight, scale (and offset) come from one decode, kept until each has been read
            if module not in self._decoded:
                self._decoded[module] = (self._decode(t, self.schemes[module], expert), set())
            parts, taken = self._decoded[module]
            out = parts[what]
            taken.add(what)
            if len(taken) == len(parts):
                del self._decoded[module]
        heads = gguf_names.permuted_heads(t.name, self.heads, self.kv_heads) if self.arch == "llama" else None
        return out if heads is None else gguf_names.unpermute_rows(out, heads)

    # -- tensors decoded whole (4-bit; int8 with offsets) and handed to the method
    def load_affine_weights(self, linears: dict[str, Any], packed: dict[str, tuple[str, str]]) -> list[str]:
        """Decode each tensor of `self.affine` (quantization/gguf_blocks.py) into its method's
        form, an `int4.AffineInt4` (q (N, K) uint8, scale and offset (N, K / 32) float32) or an
        `int8_affine_method.AffineInt8` (q int8, symmetric types with offset 0), and hand it to
        its projection's method (`load_affine`, which takes this rank's rows and columns);
        returns the loaded keys as models/loader.load_weights counts them."""
        loaded = []
        for module, t in self.affine.items():
            parent, _, leaf = module.rpartition(".")
            shard = None
            if leaf in packed:  # a shard of a merged projection (q/k/v, gate/up)
                merged, shard = packed[leaf]
                module = f"{parent}.{merged}" if parent else merged
            layer = linears.get(module)
            if layer is None:
                raise ValueError(f"GGUF tensor {t.name} ({_type_name(t)}) matches no projection of the model")
            weight = self._affine(t)
            method = getattr(layer.method, "base", layer.method)
            try:
                if not hasattr(method, "load_affine"):
                    raise ValueError(f"this projection runs {method.describe()}, which does not take a decoded weight")
                method.load_affine(layer, shard, weight)
            except ValueError as exc:
                raise ValueError(f"{exc} (GGUF tensor {t.name})") from None
            loaded.append(f"{module}.weight#{shard}")
        return loaded

    def _affine(self, t: Any) -> Any:
        from stoker.layers.int8_affine_method import AffineInt8
        from stoker.quantization import int4

        kind = _type_name(t)
        if kind in gguf_blocks.SYMMETRIC:  # an int8 shard beside an affine one: offset 0
            q, scale = gguf_blocks.SYMMETRIC[kind](self._raw(t))
            offset = torch.zeros_like(scale)
        else:
            q, scale, offset = gguf_blocks.AFFINE[kind](self._raw(t))
        heads = gguf_names.permuted_heads(t.name, self.heads, self.kv_heads) if self.arch == "llama" else None
        if heads is not None:  # every row's codes, scales and offsets move together
            q, scale, offset = (gguf_names.unpermute_rows(x, heads) for x in (q, scale, offset))
        q, scale, offset = q.contiguous(), scale.contiguous(), offset.contiguous()
        if kind in gguf_types.INT4_GROUPS:
            return int4.AffineInt4(q, scale, offset, gguf_types.INT4_GROUPS[kind])
        return AffineInt8(q.to(torch.int8), scale, offset, gguf_blocks.GROUP_K[kind])

    # -- decoding
    def _raw(self, t: Any, expert: int | None = None) -> torch.Tensor:
        # (N, bytes per row) uint8 (of one expert of an (E, N, bytes) tensor), copied out of the read-only map
        return torch.from_numpy(np.array(t.data if expert is None else t.data[expert]))

    def _float(self, t: Any, expert: int | None = None) -> torch.Tensor:
        data = torch.from_numpy(np.array(t.data if expert is None else t.data[expert]))  # copied out of the map
        if _type_name(t) == "BF16":  # GGUFReader gives BF16 rows as raw bytes: (N, 2 K) uint8
            dims = tuple(int(d) for d in reversed(t.shape.tolist()))
            return data.view(torch.bfloat16).reshape(dims if expert is None else dims[1:])
        return data

    def _decode(self, t: Any, scheme: Any, expert: int | None = None) -> dict[str, torch.Tensor]:
        """{"q", "scale"} of symmetric int8 blocks, {"q", "scale", "offset"} of 4-bit ones
        (MoE experts: int4 codes uint8 in [0, 15], groups of 32) and of any block type held
        with offsets (`scheme` int8 with symmetric False: MoE experts held per projection,
        layers/moe_mixed.py; int8 codes, a symmetric type's offsets 0); a coarser type's scales
        (and offsets) repeated to the scheme's finer group, exact."""
        kind = _type_name(t)
        group = scheme.group_size
        if kind in gguf_types.INT4_GROUPS:
            q, scale, offset = gguf_blocks.AFFINE[kind](self._raw(t, expert))
            assert group == gguf_blocks.GROUP_K[kind]
            return {"q": q, "scale": scale, "offset": offset}
        if kind in gguf_blocks.SYMMETRIC:
            q, scale = gguf_blocks.SYMMETRIC[kind](self._raw(t, expert))
            parts = {"q": q, "scale": scale}
            if not scheme.symmetric:
                parts["offset"] = torch.zeros_like(scale)
        else:  # Q5_K, Q5_1: codes in [0, 31]
            q, scale, offset = gguf_blocks.AFFINE[kind](self._raw(t, expert))
            parts = {"q": q.to(torch.int8), "scale": scale, "offset": offset}
        own = gguf_blocks.GROUP_K[kind]
        if group != own:  # a coarser shard of a merged projection: each scale (and offset) repeated, exact
            for p in ("scale", "offset"):
                if p in parts:
                    parts[p] = parts[p].repeat_interleave(own // group, dim=1)
        return parts
