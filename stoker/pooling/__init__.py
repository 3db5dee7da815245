"""Pooling models: embeddings (BERT-family encoders, decoder embedders) and cross-encoder rerankers.

`config.py` reads what a Hugging Face / sentence-transformers folder says it is (pure Python);
`bert.py` and `decoder.py` are the models, built from Stoker's layers; `loader.py` builds and
fills them from safetensors; `runner.py` packs a batch of sequences and pools them.
`batcher.py` is the server's dynamic batcher (Triton's knobs) and `batch_defaults.py` its roofline
default preferred batch; neither imports the server.
"""
