"""Engine: LLMEngine (add_request / step / abort), the offline LLM API, beam search, outputs."""
