"""One distillation run: its stages (rollout -> teacher -> train -> weight sync), the in-order loop
of the torchrun launch, the run's artifacts (checkpoints, metrics, samples log) and resume."""
