"""Tool calling: tool_choice schemas, the parsers of model-written calls, and the calls in answers."""
