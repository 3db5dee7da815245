"""`stoker finetune` end to end on a tiny random checkpoint (seconds on a CPU): the label mask, the
adapter as peft (and Stoker's LoRA loader) read it, its effect on greedy tokens, and --resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stoker.cli import main
from stoker.finetune.config import FinetuneConfig
from stoker.finetune.data import ChatRow, CompletionRow, DataError
from stoker.finetune.masking import featurize
from stoker.testing.tiny_checkpoint import demo_tokenizer_dir

from .helpers import load_hf

pytest.importorskip("trl")
pytest.importorskip("peft")

EOT = "<|eot_id|>"


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny-model training is thousands of microsecond ops: on a shared 2-core box a second
    # thread only adds a barrier per op that waits on a busy neighbour (measured 4x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _chat(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


@pytest.fixture(scope="module")
def pingpong(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "pingpong.jsonl"
    path.write_text("".join(json.dumps(_chat(f"PING {n}", f"PONG {n + 1}")) + "\n" for n in range(0, 96, 3)))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_tokenizer_dir()))


def _spans(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The masked-in runs of tokens, decoded with special tokens kept."""
    runs, run = [], []
    for tok, bit in zip(ids, mask):
        if bit:
            run.append(tok)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def test_mask_covers_each_assistant_turn_and_its_end_of_turn_only(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "PING 1"},
                {"role": "assistant", "content": "PONG 2"}, {"role": "user", "content": "PING 41"},
                {"role": "assistant", "content": "PONG 42"}]
    f = featurize(tokenizer, ChatRow(1, messages), max_seq_len=512, where="d:1")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert f.input_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert _spans(tokenizer, f.input_ids, f.assistant_masks) == ["PONG 2" + EOT, "PONG 42" + EOT]
    # A conversational prompt/completion row: the prompt's assistant turn is context only.
    f = featurize(tokenizer, ChatRow(1, messages, train_from=3), max_seq_len=512, where="d:1")
    assert _spans(tokenizer, f.input_ids, f.assistant_masks) == ["PONG 42" + EOT]


def test_completion_mask_covers_the_completion_and_eos(tokenizer) -> None:
    f = featurize(tokenizer, CompletionRow(1, "PING 7 ->", " PONG 8"), max_seq_len=512, where="d:1")
    assert f.input_ids[: len(tokenizer.encode("PING 7 ->"))] == tokenizer.encode("PING 7 ->")  # BOS as serving adds it
    assert _spans(tokenizer, f.input_ids, f.assistant_masks) == [" PONG 8" + EOT]


def test_a_prompt_longer_than_max_seq_len_names_its_line(tokenizer) -> None:
    row = ChatRow(17, _chat("PING " + "9" * 200, "PONG")["messages"])
    with pytest.raises(DataError, match=r"train.jsonl:17: the prompt alone is \d+ tokens"):
        featurize(tokenizer, row, max_seq_len=32, where="train.jsonl:17")
    long = featurize(tokenizer, ChatRow(3, _chat("PING 1", "PONG " + "2" * 200)["messages"]), 32, "d:3")
    assert long.truncated and len(long.input_ids) == 32 and long.assistant_masks[-1] == 1


