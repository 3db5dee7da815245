"""Which wall the served engine runs against: the cost model of this model on this device,
decided once when the engine is loaded (roofline/live.py prices every step with it).

* GPU: the hardware table's entry for the device torch names ("NVIDIA H100 80GB HBM3" ->
  H100-SXM), datasheet peaks, and the efficiency profile `--roofline-profile` names
  ("engine" by default: roofline/profiles.py).
* CPU: the device file `stoker doctor --write-device-file` measured (peaks are this machine's
  measured matmul rate and streaming read). Its default profile is "measured": every
  efficiency 1 against those measured roofs and no launch gaps, so the prediction is the
  measured-roof floor; a profile file (`stoker roofline calibrate`) can say more.
* Neither (a GPU the table lacks, a CPU without a device file): no verdict; the log says how to
  get one, and the wall gauges stay absent rather than made up.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from stoker.roofline.efficiency import Efficiencies
from stoker.roofline.live import WallModel

if TYPE_CHECKING:
    from stoker.engine.info import EngineInfo

logger = logging.getLogger("stoker.server")

DEFAULT_PROFILE = "engine"


def _dtype_name(dtype: Any) -> str:
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[str(dtype).removeprefix("torch.")]


def build_wall_model(info: EngineInfo, profile: str | None = None) -> WallModel | None:
    """The wall model of a loaded engine, or None (with the reason logged once)."""
    from stoker.roofline import device_file
    from stoker.roofline.hardware import gpu_from_device_name
    from stoker.roofline.modelspec import spec_from_config
    from stoker.roofline.profiles import get_profile

    runner = info.runner
    if runner.device_type == "cuda":
        device = gpu_from_device_name(runner.device_name)
        if device is None:
            logger.info("the wall: no roofline entry for %r; add it with a YAML device file (docs/roofline.md)",
                        runner.device_name)
            return None
        eff, profile_name = get_profile(profile or DEFAULT_PROFILE), profile or DEFAULT_PROFILE
    else:
        try:
            device = device_file.to_spec(device_file.read_device_file())
        except ValueError as exc:
            logger.info("the wall: not judged on this CPU (%s)", exc)
            return None
        if profile:
            eff, profile_name = get_profile(profile), profile
        else:
            eff, profile_name = Efficiencies.ideal(), "measured"
    act = _dtype_name(runner.dtype)
    weight = {"fp8": "fp8", "int8": "int8"}.get(runner.quantization or "", act)
    kv = "fp8" if info.cache_config.fp8_kv else act
    spec = spec_from_config(info.hf_config, name=info.model_path)
    return WallModel(spec, device, eff, weight_dtype=weight, kv_dtype=kv, act_dtype=act,
                     tp=info.tensor_parallel_size, profile=profile_name)
