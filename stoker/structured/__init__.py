"""Structured outputs: a grammar per request (JSON schema, JSON, regex, choice, EBNF), enforced
in the sampler as a token mask (xgrammar, as vLLM and SGLang use)."""
