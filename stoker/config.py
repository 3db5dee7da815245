"""Frozen, layered engine configuration. [no torch]

Validation lives in `__post_init__`; derived values are properties; copies are made with
`dataclasses.replace`. Measured values (the number of KV blocks) are returned by the
runner's memory profiler and never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stoker.kv_transfer.config import KVTransferConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# --quantization (vLLM's flag): weights quantized at load; pre-quantized checkpoints say so themselves.
QUANTIZATION_METHODS = ("fp8", "int8", "int4")
# --kv-cache-dtype: "auto" keeps the model dtype; "fp8" is E4M3 (vLLM's "fp8" and "fp8_e4m3").
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# --activation-dtype: what int4 projections multiply their weights by. "auto" keeps the model
# dtype (W4A16); "int8" quantizes the activations per block of 32 (llama.cpp's Q8_0: W4A8), and
# a GGUF file's Q6_K tensors run W6A8 on their own 6-bit codes (layers/quantized_method.py).
ACTIVATION_DTYPES = ("auto", "int8")
_DEVICES = ("auto", "cpu", "cuda")
# A sensible CPU default: 1 GiB of KV. A float32 model with hidden 512 and 8 layers
# stores 32 KiB per token, so this holds ~32k tokens.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    seed: int = 0
    trust_remote_code: bool = False
    quantization: str | None = None  # None: float weights, or whatever the checkpoint is quantized as
    activation_dtype: str = "auto"  # ACTIVATION_DTYPES: "int8" runs int4 projections as W4A8

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"activation_dtype {self.activation_dtype!r} is not supported; choose one of "
                             f"{', '.join(ACTIVATION_DTYPES)} (int8: int4 weights times int8 activations, W4A8)")
        _positive("max_model_len", self.max_model_len)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; choose one of {', '.join(QUANTIZATION_METHODS)} "
                "(or none: a pre-quantized checkpoint is detected from its config.json)"
            )


def _check_kv_offloading(cache: CacheConfig) -> None:
    if cache.kv_offloading_backend != "native":
        raise ValueError(f"kv_offloading_backend {cache.kv_offloading_backend!r} is not supported; the only backend "
                         "is 'native' (Stoker's own host tier; LMCache is not built in)")
    size = cache.kv_offloading_size
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise ValueError(f"kv_offloading_size is GiB of host memory and must be positive, got {size!r}")
    if not cache.enable_prefix_caching:
        raise ValueError("kv_offloading_size needs prefix caching: the host tier keeps blocks under the prefix "
                         "cache's hash (drop --no-enable-prefix-caching)")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None  # tests: force a tiny cache
    kv_cache_dtype: str = "auto"
    # vLLM's host KV tier: GiB of host memory for blocks evicted from the device cache, summed over
    # the tensor-parallel ranks (None: off); "native" is the only backend (docs/kv_offloading.md)
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"

    def __post_init__(self) -> None:
        _check_kv_offloading(self)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            hint = " (E5M2 caches are not supported; fp8 means E4M3)" if self.kv_cache_dtype == "fp8_e5m2" else ""
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported{hint}; choose one of {', '.join(KV_CACHE_DTYPES)}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size!r}")
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token of KV cache is, as the model describes it (`model.kv_cache_spec()`):
    K and V of every attention layer. dtype: "float32", "bfloat16", "float16" or "fp8_e4m3".
    `kv_tensors` 1: a single cache per layer (multi-head latent attention: one latent of
    head_dim = kv_lora_rank + qk_rope_head_dim, num_kv_heads 1, no V)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_tensors: int = 2

    @property
    def bytes_per_token(self) -> int:
        """The roofline's formula (roofline/modelspec.py), so engine and planner agree."""
        from stoker.roofline.modelspec import kv_bytes_per_token

        return int(kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.kv_tensors))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: derived from max_model_len
    enable_chunked_prefill: bool = True
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (a request's priority
    # first, lower first, then arrival: admission order and which sequence is preempted)
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {self.policy!r}")

    def token_budget(self, max_model_len: int) -> int:
        """Tokens one step may process. With chunked prefill the default is vLLM's 2048-ish
        budget (long prompts are split); without it a whole max-length prompt must fit."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return max(2048, self.max_num_seqs)
        return max(max_model_len, self.max_num_seqs)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism over torch.distributed (vLLM's flag names). Ranks are laid out node by
    node: node k holds ranks [k * ranks_per_node, (k + 1) * ranks_per_node). The rendezvous is
    env://: master_addr / master_port (MASTER_ADDR / MASTER_PORT when torchrun or Kubernetes
    set them); master_port None on one node: a free port is picked."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # A collective (or a worker's wait for the next step) longer than this marks the engine dead.
    distributed_timeout_s: float = 600.0
    # vLLM's --enable-expert-parallel: MoE layers hold whole experts, dealt out over the
    # tensor-parallel ranks (EP = TP; attention stays tensor-parallel). Refused on a dense model.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("nnodes", self.nnodes)
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of nnodes {self.nnodes} "
                             "(every node runs the same number of ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks that run on this node."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's flags): `max_loras` adapters live in the compute buffers at
    once (a step never mixes more), each of rank <= `max_lora_rank`; the rest wait in host memory."""

    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        _positive("max_loras", self.max_loras)
        if self.max_lora_rank not in (1, 8, 16, 32, 64, 128, 256, 320, 512):
            # vLLM's accepted ranks; an adapter of rank 4 fits a buffer of rank 8 (zero-padded)
            raise ValueError(f"max_lora_rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512, got {self.max_lora_rank}")


# vLLM's --speculative-config methods: those built, and those vLLM has that are not built here
# yet (refused by name, not mistaken for a typo).
SPECULATIVE_METHODS = ("ngram", "suffix")
# Methods whose drafts a model makes in the runner right after sampling (spec_decode/drafter.py),
# with `model` (a checkpoint folder) and its own KV cache under the target's block tables.
RUNNER_DRAFT_METHODS = ("draft_model", "eagle3")
SPECULATIVE_METHODS += RUNNER_DRAFT_METHODS
_SPECULATIVE_METHODS_NOT_BUILT = ("eagle", "medusa", "mlp_speculator", "mtp")
# The keys each method reads besides method, num_speculative_tokens and dynamic (vLLM's names)
_SPECULATIVE_KEYS = {
    "ngram": ("prompt_lookup_max", "prompt_lookup_min"),
    "suffix": ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"),
    "draft_model": ("model", "draft_tensor_parallel_size"),
    "eagle3": ("model", "draft_tensor_parallel_size"),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config` JSON and `speculative_config=` keys).

    method "ngram" (prompt lookup): the longest suffix n-gram of the sequence (n from
    `prompt_lookup_max` down to `prompt_lookup_min`) that occurred earlier in its prompt or
    output proposes the `num_speculative_tokens` tokens that followed it; one forward verifies
    them, and the rejection sampler keeps the output distribution unchanged (greedy: exactly)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # draft_model / eagle3: the draft checkpoint folder, and vLLM's draft TP (None: the target's;
    # 1: the whole draft on every rank)
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    # method "suffix" (SuffixDecoding, core/suffix_proposer.py), vLLM's keys and defaults: the trees'
    # depth (match + draft), finished outputs kept in the shared tree (0: none, FIFO eviction), the
    # longest draft as a multiple of the match, the estimated probability below which a draft stops
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # k chosen per step by the cost model (core/spec_k_policy.py); False: always num_speculative_tokens
    dynamic: bool = True

    def __post_init__(self) -> None:
        if self.method in _SPECULATIVE_METHODS_NOT_BUILT:
            raise ValueError(f"speculative_config method {self.method!r} is not supported yet; "
                             f"supported: {', '.join(SPECULATIVE_METHODS)}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is unknown; supported: {', '.join(SPECULATIVE_METHODS)}")
        self._check_draft_model()
        self._check_suffix_keys()
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        """From vLLM's JSON keys; a key this engine does not read is refused by name (a setting
        silently ignored would change nothing while the user believes it did)."""
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a JSON object (dict), got {type(values).__name__}")
        if "method" not in values:
            raise ValueError('speculative_config needs a "method" (supported: ' + ", ".join(SPECULATIVE_METHODS) + ")")
        known = {"method", "num_speculative_tokens", "dynamic", *_SPECULATIVE_KEYS.get(values["method"], ())}
        unknown = sorted(set(values) - known)
        if unknown:
            if values["method"] not in SPECULATIVE_METHODS:
                cls(method=values["method"])  # an unbuilt method is named before its keys are
            raise ValueError(f"speculative_config keys {', '.join(unknown)} are not supported for method "
                             f"{values['method']!r}; supported keys: {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in values and values["method"] == "suffix":
            # vLLM's default for suffix: as deep as the tree (the draft length is chosen per step)
            values = {**values, "num_speculative_tokens": values.get("suffix_decoding_max_tree_depth", 24)}
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs num_speculative_tokens (the tokens proposed per step)")
        return cls(**values)

    @property
    def drafts_in_runner(self) -> bool:
        """A draft model or head proposes in the runner (not the engine's n-gram lookup)."""
        return self.method in RUNNER_DRAFT_METHODS

    def _check_draft_model(self) -> None:
        if self.method not in RUNNER_DRAFT_METHODS:
            if self.model is not None:
                raise ValueError(f"speculative_config model is for methods {', '.join(RUNNER_DRAFT_METHODS)}; "
                                 f"method {self.method!r} drafts without a model")
            return
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f'speculative_config method {self.method!r} needs "model": the draft checkpoint folder')
        tp = self.draft_tensor_parallel_size
        if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
            raise ValueError(f"speculative_config draft_tensor_parallel_size must be a positive integer, got {tp!r}")

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """vLLM's rule: the draft runs at TP 1 (whole on every rank here) or at the target's TP
        (sharded over the target's ranks, the default); spec_decode/factory.py."""
        tp = self.draft_tensor_parallel_size
        if tp is not None and tp not in (1, tensor_parallel_size):
            raise ValueError(f"speculative_config draft_tensor_parallel_size must be 1 or the target's "
                             f"tensor_parallel_size ({tensor_parallel_size}), got {tp}")

    def _check_suffix_keys(self) -> None:
        """vLLM's ranges for the suffix keys, and `dynamic` a boolean."""
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"speculative_config dynamic must be true or false, got {self.dynamic!r}")
        for name, low in (("suffix_decoding_max_tree_depth", 1), ("suffix_decoding_max_cached_requests", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"speculative_config {name} must be an integer >= {low}, got {value!r}")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 0:
            raise ValueError(f"speculative_config suffix_decoding_max_spec_factor must be a number >= 0, got {factor!r}")
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config suffix_decoding_min_token_prob must be in [0, 1], got {prob!r}")


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "auto"
    enforce_eager: bool = False
    lora_config: LoRAConfig | None = None  # None: LoRA off (--enable-lora turns it on)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    kv_transfer_config: KVTransferConfig | None = None  # None: no KV connector (stoker/kv_transfer/)

    def __post_init__(self) -> None:
        if self.device not in _DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {_DEVICES} (or cuda:N), got {self.device!r}")
        if self.speculative_config is not None:
            self.speculative_config.check_tensor_parallel(self.parallel_config.tensor_parallel_size)
            if self.kv_transfer_config is not None and self.speculative_config.drafts_in_runner:
                # The draft model's own cache is not transferred: the decode side would draft from nothing.
                raise ValueError(f"speculative_config method {self.speculative_config.method!r} cannot run with "
                                 f"kv_transfer_config (the draft's KV cache is not transferred); use method 'ngram'")
