"""The fused BERT encoder layer (kernels/cpu/encoder_layer.c, one C call per layer) against its
twin, the same model run through its modules (pooling/bert.py), and the checks that keep the C
side from reading outside its tensors."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch

from stoker.kernels.cpu import encoder_layer as cpu_encoder
from stoker.pooling.attention import VarlenBatch, varlen_batch
from stoker.pooling.bert import BertEncoder, FusedBertLayers
from stoker.pooling.runner import PoolingRunner, PoolInput
from stoker.testing.tiny_pooling import make_bert_embedder

if not shutil.which("cc") and not shutil.which("gcc"):
    pytest.skip("no C compiler: the CPU kernels are not built here", allow_module_level=True)


def encoder_of(runner: PoolingRunner) -> BertEncoder:
    return next(m for m in runner.model.modules() if isinstance(m, BertEncoder))


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_fused_layers_equal_the_modules(tmp_path: Path, act: str) -> None:
    model_dir = make_bert_embedder(tmp_path / "m", hidden_act=act, num_hidden_layers=3)
    fused = PoolingRunner.from_folder(str(model_dir), "auto", "cpu", None)
    modules = PoolingRunner.from_folder(str(model_dir), "auto", "cpu", None)
    encoder_of(modules).use_fused = False  # the twin: every layer through its modules
    gen = torch.Generator().manual_seed(len(act))
    lengths = [1, 3, 17, 40, 9, 64]  # around the kernels' vector width and 64-key panels
    batch = [PoolInput(torch.randint(5, 100, (n,), generator=gen).tolist()) for n in lengths]
    got, want = fused.run_rows(batch), modules.run_rows(batch)
    assert encoder_of(fused).use_fused is True and isinstance(encoder_of(fused).fused, FusedBertLayers)
    assert encoder_of(modules).fused is None
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(w), rtol=1e-4, atol=2e-5)
    # each sequence alone gives its own row of the batch (no cross-talk through the workspace)
    for n, row in zip(lengths, got):
        alone = fused.run_rows([batch[lengths.index(n)]])[0]
        torch.testing.assert_close(torch.from_numpy(alone), torch.from_numpy(row), rtol=1e-4, atol=2e-5)


def test_fused_layers_only_where_they_can_run(tmp_path: Path) -> None:
    model_dir = make_bert_embedder(tmp_path / "m")
    runner = PoolingRunner.from_folder(str(model_dir), "auto", "cpu", None)
    encoder = encoder_of(runner)
    assert FusedBertLayers.build(encoder, torch.zeros(2, 64)) is not None
    assert FusedBertLayers.build(encoder, torch.zeros(2, 64, dtype=torch.float64)) is None  # not float32
    qkv = encoder.layer[0].attention.get_submodule("self").qkv
    qkv.method.kernel = lambda *a: None  # a projection on the torch twin (tests of the packed layout)
    assert FusedBertLayers.build(encoder, torch.zeros(2, 64)) is None


def test_bert_layer_refuses_what_would_read_outside_its_tensors(tmp_path: Path) -> None:
    model_dir = make_bert_embedder(tmp_path / "m")
    runner = PoolingRunner.from_folder(str(model_dir), "auto", "cpu", None)
    fused = FusedBertLayers(encoder_of(runner))
    hidden, inter = fused.hidden, fused.intermediate
    x = torch.randn(10, hidden)
    batch = VarlenBatch.build([4, 6], torch.device("cpu"))
    tables = (batch.token_table, batch.cu_tensor, batch.lengths)
    layer = cpu_encoder.bert_layer_params(fused.tensors[0], hidden, inter)  # one layer's 12 pointers
    args = (layer, fused.num_heads, inter, fused.eps, fused.act)
    with pytest.raises(ValueError, match="workspace of 10 floats"):
        cpu_encoder.bert_encoder(x, *args, *tables, fused.scale, torch.empty(10))
    workspace = torch.empty(10 * (5 * hidden + inter))
    with pytest.raises(ValueError, match="act 7"):
        cpu_encoder.bert_encoder(x, layer, fused.num_heads, inter, fused.eps, 7, *tables, fused.scale, workspace)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the 9 tokens"):
        cpu_encoder.bert_encoder(x[:9].contiguous(), *args, *tables, fused.scale, workspace)
    with pytest.raises(ValueError, match="parameter 2 of a BERT layer"):
        cpu_encoder.bert_layer_params([t if i != 2 else t[:, :1] for i, t in enumerate(fused.tensors[0])], hidden, inter)
    with pytest.raises(ValueError, match="12 per layer"):
        cpu_encoder.bert_encoder(x, (ctypes.c_void_p * 13)(*layer, None), *args[1:], *tables, fused.scale, workspace)
    with varlen_batch(batch):  # and the good call runs
        cpu_encoder.bert_encoder(x, *args, *tables, fused.scale, workspace)
    assert torch.isfinite(x).all()
