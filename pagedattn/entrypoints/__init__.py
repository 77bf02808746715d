"""Entry points: the pagedattn CLI (generate, chat, serve, bench) and the OpenAI server."""
