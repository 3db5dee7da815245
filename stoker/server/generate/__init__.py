"""Generation: completions, chat and responses over the async engine (admission, streams, SSE)."""
