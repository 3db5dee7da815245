"""The batcher's default preferred batch, from the roofline rather than a guess.

A pooling step is one prefill: every token of every sequence goes through the weight GEMMs
once. A (tokens x in) @ (in x out) GEMM reads its weights once whatever the rows, so it stays
weight-bound (memory) until its rows carry ridge = peak FLOP/s / bandwidth FLOPs per weight
byte; past that it is compute-bound and batching more only adds latency. The crossover is a
number of tokens, not of sequences: `roofline.costmodel.crossover_batch` finds it (a decode
step of B sequences is B tokens through the same GEMMs). So the default is in tokens
(`BatcherConfig.preferred_batch_tokens`): the batcher sends as soon as that much work waits.

The device is the hardware table's entry for the GPU torch names, or on a CPU the device file
`stoker doctor --write-device-file` measured, or, with neither and when asked (`measure_cpu`:
the caller has a queue delay, the only case where a preferred size changes anything), a quick
measurement of this CPU at start-up, once per process: the caller passes the measurement (the
server passes doctor/device.py's quick_cpu_device), so this engine floor never imports the doctor.
Without a device, there is no default: Triton's behaviour without `preferred_batch_size`
(batches as large as `max_batch_size` allows within `max_queue_delay_microseconds`).

Pure Python but for that measurement, which imports torch when it runs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("stoker.server")


def _spec_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """An encoder's config in the decoder shape the cost model prices: same hidden size, heads
    and layers; its two-matrix MLP (up, down) as a gated one of 2/3 the width (same weights)."""
    if "intermediate_size" not in hf_config or hf_config.get("model_type") not in ("bert", "xlm-roberta", "roberta"):
        return hf_config
    return {**hf_config, "intermediate_size": max(1, int(hf_config["intermediate_size"]) * 2 // 3),
            "num_key_value_heads": hf_config["num_attention_heads"], "tie_word_embeddings": True}


MeasureCpu = Callable[[], Any]  # () -> roofline.device_file.DeviceFile of this CPU


def preferred_batch_tokens(hf_config: dict[str, Any], device_name: str | None, weight_dtype: str,
                           measure_cpu: MeasureCpu | None = None) -> int | None:
    """Tokens per batch where the weight GEMMs stop being weight-bound on this device, or None
    when the device is not known (no table entry, no device file, and no `measure_cpu`)."""
    from stoker.roofline.costmodel import crossover_batch
    from stoker.roofline.modelspec import spec_from_config

    gpu = _device_spec(device_name, measure_cpu)
    if gpu is None:
        return None
    try:
        spec = spec_from_config(_spec_config(hf_config), name="pooling-model")
        # no LM head: a pooling model reads hidden states; activations in the weights' dtype on
        # CPU (a float32 engine), bf16 elsewhere as the cost model assumes
        act = "fp32" if weight_dtype == "fp32" else "bf16"
        return crossover_batch(spec, gpu, context_len=1, weight_dtype=weight_dtype, act_dtype=act, lm_head=False)
    except (ValueError, KeyError) as exc:  # a config the cost model cannot price: no default, said once
        logger.info("batcher: no roofline default for preferred batch tokens (%s)", exc)
        return None


def _device_spec(device_name: str | None, measure_cpu: MeasureCpu | None) -> Any:
    from stoker.roofline.hardware import gpu_from_device_name

    if device_name:
        return gpu_from_device_name(device_name)
    from stoker.roofline.device_file import default_path, read_device_file, to_spec

    if default_path().exists():
        try:
            return to_spec(read_device_file())
        except ValueError as exc:
            logger.info("batcher: the device file is unreadable (%s)", exc)
            return None
    return measured_cpu_spec(measure_cpu) if measure_cpu is not None else None


@functools.lru_cache(maxsize=1)  # once per process: every pooling model of a server shares it
def measured_cpu_spec(measure_cpu: MeasureCpu) -> Any:
    from stoker.roofline.device_file import to_spec

    start = time.perf_counter()
    device = measure_cpu()
    logger.info("batcher: no device file, so this CPU was measured for the roofline default in %.1f s: "
                "%.0f GFLOP/s fp32, %.1f GB/s read (`stoker doctor --write-device-file` keeps a fuller "
                "measurement; --preferred-batch-size skips this)", time.perf_counter() - start,
                device.fp32_tflops * 1e3, device.read_gb_per_s)
    return to_spec(device)