class _FirstBatch:
    """Keeps the labels of the first batch the trainer feeds the model, then stops the run."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        self.batch: dict | None = None
        outer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
                outer.batch = next(iter(train_dataloader))
                control.should_training_stop = True

        self.callback = Callback()


def test_trainer_labels_are_minus_100_outside_the_assistant_turns(tiny_llama, pingpong, tokenizer, tmp_path) -> None:
    from stoker.finetune.trainer import finetune

    probe = _FirstBatch()
    cfg = FinetuneConfig(model=str(tiny_llama), data=pingpong, output=tmp_path / "a", max_steps=1, eval_split=0,
                         batch_size=4, device="cpu")
    finetune(cfg, callbacks=[probe.callback], say=lambda _: None)
    ids, labels = probe.batch["input_ids"], probe.batch["labels"]
    assert labels.shape == ids.shape and labels.shape[0] == 4
    for row_ids, row_labels in zip(ids.tolist(), labels.tolist()):
        kept = [t for t, lab in zip(row_ids, row_labels) if lab != -100]
        assert all(lab in (-100, t) for t, lab in zip(row_ids, row_labels))
        text = tokenizer.decode(kept, skip_special_tokens=False)
        assert text.startswith("PONG ") and text.endswith(EOT) and "PING" not in text and "user" not in text


def _greedy(model, tokenizer, user: str, num_tokens: int = 8) -> list[int]:
    from .helpers import hf_greedy

    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    return hf_greedy(model, tokenizer.encode(text, add_special_tokens=False), num_tokens)


def test_finetune_writes_a_peft_adapter_that_changes_greedy_tokens(tiny_llama, pingpong, tokenizer, tmp_path,
                                                                    capsys) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    out = tmp_path / "pong"
    assert main(["finetune", "--model", str(tiny_llama), "--data", str(pingpong), "--output", str(out),
                 "--max-steps", "40", "--learning-rate", "1e-2", "--batch-size", "8", "--eval-split", "0.25",
                 "--lora-rank", "8", "--eval-steps", "20", "--save-steps", "20", "--device", "cpu",
                 "--no-gradient-checkpointing"]) == 0  # the other tests run the default (on)
    assert f"--lora-modules NAME={out}" in capsys.readouterr().out
    # PEFT's layout at the top level, nothing half-made beside it.
    top = sorted(p.name for p in out.iterdir())
    assert [n for n in top if not n.startswith("checkpoint-")] == [
        "adapter_config.json", "adapter_model.safetensors", "finetune_log.json", "loss_curve.png"]
    assert "checkpoint-40" in top
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tiny_llama.resolve())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"], cfg["task_type"]) == (8, 32, "LORA", "CAUSAL_LM")
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"])
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = json.loads((out / "finetune_log.json").read_text())
    evals = [e["eval_loss"] for e in log["log_history"] if "eval_loss" in e]
    assert log["result"]["global_step"] == 40 and log["result"]["num_eval_rows"] == 8
    assert evals[-1] < 0.5 * evals[0], evals  # held-out loss on the assistant tokens fell

    weights = load_file(str(out / "adapter_model.safetensors"))
    b_norms = [w.abs().max().item() for k, w in weights.items() if "lora_B" in k]
    assert len(b_norms) == 2 * 7 and min(b_norms) > 0  # every B left its zero init: the adapter does something

    base = load_hf(tiny_llama)
    base_tokens = _greedy(base, tokenizer, "PING 50")
    tuned = PeftModel.from_pretrained(base, str(out)).eval()
    tuned_tokens = _greedy(tuned, tokenizer, "PING 50")
    assert tuned_tokens != base_tokens
    assert tokenizer.decode(tuned_tokens).startswith("PONG")  # 40 steps teach the word, if not yet the number

    # what `--lora-modules` serves: Stoker's engine with the adapter gives PEFT's greedy tokens
    from stoker import LLM, LoRARequest, SamplingParams

    llm = LLM(str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=4 << 20, enable_lora=True, max_lora_rank=8)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "PING 50"}], tokenize=False,
                                         add_generation_prompt=True)
    served = llm.generate({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)},
                          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                          lora_request=LoRARequest("pong", 1, str(out)))[0].outputs[0].token_ids
    assert served == tuned_tokens


def test_adapter_loads_in_stoker_lora_loader(tiny_llama, pingpong, tmp_path) -> None:
    adapter_mod = pytest.importorskip("stoker.lora.adapter")
    from stoker.finetune.trainer import finetune

    out = tmp_path / "attn"
    finetune(FinetuneConfig(model=str(tiny_llama), data=pingpong, output=out, max_steps=2, eval_split=0,
                            lora_rank=4, target_modules=("q_proj", "v_proj"), device="cpu"), say=lambda _: None)
    hf_config = json.loads((tiny_llama / "config.json").read_text())
    adapter = adapter_mod.load_adapter("attn", out, hf_config, max_rank=16, served_model=str(tiny_llama))
    assert adapter.rank == 4 and adapter.targets == {"q_proj", "v_proj"} and adapter.scaling == 32 / 4
    assert len(adapter.weights) == 2 * hf_config["num_hidden_layers"]


class _StopAfter:
    def __init__(self, step: int) -> None:
        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == step:
                    raise KeyboardInterrupt  # as a user's Ctrl-C, between two optimizer steps

        self.callback = Callback()


def test_resume_continues_from_the_last_checkpoint(tiny_llama, pingpong, tmp_path) -> None:
    from safetensors.torch import load_file

    from stoker.finetune.trainer import finetune

    def cfg(out: Path, resume: bool = False) -> FinetuneConfig:
        return FinetuneConfig(model=str(tiny_llama), data=pingpong, output=out, max_steps=4, save_steps=2,
                              eval_split=0, learning_rate=5e-3, lora_rank=4, device="cpu", resume=resume)

    straight = finetune(cfg(tmp_path / "straight"), say=lambda _: None)
    assert straight.global_step == 4 and straight.resumed_from is None

    out = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        finetune(cfg(out), callbacks=[_StopAfter(3).callback], say=lambda _: None)
    # Interrupted: checkpoints for --resume, and no adapter at the top level, not even a partial one.
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]

    resumed = finetune(cfg(out, resume=True), say=lambda _: None)
    assert resumed.resumed_from == "checkpoint-2" and resumed.global_step == 4
    # Same data order, optimizer and scheduler state: the resumed run ends where the straight one did.
    a = load_file(str(tmp_path / "straight" / "adapter_model.safetensors"))
    b = load_file(str(out / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6)
