"""Speculative decoding whose drafts a model makes in the runner: a draft model or an EAGLE-3
head, with its own KV cache under the target's block tables (docs/spec_decode.md)."""
