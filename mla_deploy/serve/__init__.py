"""HTTP serving (the `serve` extra): OpenAI-compatible routes over runtime.engine. Nothing outside serve/ imports it."""
