"""Worker: builds the tensors of a step, runs the model and samples the next tokens."""
