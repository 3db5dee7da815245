"""Small random-weight pooling checkpoints, written by transformers and sentence-transformers
themselves (so loading them exercises the real layouts and the libraries double as references):

  * `make_bert_embedder`: a BertModel (or XLMRobertaModel) in the sentence-transformers
    layout (modules.json, 1_Pooling/config.json, 2_Normalize) with a WordPiece tokenizer;
  * `make_decoder_embedder`: a Qwen3/Llama decoder with last-token pooling and Normalize
    (Qwen3-Embedding's layout), with Stoker's bundled BPE tokenizer;
  * `make_cross_encoder`: a BertForSequenceClassification with one label (a reranker).

Where sentence-transformers is not installed (a bare GPU machine), the embedders' folders are
written by hand in the same layout (`_write_st_layout`): Stoker serves them alike.
"""

from __future__ import annotations

import json
import shutil
import string
import warnings
from pathlib import Path
from typing import Any

BERT_TINY: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 max_position_embeddings=128)
_WORDS = ("the a of and to is in it that for on with as was at by be this are from or an which you not but have "
          "he she they we there their what when where who how all can will one more about if out so up time").split()


def write_bert_tokenizer(dest: Path, model_max_length: int = 512) -> Any:
    """A lower-casing WordPiece tokenizer ([CLS] a [SEP] b [SEP], token types 0/1), saved to `dest`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars), *_WORDS,
              *("##" + s for s in ("ing", "ed", "er", "s", "ly", "ion", "es", "th", "en"))]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tk = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tk.decoder = decoders.WordPiece()
    tok = BertTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]", model_max_length=model_max_length)
    tok.save_pretrained(str(dest))
    return tok


def _randomize(model: Any, seed: int) -> None:
    """HF's std 0.02 init gives nearly identical vectors for every input; a wider spread makes
    agreement tests meaningful."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "embed" in name else 0.1))


# modules.json's types as sentence-transformers 6 writes them (Stoker reads their last word)
_ST_TYPES = {"Transformer": "sentence_transformers.base.modules.transformer.Transformer",
             "Pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
             "Normalize": "sentence_transformers.base.modules.normalize.Normalize"}


def _write_st_layout(hf_dir: Path, dest: Path, pooling: str, normalize: bool) -> Path:
    """The layout `_save_sentence_transformer` writes, without the library (a machine that lacks
    it): the model and tokenizer files, modules.json, 1_Pooling/config.json and 2_Normalize/."""
    shutil.copytree(hf_dir, dest, dirs_exist_ok=True)
    hidden = json.loads((hf_dir / "config.json").read_text())["hidden_size"]
    modules = [("Transformer", ""), ("Pooling", "1_Pooling")] + ([("Normalize", "2_Normalize")] if normalize else [])
    (dest / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": _ST_TYPES[kind]} for i, (kind, path) in enumerate(modules)],
        indent=2))
    (dest / "1_Pooling").mkdir(exist_ok=True)
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": hidden, "pooling_mode": pooling, "include_prompt": True}, indent=4))
    if normalize:
        (dest / "2_Normalize").mkdir(exist_ok=True)
        (dest / "2_Normalize" / "config.json").write_text(json.dumps(
            {"module_input_name": "sentence_embedding", "module_output_name": "sentence_embedding"}, indent=4))
    return dest


def _save_sentence_transformer(hf_dir: Path, dest: Path, pooling: str, normalize: bool) -> Path:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:  # the same folder, written by hand: Stoker serves it, nothing here can compare
        return _write_st_layout(hf_dir, dest, pooling, normalize)
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = Transformer(str(hf_dir))
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling)]
        if normalize:
            modules.append(Normalize())
        SentenceTransformer(modules=modules, device="cpu").save(str(dest))
    return dest


def make_bert_embedder(path: str | Path, pooling: str = "mean", normalize: bool = True, arch: str = "bert",
                       seed: int = 0, **overrides: Any) -> Path:
    """A sentence-transformers folder around a random BertModel / XLMRobertaModel."""
    import torch
    import transformers

    path = Path(path)
    hf_dir = path / "_hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    tok = write_bert_tokenizer(hf_dir)
    names = {"bert": ("BertConfig", "BertModel"), "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel")}[arch]
    kwargs = {**BERT_TINY, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id, **overrides}
    if arch == "xlm-roberta":
        kwargs.update(type_vocab_size=1, max_position_embeddings=kwargs["max_position_embeddings"] + 2)
    config = getattr(transformers, names[0])(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, names[1])(config, add_pooling_layer=False)
    _randomize(model, seed)
    model.save_pretrained(str(hf_dir))
    return _save_sentence_transformer(hf_dir, path / "model", pooling, normalize)


def make_decoder_embedder(path: str | Path, arch: str = "qwen3", seed: int = 0, **overrides: Any) -> Path:
    """A Qwen3-Embedding-style folder: a random decoder, last-token pooling, normalized."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from stoker.testing.tiny_checkpoint import TINY, copy_demo_tokenizer

    path = Path(path)
    hf_dir = path / "_hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    names = {"qwen3": ("Qwen3Config", "Qwen3Model"), "llama": ("LlamaConfig", "LlamaModel")}[arch]
    config = getattr(transformers, names[0])(**{**TINY, "max_position_embeddings": 256, "bos_token_id": 0,
                                                "eos_token_id": 4, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, names[1])(config)
    _randomize(model, seed)
    model.save_pretrained(str(hf_dir))
    copy_demo_tokenizer(hf_dir)
    for f in hf_dir.glob("chat_template*"):
        f.unlink()
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    # sentence-transformers 6 wraps text in the chat template when the tokenizer has one;
    # /v1/embeddings embeds `input` as given (vLLM's rule), so the reference must too.
    tok.chat_template = None
    if tok.pad_token is None:  # sentence-transformers pads its batches; the pad id never reaches the model
        tok.pad_token = tok.eos_token or tok.convert_ids_to_tokens(0)
    tok.save_pretrained(str(hf_dir))
    return _save_sentence_transformer(hf_dir, path / "model", "lasttoken", True)


def make_cross_encoder(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A random BertForSequenceClassification with one label and its tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = write_bert_tokenizer(path)
    config = BertConfig(**{**BERT_TINY, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "num_labels": 1,
                           **overrides})
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    _randomize(model, seed)
    model.save_pretrained(str(path))
    return path
