"""`stoker generate` and `stoker bench throughput` as a user runs them."""

from __future__ import annotations

import json

import pytest

from stoker.cli import main


def test_generate_prints_text_and_json(tiny_llama, capsys) -> None:
    common = ["generate", "--model", str(tiny_llama), "--max-tokens", "5", "--temperature", "0",
              "--ignore-eos", "--kv-cache-memory-bytes", str(4 << 20)]
    assert main(common + ["--prompt", "Hello", "--prompt", "World"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt:") == 2 and "finish_reason=length" in out
    assert main(common + ["--prompt", "Hello", "--json", "--n", "2", "--sampling-seed", "3", "--temperature", "1"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    record = json.loads(line)
    assert [len(o["token_ids"]) for o in record["outputs"]] == [5, 5]


def test_generate_bad_flag_is_one_clear_line(tiny_llama, capsys) -> None:
    assert main(["generate", "--model", str(tiny_llama), "--prompt", "x", "--top-p", "0"]) == 2
    err = capsys.readouterr().err
    assert "top_p must be in (0, 1]" in err and "Traceback" not in err


def test_bench_throughput_reports_each_rate(tiny_llama, capsys, tmp_path) -> None:
    args = ["bench", "throughput", "--model", str(tiny_llama), "--num-prompts", "6", "--input-len", "20",
            "--output-len", "7", "--range-ratio", "0.5", "--kv-cache-memory-bytes", str(4 << 20)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "requests/s" in text and "(generated tokens only)" in text and "(prompt + generated)" in text
    saved = tmp_path / "r.json"
    assert main(args + ["--json", "--save-result", str(saved)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(saved.read_text())
    assert result["num_prompts"] == 6
    # ignore_eos: every request generates its drawn length, so totals add up exactly.
    assert result["output_tokens"] == round(result["output_throughput"] * result["elapsed_s"])
    assert result["total_token_throughput"] > result["output_throughput"] > 0


def test_generate_and_bench_with_quantized_weights_and_fp8_kv(tiny_llama, capsys) -> None:
    common = ["--model", str(tiny_llama), "--kv-cache-memory-bytes", str(4 << 20), "--kv-cache-dtype", "fp8"]
    assert main(["generate", *common, "--quantization", "fp8", "--prompt", "Hello", "--max-tokens", "4",
                 "--temperature", "0", "--ignore-eos", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(record["outputs"][0]["token_ids"]) == 4
    assert main(["bench", "throughput", *common, "--quantization", "int8", "--num-prompts", "4", "--input-len", "16",
                 "--output-len", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["output_tokens"] == 16
    with pytest.raises(SystemExit) as exit_info:  # argparse's own refusal, naming the choices
        main(["generate", *common, "--quantization", "int3", "--prompt", "x"])
    assert exit_info.value.code == 2 and "invalid choice: 'int3' (choose from 'fp8', 'int8', 'int4')" in capsys.readouterr().err
    # int4 is a choice; this model's 64-column projections are not whole groups of 128: named
    assert main(["generate", *common, "--quantization", "int4", "--prompt", "x"]) != 0
    assert "qkv_proj: 64 input columns are not whole int4 groups of 128" in capsys.readouterr().err
