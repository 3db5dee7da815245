"""The step loop (LLMEngine), its async wrapper, and the offline LLM API."""
