"""The Megatron training engine: packed micro-batches through Megatron's schedules with the
distillation loss, the optimizer, the fused LM head, an optional teacher inside the step, checkpoints."""
