"""`stoker router`: an OpenAI-compatible front over several servers (docs/router.md). [no torch]"""
