"""The OpenAI-compatible server: `server.build_app`, `server.run_server`, `server.add_serve_args`."""
