"""One process: the chat and generate helpers and the OpenAI server (entrypoints/openai)."""
