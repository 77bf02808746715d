"""The OpenAI-compatible server: see `server` (build_app, run_server, add_serve_args)."""
