"""The roofline's account of LoRA adapters (issue 17): weights, bytes per step, FLOPs per token,
TP sharding, the step prediction and `stoker roofline --lora-rank R --max-loras N`; every figure
checked by hand on a small model shape."""

from __future__ import annotations

import json

import pytest

from stoker.cli import main
from stoker.roofline.costmodel import step_cost
from stoker.roofline.lora import LoRACost, LoRASpec, adapter_params, projection_dims
from stoker.roofline.modelspec import spec_from_config

# hidden 64, 4 heads x 16 (q_dim 64), 2 KV heads (kv_dim 32), intermediate 160, 2 layers.
SMALL = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}
SMALL_SPEC = spec_from_config(SMALL, "small")

# Per layer, r x (in + out) at rank 4: q 4(64+64)=512, k 4(64+32)=384, v 384, o 4(64+64)=512,
# gate 4(64+160)=896, up 896, down 4(160+64)=896: 4480 per layer, 8960 for both layers.
PARAMS_R4 = 8960
# TP2: column-parallel (q, k, v, gate, up) keep A whole and halve B: q 4(64+32)=384, k 4(64+16)=320,
# v 320, gate 4(64+80)=576, up 576; row-parallel (o, down) halve A: o 4(32+64)=384, down 4(80+64)=576.
PARAMS_R4_TP2 = 2 * (384 + 320 + 320 + 576 + 576 + 384 + 576)  # 6272


def test_adapter_params_by_hand() -> None:
    m = SMALL_SPEC
    assert projection_dims(m)["k_proj"] == (64, 32) and projection_dims(m)["down_proj"] == (160, 64)
    assert adapter_params(m, 4) == PARAMS_R4
    assert adapter_params(m, 8) == 2 * PARAMS_R4  # linear in the rank
    assert adapter_params(m, 4, tp=2) == PARAMS_R4_TP2
    assert adapter_params(m, 4, ("q_proj", "v_proj")) == 2 * (512 + 384)
    # The issue-2 model of benchmarks/lora_cpu.py: 1,196,032 params per rank-16 adapter (docs/benchmarks.md).
    issue2 = spec_from_config({"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
                               "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024}, "issue2")
    assert adapter_params(issue2, 16) == 1_196_032


def test_step_bytes_and_flops_by_hand() -> None:
    m = SMALL_SPEC
    # 8 decoding sequences, at most 3 distinct adapters: 3 adapters' weights read once each (bf16),
    # every token 2 x params FLOPs on its own adapter.
    c = LoRACost.of(m, LoRASpec(rank=4, max_loras=3), seqs=8)
    assert c.adapters == 3 and c.tokens == 8
    assert c.weight_bytes == 3 * PARAMS_R4 * 2
    assert c.flops_per_token == 2 * PARAMS_R4 and c.flops == 8 * 2 * PARAMS_R4
    # Activations per token per layer (shrink reads x once per merged op and writes r per target; the
    # expand reads those back and writes out): qkv 64 + (64+32+32) + 2*4*3 = 216, o 64+64+8 = 136,
    # gate_up 64+320+16 = 400, down 160+64+8 = 232: 984 per layer.
    assert c.act_bytes == 8 * 2 * 984 * 2
    assert c.bytes == c.weight_bytes + c.act_bytes
    # Fewer sequences than max_loras: one adapter each; float32 adapters are 4 bytes.
    one = LoRACost.of(m, LoRASpec(rank=4, max_loras=3), seqs=1, act_dtype="fp32")
    assert one.adapters == 1 and one.weight_bytes == PARAMS_R4 * 4


def test_step_prediction_includes_the_adapters() -> None:
    # Llama-3-8B rank 16 on all seven targets: 32 x 16 x (8192 + 5120 + 5120 + 8192 + 3 x 18432).
    params = adapter_params(_spec("llama-3-8b"), 16)
    assert params == 41_943_040
    lora = LoRASpec(rank=16, max_loras=4)
    # (step, sequences in it): a decode batch of 8, 2 prompts of 512, a 2048-token chunk of 512-token prompts (4).
    for kw, seqs in ((dict(batch=8, context_len=1024), 8), (dict(phase="prefill", batch=2, context_len=512), 2),
                     (dict(phase="prefill", chunk_tokens=2048, context_len=512), 4)):
        base = step_cost("llama-3-8b", "H100", **kw)
        with_lora = step_cost("llama-3-8b", "H100", lora=lora, **kw)
        op = next(o for o in with_lora.ops if o.name == "lora")
        assert op.flops == pytest.approx(base.tokens_per_step * 2 * params)
        assert op.weight_bytes == pytest.approx(min(4, seqs) * params * 2)
        # one more op, the base's ops unchanged
        assert with_lora.step_time_s == pytest.approx(base.step_time_s + op.time_s)
        assert [o for o in with_lora.ops if o.name != "lora"] == list(base.ops)


def _spec(name: str):
    from stoker.roofline.modelspec import get_model_spec

    return get_model_spec(name)


def test_bad_lora_specs() -> None:
    with pytest.raises(ValueError):
        LoRASpec(rank=0)
    with pytest.raises(ValueError):
        LoRASpec(rank=8, max_loras=0)
    with pytest.raises(ValueError, match="unknown LoRA target"):
        LoRASpec(rank=8, targets=("qkv_proj",))
    with pytest.raises(ValueError, match="MoE"):
        adapter_params(_spec("mixtral-8x7b"), 8)


def test_cli_prints_the_adapters_share(tmp_path, capsys) -> None:
    cfg = tmp_path / "small" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(SMALL))
    argv = ["roofline", "--model", str(cfg), "--gpu", "H100", "--batch", "1,8", "--lora-rank", "4", "--max-loras", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "LoRA: rank 4 on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, up to 2 adapters" in out
    assert "lora" in out and "of base weights" in out
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["lora"]["adapters_in_step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["lora"]["params_per_adapter"] == PARAMS_R4
        assert r["lora"]["weight_bytes_per_step"] == r["lora"]["adapters_in_step"] * PARAMS_R4 * 2
        assert r["lora"]["flops_per_token"] == 2 * PARAMS_R4
        assert r["lora"]["step_time_s"] > r["lora"]["base_step_time_s"] and r["step_time_s"] == r["lora"]["step_time_s"]
        assert any(op["name"] == "lora" for op in r["ops"])


def test_cli_lora_flags_need_a_rank(capsys) -> None:
    assert main(["roofline", "--model", "llama-3-8b", "--gpu", "H100", "--max-loras", "4"]) == 2
    assert "--lora-rank" in capsys.readouterr().err
    assert main(["roofline", "--model", "llama-3-8b", "--gpu", "H100", "--lora-rank", "8",
                 "--lora-targets", "q_proj,x_proj"]) == 2
    assert "x_proj" in capsys.readouterr().err
