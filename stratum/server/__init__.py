"""The HTTP front: Anthropic Messages and OpenAI chat completions over one EngineClient."""
