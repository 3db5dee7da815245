"""Time the engine's own steps: `ModelRunner.execute` on hand-built step messages.

A decode step at (batch B, context C) is B sequences whose KV blocks are distinct and already
hold C - 1 tokens (random weights, so whatever the cache holds costs the same to read); a
prefill step is one fresh prompt. Building the message by hand reaches B = 64 at C = 2048
without first prefilling 131k tokens; the runner runs exactly what the scheduler would send
it (decodes first, block tables, greedy sampling).
"""

from __future__ import annotations

from typing import Any

from stoker.core.step import SampleSpec, SeqStep, StepMessage
from stoker.doctor.microbench import median_s
from stoker.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def decode_message(batch: int, context_len: int, block_size: int) -> StepMessage:
    per_seq = -(-context_len // block_size)
    seqs = [SeqStep(i, [7], context_len - 1, list(range(i * per_seq, (i + 1) * per_seq)), True) for i in range(batch)]
    return StepMessage(seqs, {i: SampleSpec(_GREEDY, 0, 1) for i in range(batch)})


def prefill_message(prompt_len: int, block_size: int) -> StepMessage:
    blocks = list(range(-(-prompt_len // block_size)))
    tokens = [(7 * i) % 1000 + 5 for i in range(prompt_len)]
    return StepMessage([SeqStep(0, tokens, 0, blocks, True)], {0: SampleSpec(_GREEDY, 0, 0)})


def blocks_needed(batch: int, context_len: int, block_size: int = 16) -> int:
    return batch * -(-context_len // block_size)


def step_seconds(llm: Any, phase: str, batch: int, context_len: int, iters: int, warmup: int = 2) -> float:
    """Median seconds of `runner.execute` for one decode or prefill step shape."""
    runner = llm.engine.executor.driver_runner
    bs = runner.block_size
    if blocks_needed(batch, context_len, bs) > llm.engine.block_manager.num_blocks:
        raise ValueError(f"{batch} x {context_len} tokens need more KV blocks than the engine holds")
    msg = decode_message(batch, context_len, bs) if phase == "decode" else prefill_message(batch * context_len, bs)
    if phase == "prefill" and batch != 1:
        raise ValueError("prefill steps are timed one prompt at a time")
    return median_s(lambda: runner.execute(msg), iters, warmup)


def host_inputs_s(prompt_len: int, block_size: int, iters: int) -> float:
    """Median seconds the host takes to build one prompt's input tensors (`prepare_inputs`: a
    Python loop over the tokens for positions and KV slots, then the tensors): the per-token
    host work of a prefill step, which the batch-1 overhead probe (one token) does not do."""
    import torch

    from stoker.runner.inputs import prepare_inputs

    msg = prefill_message(prompt_len, block_size)
    return median_s(lambda: prepare_inputs(msg, block_size, torch.device("cpu")), iters)


# Read before every projection of the cold-host probe: twice a core's L2 (2 MiB on the Xeons
# seen here), as a real projection's weights are (1-6 MB each in issue 2's model).
POLLUTE_BYTES = 4 << 20


def cold_host_step_seconds(llm: Any, batch: int, context_len: int, iters: int) -> float:
    """The near-empty probe's decode step with its host work run on cold caches, as in a real
    step: there every projection streams megabytes of weights, evicting the interpreter's and
    torch's own data from L1/L2, and the same Python and dispatch took ~1.1 ms more than in the
    probe, whose whole working set stays in L2 (2.8 vs 1.7 ms outside the C kernels at B = 1,
    1 thread). Here a 4 MiB matrix-vector product runs before every projection that runs as a
    module (a forward pre-hook) and its own time, measured back to back in the same call, is
    subtracted once per hook a step ran. A CPU decode step that runs its layers in one C call
    (runner/cpu_decode.py) runs only the LM head as a module: its host work is what is left
    outside that call, and so is what this measures."""
    import torch

    from stoker.layers.linear import Linear

    weight, x = torch.ones(POLLUTE_BYTES // 4096, 1024), torch.ones(1024)
    calls = 0

    def pollute(*_: Any) -> None:
        nonlocal calls
        calls += 1
        torch.mv(weight, x)

    runner = llm.engine.executor.driver_runner
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    handles = [m.register_forward_pre_hook(pollute) for m in linears]
    try:
        hooked = step_seconds(llm, "decode", batch, context_len, iters)
        calls = 0
        runner.execute(decode_message(batch, context_len, runner.block_size))  # the hooks one step runs
        per_step = calls
    finally:
        for h in handles:
            h.remove()

    def pollute_step() -> None:
        for _ in range(per_step):
            pollute()

    return max(0.0, hooked - median_s(pollute_step, iters))
