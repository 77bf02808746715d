"""Pictures of the KV block pool: PNG frames and animated GIFs from kv_snapshot() states."""
