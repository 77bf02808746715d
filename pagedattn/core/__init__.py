"""Core: KV cache blocks, block pool, KV cache manager and scheduler (pure Python, no torch)."""
