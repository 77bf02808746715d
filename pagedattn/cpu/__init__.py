"""The CPU platform: the compiled extension per ISA level, CPU features, linear-kernel registry,
kernel tuner and the KernelPlan the model runner chooses before it builds the model."""
