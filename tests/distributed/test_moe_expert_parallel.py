"""Expert parallelism (--enable-expert-parallel) on CPU over gloo: each of two ranks holds half
of every MoE layer's experts, whole, and reads only those from the checkpoint; EP=2 gives EP=1's
tokens, and its log-probabilities within the tensor-parallel tests' tolerance (attention is
still cut over the ranks, so the sums are not the same bits). A rank no token is routed to still
joins the all-reduce; a rank that stops answering fails the engine, loudly, at the timeout."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stoker import LLM, SamplingParams
from stoker.executor.contract import WorkerFailedError
from tests.distributed.test_tensor_parallel import KV, PROMPTS, engine

SCORED = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
# tokens each sparse layer routes for PROMPTS: every prompt token, then 11 of the 12 sampled
# (the last is never fed back); each counts once per chosen expert
FED_TOKENS = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (SCORED.max_tokens - 1)

QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16, norm_topk_prob=True,
                 num_hidden_layers=3, mlp_only_layers=[1])
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)


def scored(llm: LLM) -> tuple[list[list[int]], list[float]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SCORED, use_tqdm=False)
    llm.engine.check_integrity()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [lp[t].logprob for o in outs for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    return tokens, logprobs


def experts_of(llm: LLM) -> list:
    return [m for m in llm.engine.executor.driver_runner.model.modules() if type(m).__name__ == "FusedMoE"]


@pytest.mark.parametrize(
    "arch, overrides, sparse_layers",
    [("qwen3_moe", QWEN3_MOE, [0, 2]), ("mixtral", MIXTRAL, [0, 1]),
     # the shared expert stays tensor-parallel beside the expert-parallel experts
     ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                        shared_expert_intermediate_size=40), [0, 1]),
     # whole experts with their biases and the clamped SwiGLU; attention (and its sinks) still cut
     ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                      sliding_window=24, swiglu_limit=1.0), [0, 1])],
    ids=["qwen3_moe", "mixtral", "qwen2_moe-shared", "gpt_oss"],
)
def test_ep2_equals_ep1(tiny_checkpoints, arch: str, overrides: dict, sparse_layers: list[int]) -> None:
    path = tiny_checkpoints(arch, **overrides)
    with engine(path) as llm:
        want_tokens, want_logprobs = scored(llm)
        want_load = llm.engine.expert_load()
    with engine(path, tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        tokens, logprobs = scored(llm)
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
        moes = experts_of(llm)  # rank 0 holds experts 0 and 1 of each layer, whole
        assert moes and all((m.num_experts, m.global_num_experts, m.expert_split.start) == (2, 4, 0) for m in moes)
        assert all(m.intermediate_size == m.checkpoint_intermediate_size for m in moes)
        assert all(m.w13.shape[0] == 2 for m in moes)
        # the collectives of tensor parallelism, no more: per step one after the embedding, one after
        # each o_proj, one per feed-forward block (the experts' combine), one per shared expert
        monitor = llm.engine.executor.collectives
        per_layer = 2 + ("shared_expert_intermediate_size" in overrides)
        assert monitor.steps > 0 and monitor.calls == monitor.steps * (1 + overrides.get("num_hidden_layers", 2) * per_layer)
        load = llm.engine.expert_load()
    # every (token, expert) pair counted once, on every sparse layer, whatever the parallelism
    k = overrides["num_experts_per_tok"]
    assert want_load is not None and load is not None
    assert sorted(load.tokens) == sparse_layers
    assert {layer: load.total(layer) for layer in load.tokens} == {layer: FED_TOKENS * k for layer in sparse_layers}
    assert {layer: want_load.total(layer) for layer in want_load.tokens} == {layer: FED_TOKENS * k for layer in sparse_layers}


def test_mxfp4_experts_ep2_and_tp2_equal_tp1(tiny_checkpoints, tmp_path: Path) -> None:
    """gpt-oss's MXFP4 experts dealt whole to the ranks (4-bit blocks and scales read for this
    rank's experts only), or cut at block boundaries (TP: each rank its rows of gate and up,
    its 32-value blocks of each down row); an I / tp that is not whole blocks is refused."""
    from tests.model.test_gpt_oss_mxfp4 import GPT_OSS, write_mxfp4_checkpoint

    path, _ = write_mxfp4_checkpoint(tiny_checkpoints("gpt_oss", **{**GPT_OSS, "intermediate_size": 64}),
                                     tmp_path / "mxfp4")
    with engine(path) as llm:
        want_tokens, want_logprobs = scored(llm)
    with engine(path, tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        tokens, logprobs = scored(llm)
        moes = experts_of(llm)
        assert moes and all(m.num_experts == 2 and m.w13_blocks.shape[0] == 2 for m in moes)
    assert tokens == want_tokens
    assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    with engine(path, tensor_parallel_size=2) as llm:
        tokens, logprobs = scored(llm)
        moes = experts_of(llm)
        assert moes and all(m.intermediate_size == 32 and m.w2_blocks.shape[2] == 1 for m in moes)
    assert tokens == want_tokens
    assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    small, _ = write_mxfp4_checkpoint(tiny_checkpoints("gpt_oss", **GPT_OSS), tmp_path / "small")  # I = 32
    with pytest.raises(ValueError, match=r"intermediate_size \(16\) to be a multiple of 32 .* --enable-expert-parallel"):
        LLM(str(small), kv_cache_memory_bytes=KV, max_model_len=256, device="cpu", tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()


def _route_nothing_to_the_last_expert(path: Path, layers: list[int]) -> None:
    """Plant a router that never picks expert 2 of 3 with top-1: logits (B v.x, -B v.x, 0), so
    one of experts 0 and 1 always scores >= 0 = expert 2's logit."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    for i in layers:
        name = f"model.layers.{i}.mlp.gate.weight"
        v = tensors[name][0].clone()
        tensors[name] = torch.stack([4 * v, -4 * v, torch.zeros_like(v)])
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_a_rank_no_token_is_routed_to_still_completes(tiny_checkpoints, tmp_path: Path) -> None:
    """E = 3 over two ranks (vLLM's spread: rank 0 holds experts 0 and 1, rank 1 expert 2) and a
    router that never picks expert 2: rank 1 computes nothing, yet joins every all-reduce."""
    import shutil

    src = tiny_checkpoints("qwen3_moe", **{**QWEN3_MOE, "num_experts": 3, "num_experts_per_tok": 1})
    path = tmp_path / "starved"
    shutil.copytree(src, path)
    _route_nothing_to_the_last_expert(path, [0, 2])
    with engine(path) as llm:
        want_tokens, want_logprobs = scored(llm)
    with engine(path, tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        tokens, logprobs = scored(llm)
        load = llm.engine.expert_load()
    assert tokens == want_tokens and logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert load is not None and all(counts[2] == 0 and sum(counts) == FED_TOKENS for counts in load.tokens.values())


def test_a_hung_rank_times_out_loudly(tiny_checkpoints) -> None:
    """A rank that stops answering (SIGSTOP) inside an expert-parallel step: rank 0's all-reduce
    times out after --distributed-timeout and the engine is declared dead."""
    path = tiny_checkpoints("mixtral", **MIXTRAL)
    # 10 s, not 3: the rendezvous waits this long too, and a loaded machine can take longer to start a worker
    llm = LLM(str(path), kv_cache_memory_bytes=KV, max_model_len=256, device="cpu", tensor_parallel_size=2,
              enable_expert_parallel=True, distributed_timeout_s=10)
    worker = llm.engine.executor.procs[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        llm.engine.add_request(llm.engine.input_processor.process("r1", None, SamplingParams(max_tokens=4), [1, 2, 3]))
        with pytest.raises(WorkerFailedError):
            llm.engine.step()
        assert time.monotonic() - start < 25
        llm.engine.abort_request("r1")
    finally:
        llm.shutdown()  # a stopped worker is killed
    assert worker.poll() is not None
    assert not torch.distributed.is_initialized()
