"""`stoker finetune` input checks that run before any model is loaded: rows, line numbers, the
output folder, the flags. Fast: no torch, no training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoker.cli import main
from stoker.finetune.config import FinetuneConfig
from stoker.finetune.data import (
    ChatRow,
    CompletionRow,
    DataError,
    read_rows,
    split_rows,
)
from stoker.finetune.output_dir import (
    last_checkpoint,
    prepare_output_dir,
    publish_adapter,
)

GOOD = json.dumps({"messages": [{"role": "user", "content": "PING 1"}, {"role": "assistant", "content": "PONG 2"}]})


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("bad_line, message", [
    ("this is not json", "not a JSON object"),
    ("[", "a JSON array? JSONL holds one object per line"),  # a pretty-printed .json file
    ('[{"role": "user", "content": "x"}]', "expected a JSON object"),
    ('{"text": "hello"}', "expected {\"messages\""),
    ('{"messages": [{"role": "user", "content": "only a question"}]}', "no assistant message"),
    ('{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}', "role is 'robot'"),
    ('{"prompt": "x", "completion": 3}', "both be strings or both be message lists"),
    ('{"prompt": "x", "completion": ""}', "completion is empty"),
])
def test_bad_row_is_refused_with_its_line_number(tmp_path, capsys, bad_line, message) -> None:
    data = _write(tmp_path / "train.jsonl", [GOOD, "", GOOD, bad_line, GOOD])  # the bad row is line 4
    out = tmp_path / "adapter"
    assert main(["finetune", "--model", str(tmp_path), "--data", str(data), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl:4: " in err and message in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was written


def test_rows_of_both_shapes_parse_and_conversational_completion_trains_only_the_completion(tmp_path) -> None:
    conv = {"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                       {"role": "user", "content": "c"}],
            "completion": [{"role": "assistant", "content": "d"}]}
    data = _write(tmp_path / "d.jsonl", [GOOD, json.dumps({"prompt": "2+2=", "completion": "4"}), json.dumps(conv)])
    chat, text, conv_row = read_rows(data)
    assert isinstance(chat, ChatRow) and chat.train_from == 0 and chat.line == 1
    assert text == CompletionRow(2, "2+2=", "4")
    assert isinstance(conv_row, ChatRow) and conv_row.train_from == 3 and len(conv_row.messages) == 4


def test_empty_file_and_missing_file(tmp_path) -> None:
    with pytest.raises(DataError, match="no rows"):
        read_rows(_write(tmp_path / "e.jsonl", ["", "  "]))
    with pytest.raises(FileNotFoundError):
        read_rows(tmp_path / "absent.jsonl")


def test_eval_split_is_seeded_disjoint_and_never_empty(tmp_path) -> None:
    rows = read_rows(_write(tmp_path / "d.jsonl", [GOOD] * 20))
    train, held = split_rows(rows, 0.1, seed=3)
    assert len(held) == 2 and len(train) == 18
    assert {r.line for r in train}.isdisjoint({r.line for r in held})
    assert split_rows(rows, 0.1, seed=3) == (train, held)  # --resume sees the same split
    assert len(split_rows(rows[:3], 0.01, seed=0)[1]) == 1
    with pytest.raises(DataError, match="at least 2 rows"):
        split_rows(rows[:1], 0.1, seed=0)


def test_output_folder_holding_something_else_is_refused_unless_overwrite(tmp_path, capsys) -> None:
    data = _write(tmp_path / "train.jsonl", [GOOD] * 4)
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["finetune", "--model", str(tmp_path), "--data", str(data), "--output", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "is not empty (notes.txt)" in err and "--overwrite" in err
    assert main(args + ["--resume"]) == 2
    assert "no checkpoint-N folder to resume from" in capsys.readouterr().err
    # --overwrite clears this command's own files only; the user's file stays.
    (out / "checkpoint-3").mkdir()
    (out / "adapter_config.json").write_text("{}")
    assert prepare_output_dir(out, resume=False, overwrite=True) is None
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_last_checkpoint_needs_a_complete_save(tmp_path) -> None:
    for step, complete in ((5, True), (12, True), (40, False)):  # 40: a save cut off mid-way
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoint-12"
    assert prepare_output_dir(tmp_path, resume=True, overwrite=False) == tmp_path / "checkpoint-12"


def test_publish_moves_both_files_and_sets_the_base(tmp_path) -> None:
    out = tmp_path / "adapter"
    saved = out / ".stoker-tmp-adapter"
    saved.mkdir(parents=True)
    (saved / "adapter_model.safetensors").write_bytes(b"new weights")
    (saved / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model_name_or_path": None}))
    (out / "adapter_config.json").write_text(json.dumps({"r": 4}))  # a previous adapter being replaced
    publish_adapter(saved, out, "/models/base")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["base_model_name_or_path"] == "/models/base"
    # A save that lacks a file publishes nothing and leaves no config behind it.
    saved.mkdir()
    (saved / "adapter_config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="did not write adapter_model.safetensors"):
        publish_adapter(saved, out, "/models/base")
    assert (out / "adapter_model.safetensors").read_bytes() == b"new weights"


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_modules=("q_proj", "lm_head")), "lm_head cannot be served"),
    (dict(lora_rank=0), "lora-rank must be positive"),
    (dict(eval_split=1.0), "eval-split must be in"),
    (dict(resume=True, overwrite=True), "pass one of them"),
    (dict(device="tpu"), "device must be one of"),
])
def test_config_refuses_what_cannot_work(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        FinetuneConfig(model="m", data=Path("d"), output=Path("o"), **kwargs)


def test_total_steps_follows_hf_trainer() -> None:
    cfg = FinetuneConfig(model="m", data=Path("d"), output=Path("o"), batch_size=4, epochs=2,
                         gradient_accumulation_steps=2)
    assert cfg.total_steps(20) == 6  # 5 batches an epoch -> 3 optimizer steps (the last on 1 batch), 2 epochs
    assert FinetuneConfig(model="m", data=Path("d"), output=Path("o"), max_steps=7).total_steps(1000) == 7
