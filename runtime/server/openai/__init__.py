"""OpenAI-compatible API: request/response schemas and the chat/completions adapters."""
